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
    stops = set(tokenizer.stop_token_ids)
    # a long fraction: the toy vocabulary merges digits, so that a check falls inside one
    item = '{"t": "2019-01-20T10:00:00.' + "0" * 40 + 'Z"}'
    loop = tokenizer.encode('{"data": [' + ", ".join([item] * 200))
    closing = None
    for token in loop[:max_tokens]:  # the model repeats the item until the budget ends
        closing = closer.instead(request, token, stops, 10_000)
        if closing is not None:
            break
        assert request.matcher.accept(token)
        request.output_ids.append(token)
    assert closing is not None, "cut at max_tokens"
    output = [*request.output_ids, *closing]
    assert len(output) <= max_tokens
    text = b"".join(tokenizer.token_bytes[t] for t in output).decode()
    jsonschema.validate(json.loads(text), schema)
