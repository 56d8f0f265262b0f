"""The closing search leaves a greedy loop once (``engine/closing/__init__.py``, ``search``).

A date-time string cut inside its fraction of a second (``"2019-01-20T10:00:00.000``) takes
``0`` after ``0`` for ever: the search used to give up there after 16 of them, so the closing
policy marked the request unclosable and max_tokens cut it (``length_unclosed``) although one
``+`` or ``Z`` ends the fraction (bench/validity.py --set vllm_cpu, Glaiveai2K
analyze_health_data_4ad104b4). A format that needs a character first (an e-mail's ``@``) still
gives up: a second run of the same token ends the search (the fallbacks then take over,
``engine/closing/novel.py``).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from espalier.constrained.compile import compile_grammar
from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import SamplingParams
from espalier.engine.closing import REPEAT_LIMIT, BudgetCloser, ClosingPaths
from espalier.engine.request import Request
from tests.fixtures.engine_fixtures import toy_tokenizer

DATE_TIME = {
    "type": "object",
    "properties": {"t": {"type": "string", "format": "date-time"}},
    "required": ["t"],
}


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_a_fraction_of_a_second_has_a_closing_path(backend: str) -> None:
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(DATE_TIME), tokenizer, backend)
    matcher = compiled.matcher()
    prefix = '{"t": "2019-01-20T10:00:00.000'
    ids = tokenizer.encode(prefix)
    assert matcher.accept_tokens(ids) == len(ids)
    path = ClosingPaths(tokenizer).find(matcher, 60)
    assert path is not None
    text = prefix + b"".join(tokenizer.token_bytes[t] for t in path).decode()
    jsonschema.validate(json.loads(text), DATE_TIME)
    assert len(path) < 2 * REPEAT_LIMIT


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_a_list_of_fractional_timestamps_closes_within_max_tokens(backend: str) -> None:
    schema = {"type": "object", "properties": {"data": {"type": "array", "items": DATE_TIME}}}
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(schema), tokenizer, backend)
    closer = BudgetCloser(tokenizer)
    max_tokens = 256
    request = Request("r", [1], SamplingParams(max_tokens=max_tokens), 0)
    request.matcher = compiled.matcher()
    # a long fraction: the toy vocabulary merges digits, so that a check falls inside one
    item = '{"t": "2019-01-20T10:00:00.' + "0" * 40 + 'Z"}'
    loop = tokenizer.encode('{"data": [' + ", ".join([item] * 200))
    stops = set(tokenizer.stop_token_ids)  # the model repeats the item until the budget ends
    output = _closed_output(closer, request, loop[:max_tokens], stops)
    assert len(output) <= max_tokens
    text = b"".join(tokenizer.token_bytes[t] for t in output).decode()
    jsonschema.validate(json.loads(text), schema)


FORMATS = {
    "t": {"type": "string", "format": "date-time"},
    "e": {"type": "string", "format": "email"},
    "u": {"type": "string", "format": "uuid"},
    "d": {"type": "string", "format": "date"},
    "ip": {"type": "string", "format": "ipv4"},
}


def test_a_check_that_finds_no_path_looks_again_later(gemma_tokenizer: Any) -> None:
    """Session 50's held-out sweep: five format fields, max_tokens 200, an e-mail's local part
    written on and on. The bounded searches found no path from the object's start (Gemma's
    vocabulary: they give up there), the policy marked the request
    unclosable there, and max_tokens cut it (``length_unclosed``) although from the e-mail on
    a path of under 80 tokens exists. Checks now come back after RETRY_AFTER tokens."""
    schema = {"type": "object", "properties": FORMATS, "required": list(FORMATS),
              "additionalProperties": False}  # fmt: skip
    tokenizer = gemma_tokenizer
    compiled, _ = compile_grammar(GrammarSpec.json_schema(schema), tokenizer, "llguidance")
    closer = BudgetCloser(tokenizer)
    max_tokens = 200
    request = Request("r", [1], SamplingParams(max_tokens=max_tokens), 0)
    request.matcher = compiled.matcher()
    text = '{"t": "2024-01-01T00:00:00Z", "e": "' + "abcdefgh" * 200
    tokens = tokenizer.encode_text(text)[:max_tokens]
    output = _closed_output(closer, request, tokens, set(tokenizer.stop_token_ids))
    assert len(output) <= max_tokens
    value = json.loads(b"".join(tokenizer.token_bytes[t] for t in output).decode())
    jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())


def _closed_output(
    closer: BudgetCloser, request: Request, tokens: list[int], stops: set[int]
) -> list[int]:
    """The output when ``tokens`` are sampled in turn (the policy asked before each), up to the
    closing path the policy emits instead; fails where the budget ended unclosed."""
    assert request.matcher is not None
    for token in tokens:
        closing = closer.instead(request, token, stops, 10_000)
        if closing is not None:
            return [*request.output_ids, *closing]
        assert request.matcher.accept(token)
        request.output_ids.append(token)
    raise AssertionError("cut at max_tokens")


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_a_value_is_ended_before_it_is_lengthened(backend: str, gemma_tokenizer: Any) -> None:
    """Held-out sweep: ``"id"`` with ``minimum: 1`` closed as ``1000000000000000`` (``0`` was
    tried before ``,``, until the repeat limit), a 34-token path that no budget under 34 could
    take: LENGTH_UNCLOSED at max_tokens 12 to 28. A separator now comes before ``0``."""
    schema = {"type": "object", "additionalProperties": False, "required": ["id", "b", "c"],
              "properties": {"id": {"type": "integer", "minimum": 1},
                             "b": {"type": "boolean"}, "c": {"type": "boolean"}}}  # fmt: skip
    compiled, _ = compile_grammar(GrammarSpec.json_schema(schema), gemma_tokenizer, backend)
    path = ClosingPaths(gemma_tokenizer).search(compiled.matcher(), 256)
    assert path is not None
    text = b"".join(gemma_tokenizer.token_bytes[t] for t in path).decode()
    assert json.loads(text)["id"] < 10 and len(path) <= 20, text
