"""A token that lengthens the closing path by more than the budget holds is checked in time.

Checks used to be spaced by the slack the last closing path left everywhere before the last 64
tokens, on the assumption that a token lengthens the path by at most ``GROWTH_PER_TOKEN``
tokens. One key token can lengthen it by hundreds: the ``b`` that starts ``"big"`` here, whose
value is an object of many required keys (Github_hard/o56008's ``"properties"``: 6 -> 320 Gemma
tokens). The next check found no closing path left, and max_tokens cut the output open
(``length_unclosed``). Every token of the last ``EVERY_TOKEN`` is checked now, so that key
is replaced by a closing path while one fits.
"""

from __future__ import annotations

import pytest

from espalier.constrained.compile import compile_grammar
from espalier.constrained.spec import GrammarSpec
from espalier.engine.closing import EVERY_TOKEN, ClosingPaths
from tests.fixtures.closing_feed import closed_output
from tests.fixtures.engine_fixtures import toy_tokenizer

KEYS = [f"field{i:02d}" for i in range(24)]
BIG = {
    "type": "object",
    "properties": {
        "a": {"type": "integer"},
        "big": {
            "type": "object",
            "properties": {key: {"type": "string"} for key in KEYS},
            "required": KEYS,
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("max_tokens", [120, 200, EVERY_TOKEN])
def test_a_key_that_opens_a_long_required_object_is_closed_in_time(
    backend: str, max_tokens: int
) -> None:
    tokenizer = toy_tokenizer()
    # the required object alone needs more tokens than the budget holds: no valid output has it
    compiled, _ = compile_grammar(GrammarSpec.json_schema(BIG), tokenizer, backend)
    probe = compiled.matcher()
    head = tokenizer.encode('{"a": 1, "big": {')
    assert probe.accept_tokens(head) == len(head)
    assert ClosingPaths(tokenizer).find(probe, max_tokens) is None
    text = tokenizer.encode('{"a": 1, "big": {"field00": "' + "x" * 400)  # the model goes on
    value = closed_output(BIG, backend, max_tokens, text.__getitem__)
    assert "big" not in value  # it cannot fit: closed before its key
