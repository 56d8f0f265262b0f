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

import jsonschema
import pytest

from espalier.constrained.compile import compile_grammar
from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import ConstraintOptions, FinishReason, GenerationRequest, SamplingParams
from espalier.engine.closing import ClosingPaths
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
