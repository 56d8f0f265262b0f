"""The closing policy closes deep nests of the same object (``engine/closing/``).

A model that loops on ``{"task": {"task": ...`` in a recursive schema opens one object per few
tokens; closing it takes one ``}`` per level. Two things used to cut such outputs at max_tokens:
the closing search gave up after choosing ``}`` 16 times in a row (taken for a loop), and checks
started only in the last 64 tokens, where a nest deeper than that no longer fits. Here the
nest is fed token by token through the closer, as the engine does, until it closes.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from espalier.constrained.compile import compile_grammar
from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import SamplingParams
from espalier.engine.closing import CLOSING_WINDOW, BudgetCloser, ClosingPaths
from espalier.engine.request import Request
from tests.fixtures.engine_fixtures import toy_tokenizer

RECURSIVE = {"type": "object", "properties": {"task": {"$ref": "#"}}}
FREE: dict[str, Any] = {"type": "object"}


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("schema", [RECURSIVE, FREE])
def test_a_nest_deeper_than_the_repeat_limit_has_a_closing_path(backend: str, schema: Any) -> None:
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(schema), tokenizer, backend)
    matcher = compiled.matcher()
    nest = tokenizer.encode('{"task": ' * 40)
    assert matcher.accept_tokens(nest) == len(nest)
    path = ClosingPaths(tokenizer).find(matcher, 60)
    assert path is not None
    text = '{"task": ' * 40 + b"".join(tokenizer.token_bytes[t] for t in path).decode()
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("max_tokens", [150, 600])
def test_a_looping_nest_closes_within_max_tokens(backend: str, max_tokens: int) -> None:
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(RECURSIVE), tokenizer, backend)
    closer = BudgetCloser(tokenizer)
    request = Request("r", [1], SamplingParams(max_tokens=max_tokens), 0)
    request.matcher = compiled.matcher()
    stops = set(tokenizer.stop_token_ids)
    level = tokenizer.encode('{"task": ')
    closing = None
    while closing is None and len(request.output_ids) < max_tokens:
        token = level[len(request.output_ids) % len(level)]  # the loop the model is stuck in
        closing = closer.instead(request, token, stops, 10_000)
        if closing is None:
            assert request.matcher.accept(token)
            request.output_ids.append(token)
    assert closing is not None, "cut at max_tokens"
    if max_tokens == 600:  # a path longer than the window: checks began before it
        assert len(closing) > CLOSING_WINDOW
    output = [*request.output_ids, *closing]
    assert len(output) < max_tokens
    text = b"".join(tokenizer.token_bytes[t] for t in output).decode()
    jsonschema.validate(json.loads(text), RECURSIVE)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_a_required_nest_closes_in_the_tokenizers_own_tokens(
    backend: str, gemma_tokenizer: Any
) -> None:
    """Held-out sweep: 30 nested required objects at max_tokens 90 ended LENGTH_UNCLOSED
    (6/6): the greedy path takes one character per token (182 tokens), the shortest output
    is 70. The fallback spells the greedy path in the tokenizer's own tokens."""
    schema: Any = {"type": "string"}
    for _ in range(30):
        schema = {"type": "object", "properties": {"k": schema}, "required": ["k"],
                  "additionalProperties": False}  # fmt: skip
    compiled, _ = compile_grammar(GrammarSpec.json_schema(schema), gemma_tokenizer, backend)
    paths = ClosingPaths(gemma_tokenizer)
    matcher = compiled.matcher()
    assert paths.search(matcher.fork(), 89) is None  # the greedy walk alone: too long
    accepted, path = paths.or_fallback(matcher, None, 89, (True, None))
    assert accepted and path is not None and len(path) <= 89
    text = b"".join(gemma_tokenizer.token_bytes[t] for t in path).decode()
    jsonschema.validate(json.loads(text), schema)
