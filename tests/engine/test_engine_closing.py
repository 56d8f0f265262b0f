"""Closing within the budget (``engine/closing/``): constrained outputs finish valid.

A tiny random-weight model rarely finishes a JSON array of strings within a few tokens, so
without the policy most outputs are cut by max_tokens; with it, every output ends with a stop
token and post-validates, and agrees token for token with the uncut run up to where it closed.
"""

from __future__ import annotations

import json
import time
from typing import Any

import jsonschema
import pytest

from espalier.constrained.backends import BACKENDS
from espalier.constrained.compile import compile_grammar
from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import ConstraintOptions, FinishReason, GenerationRequest, SamplingParams
from espalier.engine.closing import SEARCH_LIMIT, ClosingPaths
from tests.fixtures.engine_fixtures import (
    CLOSING_SCHEMA,
    make_engine,
    run_all,
    text_of,
    tokens_of,
    toy_tokenizer,
)

SCHEMA = CLOSING_SCHEMA


@pytest.mark.parametrize("backend", BACKENDS)
def test_closing_path_completes_a_partial_output(backend: str) -> None:
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(SCHEMA), tokenizer, backend)
    matcher = compiled.matcher()
    prefix = '{"names": ["ab", "c'
    for token in tokenizer.encode(prefix):
        assert matcher.accept(token)
    path = ClosingPaths(tokenizer).find(matcher, 30)
    assert path is not None
    probe = matcher.fork()
    assert all(probe.accept(t) for t in path) and probe.can_terminate()
    text = prefix + b"".join(tokenizer.token_bytes[t] for t in path).decode()
    jsonschema.validate(json.loads(text), SCHEMA)
    assert ClosingPaths(tokenizer).find(matcher, 2) is None  # too short a limit: none


def requests(max_tokens: int) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"r{i}-{backend}",
            prompt=prompt,
            sampling=SamplingParams(max_tokens=max_tokens),
            grammar=GrammarSpec.json_schema(SCHEMA),
            constraint=ConstraintOptions(backend=backend),
        )
        for i, prompt in enumerate(["abc", "hello world", '{"id": 1', "0123"])
        for backend in BACKENDS
    ]


@pytest.mark.parametrize("max_tokens", [24, 40])  # the shortest output: 20 tokens
def test_constrained_outputs_close_within_max_tokens(max_tokens: int) -> None:
    closed = run_all(make_engine(), requests(max_tokens))
    cut = run_all(make_engine(close_within_budget=False), requests(max_tokens))
    was_cut = 0
    for request_id, chunks in closed.items():
        last, tokens = chunks[-1], tokens_of(chunks)
        assert last.finish_reason in (FinishReason.STOP, FinishReason.GRAMMAR), request_id
        assert last.validation is not None and last.validation.valid, (request_id, last)
        jsonschema.validate(json.loads(text_of(chunks)), SCHEMA)
        assert len(tokens) <= max_tokens
        plain = tokens_of(cut[request_id])
        if cut[request_id][-1].finish_reason is FinishReason.LENGTH_UNCLOSED:
            was_cut += 1
            # the model's own tokens are kept up to where the engine closed
            shared = next((i for i, (a, b) in enumerate(zip(tokens, plain)) if a != b), None)
            assert shared is not None and shared > 0, request_id
        else:
            assert tokens == plain, request_id  # outputs that finish alone are untouched
    assert was_cut > 0  # the random model does get cut without the policy


def test_ignore_eos_requests_are_never_closed() -> None:
    request = GenerationRequest(
        "e",
        prompt="abc",
        sampling=SamplingParams(max_tokens=10, ignore_eos=True),
        grammar=GrammarSpec.json_schema(SCHEMA),
    )
    out: Any = run_all(make_engine(), [request])["e"][-1]
    # never closed, so the cut output is open and says so
    assert out.finish_reason is FinishReason.LENGTH_UNCLOSED
    assert len(out.token_ids) > 0 and not out.validation.valid


@pytest.mark.parametrize("backend", BACKENDS)
def test_closing_paths_spend_no_tokens_on_whitespace(backend: str) -> None:
    """Where no candidate fits and nothing is forced (DEL or more spaces may come), the
    search takes the lowest allowed token that is not whitespace: spaces would only spend the
    budget (here they would go on to the limit and find nothing)."""
    tokenizer = toy_tokenizer()
    # DEL: a byte whose id in the toy vocabulary comes after the space's (in real vocabularies
    # newline and space come before most ids)
    compiled, _ = compile_grammar(GrammarSpec.regex(" *\x7fy"), tokenizer, backend)
    matcher = compiled.matcher()
    path = ClosingPaths(tokenizer).find(matcher, 10)
    assert path is not None
    assert b"".join(tokenizer.token_bytes[t] for t in path) == b"\x7fy"


def test_whitespace_ids_are_known_once_per_tokenizer() -> None:
    # the closing search puts whitespace last; the ids come from one pass over the vocabulary,
    # made when the engine starts (not in a step) and shared by every engine on the tokenizer
    tokenizer = toy_tokenizer()
    first, second = ClosingPaths(tokenizer), ClosingPaths(tokenizer)
    assert first.blank is second.blank
    expected = {i for i, b in enumerate(tokenizer.token_bytes) if b and not b.strip()}
    assert first.blank == expected and expected  # the toy vocabulary has whitespace tokens


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize(
    ("schema", "prefix", "closing"),
    [
        ({"type": "object"}, "{", "}"),
        ({"type": "array"}, "[", "]"),
        ({"type": "object", "properties": {"a": {"type": "object"}}}, '{"a": {', "}}"),
        ({"type": "array", "items": {"type": "object"}}, "[{", "}]"),
        # inside a string a closer is content: the string is closed first
        ({"type": "object"}, '{"ab', '":""}'),
        ({"type": "array", "items": {"type": "string"}}, '["a{', '"]'),
    ],
)
def test_closing_paths_end_an_empty_container_with_its_closer(
    backend: str, schema: Any, prefix: str, closing: str
) -> None:
    """Right after ``{`` or ``[`` the shortest closing is the closer itself (``{}``), not a
    key or string opened with the ``"`` tried first (``{"":""}``)."""
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(schema), tokenizer, backend)
    matcher = compiled.matcher()
    ids = tokenizer.encode(prefix)
    assert matcher.accept_tokens(ids) == len(ids)
    path = ClosingPaths(tokenizer).find(matcher, 20)
    assert path is not None
    assert b"".join(tokenizer.token_bytes[t] for t in path).decode() == closing


def test_start_paths_are_searched_on_matcher_threads_never_in_a_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A grammar's start-state closing path (its first decision's kept path) is searched where
    the grammar service makes the request's matcher, once per grammar: the search (up to
    ~100 ms where the greedy walk fails) holds no engine step. The outputs are those of an
    engine that searches them itself (a BudgetCloser with paths of its own)."""
    import threading

    searches: list[str] = []
    search_start = ClosingPaths._search_start

    def recorded(self: ClosingPaths, matcher: Any) -> Any:
        searches.append(threading.current_thread().name)
        return search_start(self, matcher)

    monkeypatch.setattr(ClosingPaths, "_search_start", recorded)
    engine = make_engine()
    shared = run_all(engine, requests(24))
    assert engine.closer.paths is engine.grammar.closing_paths()
    assert searches
    assert all(name.startswith(("espalier-matcher", "espalier-spare")) for name in searches)
    assert len(searches) == len(BACKENDS)  # one grammar per backend, each searched once
    searches.clear()
    engine = make_engine()
    engine.closer.paths = ClosingPaths(engine.tokenizer)  # not the service's: searched in a step
    own = run_all(engine, requests(24))
    assert searches and threading.main_thread().name in searches
    assert {k: tokens_of(v) for k, v in shared.items()} == {k: tokens_of(v) for k, v in own.items()}


def test_a_start_path_is_searched_once_and_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """Callers that meet a start-path search of their grammar running wait for it (one search
    per grammar); a search that raises is not kept, and the next caller searches again."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(SCHEMA), tokenizer, "llguidance")
    paths = ClosingPaths(tokenizer)
    release, calls = threading.Event(), []
    search_start = ClosingPaths._search_start

    def slow(self: ClosingPaths, matcher: Any) -> Any:
        calls.append(1)
        release.wait(timeout=30)
        return search_start(self, matcher)

    monkeypatch.setattr(ClosingPaths, "_search_start", slow)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(paths.start_path, compiled, compiled.matcher())
        while not calls:  # the first caller's search is running (held until released)
            time.sleep(0.01)
        later = [pool.submit(paths.start_path, compiled, compiled.matcher()) for _ in range(3)]
        time.sleep(0.2)  # the later callers meet the running search (none is done before it)
        assert not any(r.done() for r in later)
        release.set()
        found = [r.result(timeout=60) for r in [first, *later]]
    assert len(calls) == 1
    assert found[0] is not None and all(f == found[0] for f in found)
    assert found[0] == ClosingPaths(tokenizer).find(compiled.matcher(), SEARCH_LIMIT)

    other, _ = compile_grammar(GrammarSpec.regex("[ab]{2,5}"), tokenizer, "llguidance")

    def failing(self: ClosingPaths, matcher: Any) -> Any:
        raise RuntimeError("the search failed")

    monkeypatch.setattr(ClosingPaths, "_search_start", failing)
    with pytest.raises(RuntimeError, match="the search failed"):
        paths.start_path(other, other.matcher())
    monkeypatch.setattr(ClosingPaths, "_search_start", search_start)
    path = paths.start_path(other, other.matcher())
    assert path is not None and len(path) >= 2
