"""A caller's JSON text: what ``json.loads`` takes but nothing after it can use is refused where
the text is read, with its place; valid text parses as ``json.loads`` parses it."""

from __future__ import annotations

import json

import pytest

from espalier.constrained.errors import InvalidGrammarError
from espalier.constrained.json_text import JSONTextError, loads
from espalier.constrained.schema.guard import admit_schema
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.structural_tag import canonical_source

LONG = "1" + "0" * 5000


@pytest.mark.parametrize(
    ("text", "line", "column"),
    [
        ('{"const": "\\ud800"}', 1, 12),  # a high surrogate alone
        ('{"a": "ok",\n "b": "x\\udc00"}', 2, 9),  # a low surrogate alone
        ('["\\ud83d\\ude00", "\\udbff"]', 1, 19),  # a pair, then a lone one
        ('{"const": ' + LONG + "}", 1, 11),  # past the int-from-text limit
        ("[1,\n " + "1" * 4300 + "]", 2, 2),  # at that limit, past a float64
        ('{"maximum": 2e308}', 1, 13),  # read as inf
        ('{"enum": [0, -' + "9" * 309 + "]}", 1, 14),
    ],
)
def test_refused_with_its_place(text: str, line: int, column: int) -> None:
    with pytest.raises(JSONTextError) as caught:
        loads(text)
    assert (caught.value.line, caught.value.column) == (line, column)


def test_a_raw_surrogate_is_refused() -> None:
    with pytest.raises(JSONTextError, match="lone surrogate"):
        loads('{"a": "x\ud800"}')


@pytest.mark.parametrize(
    "text",
    [
        '{"emoji": "\\ud83d\\ude00", "plain": "é", "n": -1.5e300}',
        '{"escaped": "\\\\ud800"}',  # a backslash, then the letters: not an escape
        "[" + "9" * 308 + "]",  # the largest whole numbers a float64 reaches
        "[1.7976931348623157e308, -1.7976931348623157e308, 5e-324, 1e-400]",
        "true",
    ],
)
def test_valid_text_parses_as_json_loads_does(text: str) -> None:
    assert loads(text) == json.loads(text)


def test_bad_syntax_keeps_json_loads_place() -> None:
    with pytest.raises(JSONTextError) as caught:
        loads('{"a": 1,\n "b": }')
    assert (caught.value.line, caught.value.column) == (2, 7)


@pytest.mark.parametrize(
    "read",
    [admit_schema, GrammarSpec.json_schema, canonical_source],
)
def test_each_reader_of_caller_json_refuses_a_lone_surrogate(read: object) -> None:
    text = '{"type":"structural_tag","format":{"type":"const_string","value":"\\ud800"}}'
    with pytest.raises(InvalidGrammarError) as caught:
        read(text)  # type: ignore[operator]
    assert caught.value.line == 1 and caught.value.column == 67
    assert "surrogate" in caught.value.detail


@pytest.mark.parametrize("number", ["1e400", "-" + "1" * 400])
def test_a_number_past_a_float64_is_refused_by_name(number: str) -> None:
    # it used to reach the backends: "number out of range", or "null is not of type number"
    with pytest.raises(InvalidGrammarError, match="past the range of a float64"):
        admit_schema('{"type": "number", "minimum": ' + number + "}")


def test_a_schema_with_a_5000_digit_integer_is_an_invalid_grammar() -> None:
    with pytest.raises(InvalidGrammarError, match="more than 4300 digits"):
        admit_schema('{"type": "integer", "maximum": ' + LONG + "}")
