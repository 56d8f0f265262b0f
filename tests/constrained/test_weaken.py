"""``allow_weakening`` on llguidance: what it refuses at compile is dropped and reported.

llguidance refuses a schema holding a keyword it does not implement ("Unimplemented keys"), a
format it does not know or overlapping ``oneOf`` branches; under ``allow_weakening`` the schema
it compiles goes without them (``schema/weaken.py``) and ``CompileReport.weakened`` names each,
as the xgrammar path reports the keywords xgrammar drops. Strict mode still refuses.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from espalier.constrained.backends import get_backend
from espalier.constrained.compile import compile_grammar
from espalier.constrained.conformance import grammar_accepts
from espalier.constrained.errors import GrammarError, SchemaNotEnforceableError
from espalier.constrained.schema.features import LLGUIDANCE
from espalier.constrained.schema.weaken import weakened_schema
from espalier.constrained.spec import GrammarSpec

TAGS = {"type": "array", "items": {"type": ["string", "object"]}}
# (schema, the weakened keyword's (keyword, pointer), an instance only the keyword rejects,
# an instance the rest of the schema still rejects)
CASES = {
    "uniqueItems": (
        {"type": "object", "properties": {"tags": {**TAGS, "uniqueItems": True}}},
        ("uniqueItems", "/properties/tags"),
        {"tags": ["a", "a"]},
        {"tags": [1]},
    ),
    "contains": (
        {**TAGS, "contains": {"type": "object"}, "minContains": 2},
        ("contains", ""),
        ["a"],
        [2],
    ),
    "format-iri": (
        {"type": "object", "properties": {"home": {"type": "string", "format": "iri"}}},
        ("format", "/properties/home"),
        {"home": "no iri"},
        {"home": 3},
    ),
    "not": (
        {"type": "integer", "not": {"multipleOf": 7}},
        ("not", ""),
        14,
        "a",
    ),
    "oneOf-overlapping": (
        {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 3}]},
        ("oneOf", ""),
        5,
        "a",
    ),
}


def accepts(compiled: Any, tokenizer: Any, value: Any) -> bool:
    return grammar_accepts(compiled, tokenizer, json.dumps(value, ensure_ascii=False))


@pytest.mark.parametrize("name", list(CASES))
def test_llguidance_weakens_what_it_refuses_and_reports_it(name: str, toy_tokenizer: Any) -> None:
    schema, issue, only_keyword_rejects, still_rejected = CASES[name]
    spec = GrammarSpec.json_schema(schema)
    with pytest.raises(SchemaNotEnforceableError) as strict:
        compile_grammar(spec, toy_tokenizer, "llguidance")
    assert issue in {(i.keyword, i.pointer) for i in strict.value.issues}
    compiled, report = compile_grammar(spec, toy_tokenizer, "llguidance", allow_weakening=True)
    assert report.backend == compiled.backend == "llguidance"
    assert issue in {(i.keyword, i.pointer) for i in report.weakened}
    assert accepts(compiled, toy_tokenizer, only_keyword_rejects)  # generated without it
    assert not accepts(compiled, toy_tokenizer, still_rejected)  # the rest still holds


def test_auto_weakening_takes_llguidance_with_the_fewest_issues(toy_tokenizer: Any) -> None:
    schema, issue, _, _ = CASES["format-iri"]
    spec = GrammarSpec.json_schema(schema)
    _, report = compile_grammar(spec, toy_tokenizer, allow_weakening=True)
    assert report.backend == "llguidance"
    assert [(i.keyword, i.pointer) for i in report.weakened] == [issue]


@pytest.mark.parametrize("keyword", sorted(LLGUIDANCE.refused))
def test_llguidance_refuses_what_its_profile_says(keyword: str, toy_tokenizer: Any) -> None:
    """The profile's claim: each of these alone makes llguidance refuse the schema, and none
    is claimed exact (so the weakened report always names it)."""
    assert keyword not in LLGUIDANCE.exact
    value: Any = {"$recursiveAnchor": True, "uniqueItems": True}.get(keyword, {})
    if keyword in ("minContains", "maxContains"):
        value = 1
    elif keyword in ("$dynamicRef", "$recursiveRef", "$dynamicAnchor"):
        value = "#" if keyword.endswith("Ref") else "a"
    engine = get_backend("llguidance", toy_tokenizer)
    with pytest.raises(GrammarError):
        engine.compile(GrammarSpec.json_schema({keyword: value}))
    assert weakened_schema("llguidance", {"type": "array", keyword: value}) == {"type": "array"}


def test_weakened_schema_keeps_what_llguidance_takes() -> None:
    schema = {"type": "string", "format": "date-time", "pattern": "^2", "$defs": {"x": {"not": {}}}}
    assert weakened_schema("llguidance", schema) == {**schema, "$defs": {"x": {}}}
    plain = {"type": "object", "properties": {"a": {"format": "email"}}}
    assert weakened_schema("llguidance", plain) is plain
    assert weakened_schema("xgrammar", {"uniqueItems": True, "format": "iri"}) == {
        "uniqueItems": True,
        "format": "iri",
    }
    both = {"anyOf": [{"type": "integer"}], "oneOf": [{"minimum": 1}, {"maximum": 5}]}
    assert weakened_schema("llguidance", both) == {
        "anyOf": [{"type": "integer"}],
        "allOf": [{"anyOf": [{"minimum": 1}, {"maximum": 5}]}],
    }


@pytest.mark.parametrize("backend", ["xgrammar", "outlines_core"])
@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "^\\\\$"},  # one backslash
        {"type": "object", "properties": {"v": {"type": "string", "pattern": '^a"$'}}},
    ],
)
def test_a_pattern_that_writes_broken_json_is_dropped_and_reported_ignored(
    backend: str, schema: dict[str, Any], toy_tokenizer: Any
) -> None:
    """Held-out sweep: under allow_weakening ``^\\\\\\\\$`` wrote ``"\\\\"`` (unterminated) on
    both backends, reported only as a weakened pattern."""
    compiled, report = compile_grammar(
        GrammarSpec.json_schema(schema), toy_tokenizer, backend, allow_weakening=True
    )
    assert [(i.keyword, i.support) for i in report.weakened] == [("pattern", "ignored")]
    string = schema.get("type") == "string"
    assert not grammar_accepts(compiled, toy_tokenizer, '"\\"' if string else '{"v": "a""}')
    assert grammar_accepts(compiled, toy_tokenizer, '"ab"' if string else '{"v": "ab"}')


@pytest.mark.parametrize("fmt", ["ipv6", "email"])
def test_outlines_drops_the_formats_it_does_not_compile_into_json(
    fmt: str, toy_tokenizer: Any
) -> None:
    """Held-out sweep: "Format ipv6 is not supported by Outlines" under allow_weakening, and
    its email wrote raw quotes."""
    schema = {"type": "string", "format": fmt}
    _, report = compile_grammar(
        GrammarSpec.json_schema(schema), toy_tokenizer, "outlines_core", allow_weakening=True
    )
    assert [(i.keyword, i.support) for i in report.weakened] == [("format", "ignored")]


@pytest.mark.parametrize("pattern", ["^(a|b)\\1$", "^\\bfoo\\b$", "^(?P<x>a)(?P=x)$"])
def test_a_pattern_no_backend_compiles_is_named_and_dropped(
    pattern: str, toy_tokenizer: Any
) -> None:
    """Held-out sweep: backreferences and word boundaries (Python compiles both) got
    INVALID_GRAMMAR "regex parse error" with no pointer, strict and weak."""
    schema = {"type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}}
    with pytest.raises(SchemaNotEnforceableError, match="'pattern' at /properties/p"):
        compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    _, report = compile_grammar(
        GrammarSpec.json_schema(schema), toy_tokenizer, allow_weakening=True
    )
    assert [(i.keyword, i.pointer, i.support) for i in report.weakened] == [
        ("pattern", "/properties/p", "ignored")
    ]


def test_a_false_subschema_xgrammar_refuses_is_dropped_when_weakening(toy_tokenizer: Any) -> None:
    """Held-out sweep: dependentRequired (rewritten with ``properties: {"card": false}``)
    failed xgrammar's compile under allow_weakening ("Schema 'false' cannot accept any
    value"), although strict mode had offered allow_weakening for it."""
    schema = {"type": "object", "properties": {"card": {"type": "string"},
              "cvv": {"type": "string"}}, "dependentRequired": {"card": ["cvv"]}}  # fmt: skip
    with pytest.raises(SchemaNotEnforceableError):
        compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer, "xgrammar")
    compiled, report = compile_grammar(
        GrammarSpec.json_schema(schema), toy_tokenizer, "xgrammar", allow_weakening=True
    )
    assert any("dependentRequired" in i.keyword.split(", ") for i in report.weakened)
    assert grammar_accepts(compiled, toy_tokenizer, '{"card": "a", "cvv": "b"}')
