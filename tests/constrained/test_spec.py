"""GrammarSpec: canonical text, cache keys and input errors."""

from __future__ import annotations

import pytest

from espalier.constrained.errors import InvalidGrammarError
from espalier.constrained.spec import GrammarKind, GrammarSpec


def test_schema_keeps_declared_property_order() -> None:
    a = GrammarSpec.json_schema({"properties": {"b": {}, "a": {}}})
    b = GrammarSpec.json_schema({"properties": {"a": {}, "b": {}}})
    assert list(a.schema["properties"]) == ["b", "a"]  # type: ignore[index]
    assert a != b and a.cache_key != b.cache_key  # order is part of the meaning


def test_schema_text_and_object_give_the_same_spec() -> None:
    text = '{ "type": "object",\n  "properties": {"x": {"type": "integer"}} }'
    assert GrammarSpec.json_schema(text) == GrammarSpec.json_schema(
        {"type": "object", "properties": {"x": {"type": "integer"}}}
    )
    assert hash(GrammarSpec.json_schema(text)) == hash(GrammarSpec.json_schema(text))


def test_malformed_schema_json_reports_line_and_column() -> None:
    with pytest.raises(InvalidGrammarError) as info:
        GrammarSpec.json_schema('{"type":\n  "object",, }')
    assert info.value.line == 2 and info.value.column is not None
    assert "line 2" in str(info.value)


def test_schema_must_be_object_or_boolean() -> None:
    with pytest.raises(InvalidGrammarError, match="object or a boolean"):
        GrammarSpec.json_schema("[1, 2]")
    assert GrammarSpec.json_schema(True).schema is True


def test_size_limit() -> None:
    big = {"enum": ["x" * 1000] * 2000}
    with pytest.raises(InvalidGrammarError, match="over the limit"):
        GrammarSpec.json_schema(big)
    with pytest.raises(InvalidGrammarError, match="over the limit"):
        GrammarSpec.regex("a" * 50, max_bytes=10)


def test_choice_and_kinds() -> None:
    spec = GrammarSpec.choice(["yes", "no", 'say "hi"'])
    assert spec.kind is GrammarKind.CHOICE
    assert spec.choices == ["yes", "no", 'say "hi"']
    with pytest.raises(InvalidGrammarError):
        GrammarSpec.choice([])
    with pytest.raises(InvalidGrammarError):
        GrammarSpec.choice(["ok", ""])
    with pytest.raises(InvalidGrammarError):
        GrammarSpec.ebnf("   ")
    with pytest.raises(InvalidGrammarError):
        GrammarSpec.lark("")
    assert GrammarSpec.any_json().kind is GrammarKind.ANY_JSON
    kinds = {GrammarSpec.regex("a+").cache_key[0], GrammarSpec.ebnf('root ::= "a"').cache_key[0]}
    assert kinds == {"regex", "ebnf"}
