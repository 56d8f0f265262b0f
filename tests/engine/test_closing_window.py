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

import pytest

from espalier.engine.closing import CLOSING_WINDOW
from tests.fixtures.closing_feed import closed_output
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
    head = tokenizer.encode('{"items": [')
    item = tokenizer.encode(json.dumps({KEY: 1}) + ", ")  # the loop the model is stuck in
    closed_output(
        ITEMS,
        backend,
        max_tokens,
        lambda n: head[n] if n < len(head) else item[(n - len(head)) % len(item)],
    )
