"""The closing fallback that walks out of an open run (``engine/closing/novel.py``).

A string whose end needs one particular character first (an e-mail's ``@``, ``^[a-z]*y$``'s
``y``, ``[^@]+@x``) made the greedy search go round its run and the backtracking search find
nothing, so max_tokens cut the output (``length_unclosed``; a held-out sweep saw 4 of 4 such
outputs cut, through gRPC and the OpenAI API alike). The walk that takes the token leading to a
row it has not seen closes them.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from espalier.constrained.compile import compile_grammar
from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import ConstraintOptions, FinishReason, GenerationRequest, SamplingParams
from espalier.engine.closing import (
    FALLBACK_RUNS,
    LOWEST_ALLOWED,
    RETRY_AFTER,
    SEARCH_LIMIT,
    BudgetCloser,
    ClosingPaths,
    novel,
)
from espalier.engine.request import Request
from tests.fixtures.engine_fixtures import make_engine, run_all, text_of, toy_tokenizer

EMAIL = {"type": "object", "properties": {"e": {"type": "string", "format": "email"}}}
CASES = [
    (GrammarSpec.json_schema({"type": "string", "pattern": "^[a-z]*y$"}), '"abcab'),
    (GrammarSpec.json_schema({"type": "string", "pattern": "^[^@]+@[^@]+$"}), '"ab'),
    (GrammarSpec.json_schema(EMAIL), '{"e": "abab'),
    (GrammarSpec.regex("[^@]+@x"), "abc"),
    (GrammarSpec.regex(r"\w+@\w+\.com"), "abc"),
]


def _valid(spec: GrammarSpec, text: str) -> bool:
    if spec.kind.value == "regex":
        return re.fullmatch(spec.source, text) is not None
    try:
        checker = jsonschema.FormatChecker()
        jsonschema.validate(json.loads(text), spec.schema, format_checker=checker)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize(("spec", "prefix"), CASES, ids=[p for _, p in CASES])
def test_a_run_that_needs_one_character_has_a_closing_path(
    backend: str, spec: GrammarSpec, prefix: str
) -> None:
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(spec, tokenizer, backend)
    matcher = compiled.matcher()
    ids = tokenizer.encode(prefix)
    assert matcher.accept_tokens(ids) == len(ids)
    accepted, path = ClosingPaths(tokenizer).search_after(matcher, None, 60)
    assert accepted and path is not None
    probe = matcher.fork()
    assert probe.accept_tokens(path) == len(path) and probe.can_terminate()
    text = prefix + b"".join(tokenizer.token_bytes[t] for t in path).decode()
    assert _valid(spec, text), text


def test_sampled_outputs_that_must_end_in_one_character_close_within_max_tokens() -> None:
    spec = GrammarSpec.json_schema({"type": "string", "pattern": "^[a-z]*y$"})
    requests = [
        GenerationRequest(
            f"r{seed}",
            prompt="x",
            sampling=SamplingParams(temperature=1.0, seed=seed, max_tokens=20),
            grammar=spec,
            constraint=ConstraintOptions(backend="llguidance"),
        )
        for seed in range(4)
    ]
    chunks = run_all(make_engine(num_blocks=512), requests)
    for name, out in chunks.items():
        assert out[-1].finish_reason is FinishReason.STOP, (name, text_of(out))
        assert re.fullmatch("[a-z]*y", json.loads(text_of(out))), text_of(out)


UNCLOSABLE = GrammarSpec.json_schema({"type": "string", "minLength": 1000, "maxLength": 100000})


@pytest.mark.parametrize("limit", [29, 200])
def test_a_walk_that_finds_nothing_scans_a_run_once(
    limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A string no path within the limit closes (its rows all alike past the quote): the walk
    used to try every choice at every character, and the lead bytes of multi-byte characters
    (each an unseen row), until TRIES grammar steps (10 such requests held the engine 7.5 s);
    now it scans the run once and takes one step per character from there."""
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(UNCLOSABLE, tokenizer, "llguidance")
    matcher = compiled.matcher()
    paths = ClosingPaths(tokenizer)
    rows = 0
    fill = type(matcher).fill_bitmask

    def counted(self: object, *args: object) -> object:
        nonlocal rows
        rows += 1
        return fill(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(type(matcher), "fill_bitmask", counted)
    assert paths.novel.find(matcher, limit) is None
    assert rows <= limit + 2 * len(paths.novel.single_bytes) + LOWEST_ALLOWED, rows
    assert rows < novel.TRIES // 2


def _watched_closer(
    max_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, BudgetCloser, Request, list[int]]:
    """A closer, a request of :data:`UNCLOSABLE` (llguidance, toy tokenizer) and the limits
    of the novel walks the closer runs, in order."""
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(UNCLOSABLE, tokenizer, "llguidance")
    closer = BudgetCloser(tokenizer)
    assert closer.paths is not None
    walks: list[int] = []
    find = closer.paths.novel.find

    def counted(matcher: object, limit: int) -> list[int] | None:
        walks.append(limit)
        return find(matcher, limit)  # type: ignore[arg-type]

    monkeypatch.setattr(closer.paths.novel, "find", counted)
    request = Request("r", [1], SamplingParams(max_tokens=max_tokens), 0)
    request.matcher = compiled.matcher()
    request.compiled = compiled
    return tokenizer, closer, request, walks


def test_a_grammar_whose_start_has_no_path_is_not_searched_again_at_the_first_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The start state's search (its fallbacks included) found none: the first token's check
    is RETRY_AFTER tokens later, as after any check that finds none, not a second search of
    the same state at the first token."""
    tokenizer, closer, request, walks = _watched_closer(30, monkeypatch)
    stops = set(tokenizer.stop_token_ids)
    quote = tokenizer.encode('"')
    assert closer.instead(request, quote[0], stops, 10_000) is None
    assert walks == [SEARCH_LIMIT]  # the start path's search alone
    assert closer.known("r") is None
    tokens = tokenizer.encode('"' + "ab" * 40)[: RETRY_AFTER + 2]
    assert len(tokens) == RETRY_AFTER + 2
    for token in tokens[:-1]:
        assert closer.instead(request, token, stops, 10_000) is None
        assert request.matcher.accept(token)
        request.output_ids.append(token)
    assert walks == [SEARCH_LIMIT]
    assert closer.instead(request, tokens[-1], stops, 10_000) is None
    assert len(walks) == 2  # the next check: the current state searched, its fallbacks too


def test_a_request_runs_the_fallbacks_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A string no path closes, over a long budget: checks come back every RETRY_AFTER
    tokens, and each ran the fallbacks (tens to hundreds of ms of Python) again; now the
    fallbacks run at FALLBACK_RUNS checks at most, the greedy search at every one."""
    max_tokens = 150
    tokenizer, closer, request, walks = _watched_closer(max_tokens, monkeypatch)
    stops = set(tokenizer.stop_token_ids)
    tokens = tokenizer.encode('"' + "ab" * 400)[: max_tokens - 1]
    assert len(tokens) == max_tokens - 1
    for token in tokens:
        assert closer.instead(request, token, stops, 10_000) is None
        assert request.matcher.accept(token)
        request.output_ids.append(token)
    assert walks[0] == SEARCH_LIMIT  # the start path's
    assert len(walks) == 1 + FALLBACK_RUNS, walks
