"""Inside the closing window every token is checked (``engine/closing/``).

Before the window, checks are spaced by the slack the last closing path left, on the
assumption that a token lengthens the path by at most ``GROWTH_PER_TOKEN`` tokens. One token can
lengthen it by far more: ``{`` opening an array item whose required key is long makes the path
``"kkk…": 0}]}`` from ``]}``. Inside the window a check comes at every token, so such a token is
replaced by a closing path while one still fits, instead of leaving an output that max_tokens
cuts open. Fed here token by token through the closer, as the engine does.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from espalier.constrained.compile import compile_grammar
from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import SamplingParams
from espalier.engine.closing import CLOSING_WINDOW, BudgetCloser, ClosingPaths
from espalier.engine.request import Request
from tests.fixtures.engine_fixtures import toy_tokenizer

KEY = "k" * 24
ITEMS = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {KEY: {"type": "integer"}},
                "required": [KEY],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("max_tokens", [41, 46, 53, 63])
def test_a_token_that_lengthens_the_path_past_the_budget_is_closed(
    backend: str, max_tokens: int
) -> None:
    assert max_tokens <= CLOSING_WINDOW
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(ITEMS), tokenizer, backend)
    closer, paths = BudgetCloser(tokenizer), ClosingPaths(tokenizer)
    request = Request("r", [1], SamplingParams(max_tokens=max_tokens), 0)
    request.matcher = compiled.matcher()
    stops = set(tokenizer.stop_token_ids)
    head = tokenizer.encode('{"items": [')
    item = tokenizer.encode(json.dumps({KEY: 1}) + ", ")  # the loop the model is stuck in
    closing = None
    while closing is None and len(request.output_ids) < max_tokens:
        n = len(request.output_ids)
        token = head[n] if n < len(head) else item[(n - len(head)) % len(item)]
        closing = closer.instead(request, token, stops, 10_000)
        if closing is None:
            assert request.matcher.accept(token)
            request.output_ids.append(token)
            # every token let through leaves a state that still closes in time
            left = max_tokens - len(request.output_ids)
            assert paths.find(request.matcher, left - 1) is not None, len(request.output_ids)
    assert closing is not None, "cut at max_tokens"
    output = [*request.output_ids, *closing]
    assert len(output) < max_tokens
    text = b"".join(tokenizer.token_bytes[t] for t in output).decode()
    jsonschema.validate(json.loads(text), ITEMS)
