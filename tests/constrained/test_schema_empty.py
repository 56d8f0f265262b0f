"""Schemas with no finite instance are refused at compile, also past the grammar's start state;
schemas with one never are (checked on every schema of the JSON Schema Test Suite that has a
valid test instance)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from espalier.constrained.backends import get_backend
from espalier.constrained.compile import compile_grammar
from espalier.constrained.conformance import default_dialect, find_files, iter_cases
from espalier.constrained.errors import (
    EmptyLanguageError,
    FirstMaskLimitError,
    GrammarError,
    InvalidGrammarError,
    SchemaNotEnforceableError,
)
from espalier.constrained.schema.empty import unproductive_pointer
from espalier.constrained.schema.productive import refuse_empty_language
from espalier.constrained.schema.refs import resolve_refs
from espalier.constrained.schema.rewrite import normalize_schema
from espalier.constrained.spec import GrammarKind, GrammarSpec

SUITE = Path(__file__).resolve().parents[3] / "shared" / "conformance" / "json-schema-test-suite"
NESTS_FOREVER = {
    "type": "object",
    "properties": {"a": {"$ref": "#"}},
    "required": ["a"],
    "additionalProperties": False,
}
LIST_NODE = {
    "type": "object",
    "properties": {"next": {"$ref": "#/$defs/node"}},
    "required": ["next"],
}

EMPTY = [
    (NESTS_FOREVER, "/properties/a"),
    ({"$ref": "#"}, ""),
    ({"enum": []}, ""),
    ({"allOf": [{"type": "string"}, False]}, "/allOf/1"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "/properties/a"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "/additionalProperties"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "/items"),
    ({"type": "array", "prefixItems": [{}, False], "minItems": 2}, "/prefixItems/1"),
    ({"type": "array", "contains": {"$ref": "#"}}, "/contains"),
    (
        {
            "$defs": {"node": LIST_NODE},
            "type": "object",
            "properties": {"head": {"$ref": "#/$defs/node"}},
            "required": ["head"],
        },
        "/properties/head",
    ),
    ({"anyOf": [{"$ref": "#"}, {"type": "array", "items": {"$ref": "#"}, "minItems": 1}]}, ""),
    # a member without "type" is read with its holder's: SMG's tool_choice "required" shape
    (
        {
            "$defs": {"node": LIST_NODE},
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "anyOf": [
                    {
                        "properties": {
                            "name": {"const": "t"},
                            "parameters": {"$ref": "#/$defs/node"},
                        },
                        "required": ["name", "parameters"],
                    }
                ],
            },
        },
        "/items",
    ),
    (
        {"type": "object", "allOf": [{"anyOf": [{"required": ["a"], "properties": {"a": False}}]}]},
        "/allOf/0",
    ),
]
SATISFIABLE = [
    {"type": "object", "properties": {"a": {"$ref": "#"}}},  # {} ends it
    {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
    {
        "$defs": {"node": LIST_NODE},
        "type": "object",
        "properties": {"head": {"$ref": "#/$defs/node"}},
    },
    {"anyOf": [{"type": "string"}, {"type": "array", "items": {"$ref": "#"}, "minItems": 1}]},
    {
        "type": "object",
        "required": ["a"],
        "additionalProperties": False,
        "patternProperties": {"^a$": {}},
    },
    {"type": "array", "contains": {"$ref": "#"}, "minContains": 0},
    # a member's own type, or a holder that allows a scalar, keeps it satisfiable
    {"type": ["object", "null"], "anyOf": [{"required": ["a"], "properties": {"a": False}}]},
    {
        "type": "object",
        "anyOf": [{"type": "object"}, {"required": ["a"], "properties": {"a": False}}],
    },
    {
        "type": "string",
        "minLength": 5,
        "maxLength": 2,
    },  # empty, but not read here: left to backends
]


@pytest.mark.parametrize(("schema", "pointer"), EMPTY)
def test_schemas_without_a_finite_instance_are_found_with_a_pointer(
    schema: dict[str, Any], pointer: str
) -> None:
    assert unproductive_pointer(schema) == pointer


@pytest.mark.parametrize("schema", SATISFIABLE)
def test_schemas_with_a_finite_instance_are_not(schema: dict[str, Any]) -> None:
    assert unproductive_pointer(schema) is None


def test_a_required_property_that_nests_forever_is_refused_past_the_start_state(
    toy_tokenizer: Any,
) -> None:
    spec = GrammarSpec.json_schema(NESTS_FOREVER)
    compiled = get_backend("llguidance", toy_tokenizer).compile(spec)
    refuse_empty_language(compiled, toy_tokenizer)  # "{" is allowed: the start state passes
    with pytest.raises(InvalidGrammarError) as caught:
        compile_grammar(spec, toy_tokenizer, "llguidance")
    assert caught.value.pointer == "/properties/a"
    assert "no finite JSON value" in str(caught.value)


@pytest.mark.skipif(not SUITE.is_dir(), reason="JSON Schema Test Suite not present")
def test_no_schema_with_a_valid_instance_in_the_test_suite_is_found_empty() -> None:
    checked = 0
    for path in find_files(SUITE / "draft2020-12") + find_files(SUITE / "draft7"):
        dialect = default_dialect(path)
        for _description, schema, tests in iter_cases(path):
            if not any(test.get("valid") for test in tests):
                continue
            if dialect and isinstance(schema, dict) and "$schema" not in schema:
                schema = {"$schema": dialect, **schema}
            try:
                prepared = normalize_schema(resolve_refs(schema).schema)
            except InvalidGrammarError:
                continue  # remote refs: no registry here
            assert unproductive_pointer(prepared) is None, (path.name, schema)
            checked += 1
    assert checked > 500


def test_a_backend_limit_at_the_first_mask_is_not_called_an_empty_language(
    gemma_tokenizer: Any,
) -> None:
    """llguidance's parser item limit ("Too many items") on a GBNF grammar that has texts (an
    ambiguous one: one-character repeats in a row pass even ``STEP_MAX_ITEMS`` on Gemma)."""
    grammar = GrammarSpec.ebnf('root ::= [ -~]* [ -~]* "a"')
    with pytest.raises(InvalidGrammarError) as info:
        compile_grammar(grammar, gemma_tokenizer, "llguidance")
    assert "could not compute the grammar's first mask" in str(info.value)
    assert "matches no text" not in str(info.value)


def test_auto_names_an_empty_grammar_that_one_backend_stopped_on(toy_tokenizer: Any) -> None:
    """llguidance stops at its first mask on a left-recursive rule that never ends
    (NoExtensionBias, a limit); the verdict of the next backend tried is the one reported.
    (Built past the request check, which refuses it before any backend: ``gbnf.unproductive``.)"""
    grammar = GrammarSpec(GrammarKind.LARK, 'start: start "a"')
    with pytest.raises(FirstMaskLimitError):
        compile_grammar(grammar, toy_tokenizer, "llguidance")
    with pytest.raises(InvalidGrammarError) as info:
        compile_grammar(grammar, toy_tokenizer)
    assert not isinstance(info.value, FirstMaskLimitError)
    assert "matches no text at all" in str(info.value)


LLGUIDANCE_FINDS_EMPTY = [
    {"type": "array", "contains": False},
    {"type": "string", "pattern": "^(?!)$"},
    {"type": "array", "minItems": 2, "maxItems": 1},
]


@pytest.mark.parametrize("schema", LLGUIDANCE_FINDS_EMPTY)
@pytest.mark.parametrize("backend", ["auto", "xgrammar", "outlines_core"])
def test_a_schema_llguidance_finds_empty_is_refused_on_every_backend(
    schema: dict[str, Any], backend: str, toy_tokenizer: Any
) -> None:
    """``auto`` went on past llguidance's verdict to xgrammar, which compiled these into
    grammars that wrote text of no JSON type (``":["``), and outlines-core spent its compile
    timeout on them: every backend now refuses them as llguidance does."""
    with pytest.raises(GrammarError) as info:
        compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer, backend)
    if not isinstance(info.value, EmptyLanguageError):  # refused first for a keyword it lacks
        assert isinstance(info.value, SchemaNotEnforceableError) and backend == "outlines_core"
    else:
        assert "no JSON value matches" in str(info.value)


@pytest.mark.skipif(not SUITE.is_dir(), reason="JSON Schema Test Suite not present")
def test_no_schema_with_a_valid_instance_in_the_test_suite_is_empty_to_llguidance(
    toy_tokenizer: Any,
) -> None:
    """The verdict every backend now takes from llguidance is never wrong on the suite."""
    checked = found = 0
    for path in find_files(SUITE / "draft2020-12"):
        for _description, schema, tests in iter_cases(path):
            if not isinstance(schema, dict) or "$ref" in json.dumps(schema):
                continue
            try:
                compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer, "llguidance")
            except EmptyLanguageError:
                found += 1
                assert not any(test.get("valid") for test in tests), (path.name, schema)
            except GrammarError:
                pass
            checked += 1
    assert checked > 250 and found > 0


@pytest.mark.parametrize(
    ("schema", "pointer"),
    [
        (
            {
                "type": "object",
                "patternProperties": {"^[ab]$": {"type": "integer"}},
                "additionalProperties": False,
                "minProperties": 3,
            },
            "",
        ),
        (
            {
                "type": "object",
                "properties": {
                    "x": {
                        "type": "object",
                        "patternProperties": {"^(b|cc)$": {}, "^(d|e)$": {}},
                        "additionalProperties": False,
                        "minProperties": 5,
                    }
                },
                "required": ["x"],
            },
            "/properties/x",
        ),
        (
            {
                "type": "object",
                "properties": {"a": {}},
                "additionalProperties": False,
                "minProperties": 2,
            },
            "",
        ),
        (  # optional listed names: the property-count rewrite used to spread the count over
            # anyOf branches, and generation ended at a dead end
            {
                "type": "object",
                "properties": {
                    "o": {
                        "type": "object",
                        "properties": {"x": {"type": "integer"}, "y": {}},
                        "required": ["y"],
                        "patternProperties": {"^[ab]$": {}},
                        "additionalProperties": False,
                        "minProperties": 5,
                    }
                },
                "required": ["o"],
            },
            "/properties/o",
        ),
    ],
)
def test_more_keys_than_the_names_can_make_is_refused_with_a_pointer(
    schema: dict[str, Any], pointer: str, toy_tokenizer: Any
) -> None:
    # generated until every key was taken, then ended INTERNAL "duplicate key: every token ..."
    with pytest.raises(EmptyLanguageError) as caught:
        compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    assert caught.value.pointer == pointer


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "patternProperties": {"^[ab]$": {}}, "additionalProperties": False,
         "minProperties": 2},
        {"type": "object", "patternProperties": {"^[ab]+$": {}}, "additionalProperties": False,
         "minProperties": 50},
        {"type": "object", "properties": {"a": {}}, "minProperties": 3},
        {"type": ["object", "null"], "properties": {"a": {}}, "additionalProperties": False,
         "minProperties": 2},
    ],
)  # fmt: skip
def test_enough_keys_or_another_type_is_not_refused(schema: dict[str, Any]) -> None:
    assert unproductive_pointer(schema) is None
