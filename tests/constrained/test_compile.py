"""compile_grammar: strict refusal, weakening reports, auto choice, refs, size limit, rewrites."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from espalier.constrained.compile import compile_grammar, prepare_schema
from espalier.constrained.conformance import grammar_accepts
from espalier.constrained.errors import (
    EmptyLanguageError,
    GrammarError,
    InvalidGrammarError,
    SchemaNotEnforceableError,
    UnknownBackendError,
    UnsupportedGrammarError,
)
from espalier.constrained.postvalidate import validate_instance
from espalier.constrained.schema.logic import complement
from espalier.constrained.schema.refs import directory_registry, resolve_refs
from espalier.constrained.schema.rewrite import normalize_schema
from espalier.constrained.spec import GrammarKind, GrammarSpec

SUITE = Path(__file__).resolve().parents[3] / "shared" / "conformance" / "json-schema-test-suite"
needs_suite = pytest.mark.skipif(not SUITE.is_dir(), reason="JSON Schema Test Suite not present")


def accepts(compiled: Any, tokenizer: Any, value: Any) -> bool:
    return grammar_accepts(compiled, tokenizer, json.dumps(value, ensure_ascii=False))


def test_strict_mode_names_each_keyword_and_pointer(toy_tokenizer: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "uniqueItems": True, "contains": {"const": 1}}},
    }
    with pytest.raises(SchemaNotEnforceableError) as caught:
        compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    found = {(i.keyword, i.pointer) for i in caught.value.issues}
    assert found == {("uniqueItems", "/properties/tags"), ("contains", "/properties/tags")}
    assert "'uniqueItems' at /properties/tags" in str(caught.value)


def test_allow_weakening_compiles_and_reports(toy_tokenizer: Any) -> None:
    # items that may be objects: the tracker cannot follow these unique items
    schema = {"type": "array", "items": {"type": ["integer", "object"]}, "uniqueItems": True}
    compiled, report = compile_grammar(
        GrammarSpec.json_schema(schema), toy_tokenizer, allow_weakening=True
    )
    assert [(i.keyword, i.pointer) for i in report.weakened] == [("uniqueItems", "")]
    assert report.backend == compiled.backend
    assert accepts(compiled, toy_tokenizer, [1, 2]) and not accepts(compiled, toy_tokenizer, ["a"])


def test_auto_prefers_llguidance_and_falls_back_to_an_exact_backend(toy_tokenizer: Any) -> None:
    plain = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert compile_grammar(GrammarSpec.json_schema(plain), toy_tokenizer)[1].backend == "llguidance"
    # llguidance refuses it (propertyNames next to additionalProperties and a listed name that
    # passes it: no rewrite applies)
    names = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "propertyNames": {"pattern": "^[a-z]{1,2}$"},
        "additionalProperties": {"type": "integer"},
    }
    compiled, report = compile_grammar(GrammarSpec.json_schema(names), toy_tokenizer)
    assert report.backend == "xgrammar" and report.weakened == ()
    assert accepts(compiled, toy_tokenizer, {"ab": 1})
    assert not accepts(compiled, toy_tokenizer, {"abc": 1})
    # (a name bound by maxLength is no longer exact on xgrammar: it took '{"\x01":1}', raw)


def test_named_backend_is_strict_too(toy_tokenizer: Any) -> None:
    schema = {"type": "string", "pattern": "^a+$", "minLength": 3}
    with pytest.raises(SchemaNotEnforceableError) as caught:
        compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer, "xgrammar")
    assert caught.value.backend == "xgrammar"
    compiled, report = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    assert report.backend == "llguidance"
    assert accepts(compiled, toy_tokenizer, "aaa") and not accepts(compiled, toy_tokenizer, "aa")


def test_unknown_backend(toy_tokenizer: Any) -> None:
    with pytest.raises(UnknownBackendError):
        compile_grammar(GrammarSpec.any_json(), toy_tokenizer, "nope")


def test_size_limit(toy_tokenizer: Any) -> None:
    spec = GrammarSpec.json_schema({"enum": ["x" * 2000]})
    with pytest.raises(InvalidGrammarError, match="over the limit"):
        compile_grammar(spec, toy_tokenizer, max_bytes=1000)


def test_false_schema_is_refused(toy_tokenizer: Any) -> None:
    with pytest.raises(InvalidGrammarError, match="matches no value"):
        compile_grammar(GrammarSpec.json_schema({"not": {}}), toy_tokenizer)


def test_other_kinds_go_to_a_backend_that_supports_them(toy_tokenizer: Any) -> None:
    for spec, good, bad in [
        (GrammarSpec.regex("[ab]+c"), "abc", "abd"),
        (GrammarSpec.choice(["yes", "no"]), "no", "maybe"),
        (GrammarSpec.lark('start: "x"+'), "xxx", "xy"),
        (GrammarSpec.ebnf('root ::= "a" "b"*'), "abb", "ba"),
    ]:
        compiled, report = compile_grammar(spec, toy_tokenizer)
        assert grammar_accepts(compiled, toy_tokenizer, good), (spec, report.backend)
        assert not grammar_accepts(compiled, toy_tokenizer, bad), (spec, report.backend)


@pytest.mark.parametrize(
    "lark",
    [
        'start: "n=" %json {"type": "integer", "not": {"const": 3}}',  # xgrammar took n=3
        'start: "n=" %json {"$ref": "http://127.0.0.1:9/x.json"}',  # xgrammar: any JSON
        'start: %json {"$ref": "file:///etc/hostname"}',
    ],
)
def test_a_lark_json_block_llguidance_refuses_is_not_left_to_xgrammar(
    lark: str, toy_tokenizer: Any
) -> None:
    with pytest.raises(GrammarError) as caught:
        compile_grammar(GrammarSpec.lark(lark), toy_tokenizer)
    assert "llguidance" in str(caught.value) or "JSON schema" in str(caught.value)
    with pytest.raises(UnsupportedGrammarError, match="%json"):
        compile_grammar(GrammarSpec.lark(lark), toy_tokenizer, "xgrammar")


def test_lark_json_blocks_compile_on_llguidance_and_other_lark_anywhere(
    toy_tokenizer: Any,
) -> None:
    spec = GrammarSpec.lark('start: "n=" %json {"type": "integer", "maximum": 5}')
    compiled, report = compile_grammar(spec, toy_tokenizer)
    assert report.backend == "llguidance"
    assert grammar_accepts(compiled, toy_tokenizer, "n=4")
    assert not grammar_accepts(compiled, toy_tokenizer, "n=6")
    _, report = compile_grammar(GrammarSpec.lark('start: "x"+'), toy_tokenizer, "xgrammar")
    assert report.backend == "xgrammar"


def test_a_regex_escape_xgrammar_would_read_as_its_letter_is_refused(toy_tokenizer: Any) -> None:
    """xgrammar read ``\\q`` as ``q``, where llguidance, outlines-core and the post-validator
    refuse it, so auto compiled it on xgrammar after llguidance's refusal."""
    with pytest.raises(InvalidGrammarError, match="bad escape"):
        GrammarSpec.regex("a\\q")  # Python's regex module refuses it first now
    unchecked = GrammarSpec(GrammarKind.REGEX, "a\\q")  # xgrammar's own check behind it
    with pytest.raises(InvalidGrammarError, match="regex"):
        compile_grammar(unchecked, toy_tokenizer)
    with pytest.raises(InvalidGrammarError, match="unknown escape") as caught:
        compile_grammar(unchecked, toy_tokenizer, "xgrammar")
    assert caught.value.column == 2
    for known in ("\\d+\\.\\w\\t", "a\\\\q", "[\\n\\t]x"):  # "a\\\\q": a backslash, then q
        compiled, report = compile_grammar(GrammarSpec.regex(known), toy_tokenizer, "xgrammar")
        assert report.backend == "xgrammar"
    assert grammar_accepts(compiled, toy_tokenizer, "\nx")


@needs_suite
def test_remote_refs_resolve_from_the_registry(toy_tokenizer: Any) -> None:
    registry = directory_registry(SUITE / "remotes")
    schema = {"type": "object", "properties": {"n": {"$ref": "http://localhost:1234/integer.json"}}}
    spec = GrammarSpec.json_schema(schema)
    compiled, _ = compile_grammar(spec, toy_tokenizer, registry=registry)
    assert accepts(compiled, toy_tokenizer, {"n": 3})
    assert not accepts(compiled, toy_tokenizer, {"n": "x"})
    with pytest.raises(InvalidGrammarError) as caught:
        compile_grammar(spec, toy_tokenizer)  # no registry: never the network
    assert caught.value.pointer == "/properties/n/$ref"


def test_recursive_refs_stay_local_and_finite() -> None:
    schema = {
        "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
        "$ref": "#/$defs/node",
    }
    resolved = resolve_refs(schema)
    assert resolved.recursive and resolved.hoisted == 1
    text = json.dumps(resolved.schema)
    assert text.count('"$ref"') == 2 and "#/$defs/ref0_node" in text


@pytest.mark.parametrize("draft", ["04", "06", "07"])
def test_an_id_with_an_empty_fragment_names_its_own_document(draft: str) -> None:
    """``"$id": ".../a.json#"`` (common in draft-04/06/07 schemas) is the document itself: local
    refs resolve against it, also under a nested resource whose id ends in '#'."""
    key = "id" if draft == "04" else "$id"
    schema = {
        "$schema": f"http://json-schema.org/draft-{draft}/schema#",
        key: "https://example.com/a.json#",
        "definitions": {
            "h": {"type": "string"},
            "n": {
                key: "https://example.com/b.json#",
                "definitions": {"i": {"type": "integer"}},
                "properties": {"i": {"$ref": "#/definitions/i"}},
            },
        },
        "properties": {"h": {"$ref": "#/definitions/h"}, "n": {"$ref": "#/definitions/n"}},
    }
    resolved = resolve_refs(schema).schema
    for good, bad in [({"h": "x"}, {"h": 1}), ({"n": {"i": 1}}, {"n": {"i": "x"}})]:
        assert validate_instance(schema, good).valid and validate_instance(resolved, good).valid
        assert not validate_instance(schema, bad).valid
        assert not validate_instance(resolved, bad).valid, (resolved, bad)


@pytest.mark.parametrize("draft", ["04", "06", "07"])
def test_keywords_of_later_drafts_constrain_nothing_in_an_older_one(
    draft: str, toy_tokenizer: Any
) -> None:
    """Draft 4 has no ``const`` / ``contains`` / ``propertyNames`` / ``if``, draft 6 no ``if``:
    a schema declaring it means nothing by them, as its validator (the post-validation) says,
    and the grammar agrees on every instance (Github_medium/o3385: an ``if``/``then`` under
    draft-04 rejected valid instances)."""
    schema = {
        "$schema": f"http://json-schema.org/draft-{draft}/schema#",
        "type": "object",
        "properties": {"kind": {"const": "a"}, "tags": {"type": "array", "contains": {}}},
        "if": {"properties": {"kind": {"const": "a"}}},
        "then": {"required": ["tags"]},
        "propertyNames": {"maxLength": 4},
    }
    compiled, _ = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    cases = [{"kind": "a"}, {"kind": "b"}, {"kind": "a", "tags": [1]}, {"kind": "a", "tags": []},
             {"kind": "a", "tags": [1], "longer": 1}]  # fmt: skip
    verdicts = [validate_instance(schema, value).valid for value in cases]
    assert [accepts(compiled, toy_tokenizer, value) for value in cases] == verdicts
    assert verdicts == {"04": [True] * 5, "06": [True, False, True, False, False]}.get(
        draft, [False, False, True, False, False]
    )


def test_issue_pointers_inside_refs_name_the_original_location() -> None:
    schema = {
        "$defs": {"t": {"type": "array", "uniqueItems": True}},
        "items": {"$ref": "#/$defs/t"},
    }
    issues = prepare_schema(schema).issues["llguidance"]
    assert [(i.keyword, i.pointer) for i in issues] == [("uniqueItems", "/$defs/t")]


@needs_suite
def test_rewrites_keep_the_suite_verdicts() -> None:
    """Oracle: for every core draft2020-12 test, jsonschema gives the same verdict before and
    after ref resolution (dynamic refs included) and rewriting."""
    registry = directory_registry(SUITE / "remotes")
    checked = 0
    for path in sorted((SUITE / "draft2020-12").glob("*.json")):
        if path.stem in ("format", "vocabulary"):
            continue
        for case in json.loads(path.read_text()):
            prepared = normalize_schema(resolve_refs(case["schema"], registry).schema)
            for test in case["tests"]:
                before = validate_instance(case["schema"], test["data"], registry=registry)
                after = validate_instance(prepared, test["data"], registry=registry)
                if before.checked and after.checked:
                    checked += 1
                    assert before.valid == after.valid, (path.name, case["description"], test)
    assert checked > 1000


INSTANCES = [None, True, False, 0, -3, 2.5, 7, 100, "", "a", "abc", "abcdef", [], [1], [1, "a", 2],
             {}, {"a": 1}, {"a": "x", "b": 2}, {"b": None}, {"a": 1, "b": 2, "c": 3}]  # fmt: skip
SCHEMAS = [
    {"type": "string"},
    {"type": ["number", "null"]},
    {"minimum": 2, "exclusiveMaximum": 50},
    {"minLength": 2, "maxLength": 3},
    {"minItems": 1, "maxItems": 2},
    {"minProperties": 1, "maxProperties": 2},
    {"required": ["a", "b"]},
    {"properties": {"a": {"type": "string"}, "b": {"maxLength": 0}}},
    {"anyOf": [{"type": "string", "minLength": 3}, {"maximum": 0}]},
    {"allOf": [{"type": "object"}, {"required": ["a"]}], "not": {"required": ["c"]}},
    {"not": {"type": "array"}},
    {"enum": [1, 7, "a", "abc", None, True]},
    {"const": 2.5},
    {"enum": ["", "a", False], "type": ["string", "boolean", "number"]},
    {},
    True,
    False,
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[json.dumps(s)[:40] for s in SCHEMAS])
def test_complement_is_exact(schema: Any) -> None:
    negated = complement(schema, {})
    assert negated is not None
    for value in INSTANCES:
        assert validate_instance(schema, value).valid != validate_instance(negated, value).valid


def test_no_complement_for_what_cannot_be_said() -> None:
    # a pattern's complement is said since the pattern algebra (test_pattern_rewrites.py) unless
    # the pattern is not read: a backreference, a lookahead
    unsaid = ({"pattern": "(a)\\1"}, {"pattern": "(?=a)b"})
    for schema in ({"type": "integer"}, *unsaid, {"enum": [[1]]}, {"multipleOf": 2}):
        assert complement(schema, {}) is None


def test_refusals_name_the_reasons_of_the_backend_tried(toy_tokenizer: Any) -> None:
    # llguidance enforces patternProperties but not format idn-hostname; xgrammar neither
    schema = {
        "type": "object",
        "patternProperties": {"^x": {"type": "integer"}},
        "properties": {"h": {"type": "string", "format": "idn-hostname"}},
    }
    spec = GrammarSpec.json_schema(schema)
    messages = {}
    for backend in ("auto", "xgrammar", "llguidance"):
        with pytest.raises(SchemaNotEnforceableError) as raised:
            compile_grammar(spec, toy_tokenizer, backend)
        messages[backend] = str(raised.value)
        assert {i.backend for i in raised.value.issues} == (
            {"llguidance"} if backend == "auto" else {backend}
        )
    assert "'patternProperties'" in messages["xgrammar"] and "'format'" in messages["xgrammar"]
    assert "'patternProperties'" not in messages["llguidance"]
    assert (
        "the reasons of 'llguidance'" in messages["auto"]
        and "'patternProperties'" not in messages["auto"]
    )


def test_property_counts_over_optional_names_compile_on_llguidance(toy_tokenizer: Any) -> None:
    """llguidance refuses min/maxProperties next to optional listed names; the rewrite
    (schema/property_counts.py) makes them branches it counts."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "minProperties": 1,
        "maxProperties": 2,
    }
    compiled, report = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    assert report.backend == "llguidance"
    for value in ({}, {"a": 1}, {"b": 2}, {"a": 1, "b": 2}, {"c": 3}, {"a": 1, "c": 3},
                  {"a": 1, "b": 2, "c": 3}, {"c": 1, "d": 2, "e": 3}):  # fmt: skip
        assert accepts(compiled, toy_tokenizer, value) == validate_instance(schema, value).valid


def test_empty_defs_reached_optionally_compile_on_llguidance(toy_tokenizer: Any) -> None:
    """llguidance refuses a schema when a ``$defs`` entry it reaches has no instance, even
    through an optional property: the entry is compiled as ``false`` instead; a root with no
    instance is an EmptyLanguageError."""
    schema = {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/never"}, "b": {"type": "integer"}},
        "$defs": {
            "never": {"type": "object", "oneOf": [{"type": "string"}, {"enum": ["x", "y"]}]},
        },
    }
    compiled, report = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    assert report.backend == "llguidance"
    for value in ({}, {"b": 1}, {"a": {}}, {"a": "x"}, {"b": "1"}):
        assert accepts(compiled, toy_tokenizer, value) == validate_instance(schema, value).valid
    required = {**schema, "required": ["a"]}
    with pytest.raises(EmptyLanguageError):
        compile_grammar(GrammarSpec.json_schema(required), toy_tokenizer)


def test_overlapping_pattern_properties_of_every_or_one_name_compile_on_llguidance(
    toy_tokenizer: Any,
) -> None:
    """llguidance refuses patternProperties that may match one name; a pattern matching every
    name or a single one is taken out (schema/pattern_properties.py)."""
    schema = {
        "type": "object",
        "patternProperties": {
            ".*": {"type": "integer"},
            "^a": {"minimum": 1},
            "^ab$": {"maximum": 5},
        },
    }
    compiled, report = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    assert report.backend == "llguidance"
    for value in ({}, {"a": 1}, {"a": 0}, {"b": 0}, {"b": "x"}, {"ab": 5}, {"ab": 6}, {"ab": 0}):
        assert accepts(compiled, toy_tokenizer, value) == validate_instance(schema, value).valid


def test_property_counts_llguidance_cannot_count_are_named_not_called_invalid(
    toy_tokenizer: Any,
) -> None:
    """Twelve optional names (propertyNames listed) with ``minProperties: 2`` are past
    property_counts' branches; llguidance refuses such a count at compile ("min/maxProperties
    only supported when all keys listed ... are required"), which a sibling xgrammar does not
    enforce made the answer: "invalid json_schema". The keyword and its pointer are named."""
    counted = {"type": "object", "propertyNames": {"pattern": "^[a-c]{1,2}$"}, "minProperties": 2}
    schema = {
        "type": "object",
        "properties": {"p": counted, "x": {"type": "string", "format": "ipv4"}},
        "required": ["p", "x"],
        "additionalProperties": False,
    }
    with pytest.raises(SchemaNotEnforceableError) as caught:
        compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    assert "'minProperties' at /properties/p (ignored)" in str(caught.value)
    compiled, report = compile_grammar(GrammarSpec.json_schema(counted), toy_tokenizer)
    assert report.backend == "xgrammar" and not report.weakened
    for value in ({"a": 1, "b": 2}, {"a": 1}, {"a": 1, "d": 2}, {"aa": 1, "cc": None}):
        assert accepts(compiled, toy_tokenizer, value) == validate_instance(counted, value).valid


def test_overlapping_pattern_properties_beside_closed_objects_are_not_called_empty(
    toy_tokenizer: Any,
) -> None:
    """llguidance compiles overlapping patternProperties without them; kept alone, their
    ``additionalProperties: false`` forbade the names the patterns took, and the narrower
    language's emptiness (``required: [a]``) was taken as the schema's on every backend. Both go
    together: strict compiles name what no backend enforces, and weakened ones generate."""
    schema = {
        "type": "object",
        "patternProperties": {"^[ab]$": {"type": "integer"}, "b$": {}},
        "additionalProperties": False,
        "required": ["a"],
    }
    assert validate_instance(schema, {"a": 1}).valid
    with pytest.raises(SchemaNotEnforceableError) as caught:
        compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer, "llguidance")
    found = {(i.keyword, i.support) for i in caught.value.issues}
    assert found == {("patternProperties", "ignored"), ("additionalProperties", "ignored")}
    with pytest.raises(SchemaNotEnforceableError):
        compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    compiled, report = compile_grammar(
        GrammarSpec.json_schema(schema), toy_tokenizer, "llguidance", allow_weakening=True
    )
    assert {i.keyword for i in report.weakened} == {"patternProperties", "additionalProperties"}
    assert accepts(compiled, toy_tokenizer, {"a": 1})


@pytest.mark.parametrize(
    ("backend", "schema", "keyword", "via", "others"),
    [
        ("xgrammar", {"type": "object", "propertyNames": {"maxLength": 1}}, "propertyNames",
         "'patternProperties'", []),
        ("outlines_core", {"type": "object", "propertyNames": {"maxLength": 1}}, "propertyNames",
         "'patternProperties'", []),
    ],
)  # fmt: skip
def test_refusals_name_the_callers_keyword_a_rewrite_replaced(
    toy_tokenizer: Any,
    backend: str,
    schema: dict[str, Any],
    keyword: str,
    via: str,
    others: list[tuple[str, str, str]],
) -> None:
    with pytest.raises(SchemaNotEnforceableError) as info:
        compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer, backend)
    found = [(i.keyword, i.pointer, i.via) for i in info.value.issues]
    assert sorted(found) == sorted([(keyword, "", via), *others])
    assert f"'{keyword}' at / (" in str(info.value) and f"rewritten as {via}" in str(info.value)


@pytest.mark.parametrize("backend", ["xgrammar", "outlines_core", "llguidance"])
def test_keywords_beside_branches_are_moved_into_them(backend: str, toy_tokenizer: Any) -> None:
    """A held-out sweep: xgrammar and outlines-core compile a node with an ``anyOf`` / ``oneOf``
    as its branches alone (``{"type": "integer", "anyOf": [{}], "maximum": 6}`` wrote 6422,
    finish stop). The keywords beside them are merged into every branch
    (``logic.distributed_branches``), and where they stay the backends' profiles name them.
    ``minProperties`` rewritten as an ``anyOf`` of required names is now exact on xgrammar."""
    cases = [
        ({"type": "integer", "anyOf": [{}], "maximum": 6}, [3], [6422, "a"]),
        ({"type": "string", "oneOf": [{}], "pattern": "^a$"}, ["a"], ["b"]),
        (
            {"type": "object", "properties": {"A": {"type": "integer"}},
             "additionalProperties": False, "minProperties": 1},
            [{"A": 1}], [{}, {"B": 1}, {"A": 1, "B": 2}],
        ),
        (
            {"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
             "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "additionalProperties": False},
            [{"a": 1}, {"b": 2}, {"a": 1, "b": 2}], [{}, {"c": 1}, {"a": "x"}],
        ),
        (
            {"type": "array", "anyOf": [{"minItems": 1}], "items": {"type": "boolean"},
             "maxItems": 2},
            [[True], [True, False]], [[], [1], [True, True, True]],
        ),
    ]  # fmt: skip
    compiled_any = 0
    for schema, valid, invalid in cases:
        try:
            compiled, report = compile_grammar(
                GrammarSpec.json_schema(schema), toy_tokenizer, backend
            )
        except SchemaNotEnforceableError:
            continue  # named, not let through
        compiled_any += 1
        assert not report.weakened
        for value in valid:
            assert accepts(compiled, toy_tokenizer, value), (schema, value)
        for value in invalid:
            assert not accepts(compiled, toy_tokenizer, value), (schema, value)
    assert compiled_any >= 2


LEXER_TOO_BIG: dict[str, Any] = {
    "definitions": {
        "setConfigValueResult": {
            "properties": {
                "command": {"enum": ["set-configvalue-result"]},
                "parameters": {
                    "properties": {
                        "pid": {"type": "string"},
                        "key": {"type": "string"},
                        "value": {"type": "string"},
                        "status": {"pattern": "OK"},
                    },
                    "required": ["pid", "key", "value", "status"],
                },
            }
        },
        "getConfigValueResult": {
            "properties": {
                "command": {"enum": ["get-configvalue-result"]},
                "parameters": {
                    "type": "object",
                    "properties": {
                        "pid": {"type": "string"},
                        "key": {"type": "string"},
                        "value": {"type": "string"},
                    },
                    "required": ["pid", "key", "value"],
                },
            }
        },
        "errorResult": {
            "properties": {
                "command": {"enum": ["error"]},
                "parameters": {
                    "type": "object",
                    "properties": {
                        "command": {"enum": ["get-configvalue", "set-configvalue"]},
                        "cause": {
                            "enum": ["missing-parameter", "unknown-configvalue", "exception"]
                        },
                        "missing-parameter": {"type": "string"},
                        "unknown-configvalue": {"type": "string"},
                        "exception-cause": {"type": "string"},
                        "exception-message": {"type": "string"},
                        "exception-stacktrace": {"type": "string"},
                    },
                    "required": ["command", "cause"],
                },
            }
        },
    },
    "oneOf": [
        {},
        {"$ref": "#/definitions/setConfigValueResult"},
        {"$ref": "#/definitions/getConfigValueResult"},
        {"$ref": "#/definitions/errorResult"},
    ],
}  # JSONSchemaBench Github_medium o66069, minimized by a held-out sweep


@pytest.mark.model
def test_llguidance_lexer_limit_is_called_a_limit_not_a_fault(gemma_tokenizer: Any) -> None:
    """The schema is valid; llguidance's lexer for it passes its size limit. The message said
    "invalid json_schema: initial lexer configuration (grammar) too big". Unsupported, not
    invalid: auto goes on to the other backends, whose verdicts say more."""
    with pytest.raises(UnsupportedGrammarError) as caught:
        compile_grammar(GrammarSpec.json_schema(LEXER_TOO_BIG), gemma_tokenizer, "llguidance")
    assert "passes its size limit" in str(caught.value)
    assert "the grammar is valid but too large here" in str(caught.value)


def test_branches_after_the_move_keep_what_compiled_and_drop_what_is_empty(
    toy_tokenizer: Any,
) -> None:
    """A second sweep on ``distributed_branches``: ``uniqueItems`` beside an ``anyOf`` was
    moved under it, where the tracker follows no place (refused on every backend; now left in
    place), and branches emptied by the move (``exclusiveMinimum: 5`` with ``maximum: 5``, an
    integer within [5.5, 5.9]) failed xgrammar's compile ("Invalid range"); they are dropped.
    ``maxItems`` under ``prefixItems`` (xgrammar refuses it at compile) is named."""
    unique = {
        "type": "array",
        "uniqueItems": True,
        "minItems": 2,
        "maxItems": 3,
        "items": {"type": "string", "pattern": "^[xy]{1,2}$"},
    }
    beside = {
        "type": "object",
        "properties": {"t": unique, "u": {"type": "integer"}},
        "additionalProperties": False,
        "anyOf": [{"required": ["t"]}, {"required": ["u"]}],
    }
    compiled, report = compile_grammar(GrammarSpec.json_schema(beside), toy_tokenizer)
    assert report.backend == "llguidance" and not report.weakened
    for schema, valid, invalid in [
        (
            {"type": "integer", "exclusiveMinimum": 5, "anyOf": [{"maximum": 5}, {"maximum": 8}]},
            [6, 8],
            [5, 9],
        ),
        (
            {
                "type": "integer",
                "anyOf": [{"minimum": 5.5, "maximum": 5.9}, {"minimum": 20, "maximum": 21}],
            },
            [20, 21],
            [5, 6, 22],
        ),
        (  # a closed object of one name cannot hold two (a final re-check sweep)
            {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 5}},
                "required": ["a"],
                "additionalProperties": False,
                "anyOf": [{"minProperties": 2}, {"properties": {"a": {"maximum": 8}}}],
            },
            [{"a": 5}, {"a": 8}],
            [{"a": 9}, {}, {"a": 5, "b": 1}],
        ),
    ]:
        compiled, report = compile_grammar(
            GrammarSpec.json_schema(schema), toy_tokenizer, "xgrammar"
        )
        for value in valid:
            assert accepts(compiled, toy_tokenizer, value), (schema, value)
        for value in invalid:
            assert not accepts(compiled, toy_tokenizer, value), (schema, value)
    short = {
        "type": "array",
        "prefixItems": [{"type": "integer"}],
        "items": False,
        "anyOf": [{"minItems": 1}, {"maxItems": 0}],
    }
    with pytest.raises(SchemaNotEnforceableError, match="'maxItems' at /anyOf/1"):
        compile_grammar(GrammarSpec.json_schema(short), toy_tokenizer, "xgrammar")
    compiled, report = compile_grammar(GrammarSpec.json_schema(short), toy_tokenizer)
    for value, valid in (([], True), ([1], True), ([1, 2], False), (["a"], False)):
        assert accepts(compiled, toy_tokenizer, value) == valid, value


@pytest.mark.parametrize("names", ["patternProperties", "propertyNames"])
def test_name_patterns_llguidance_reads_with_escapes_are_printed_without_controls(
    names: str, toy_tokenizer: Any
) -> None:
    """A second sweep: ``^[^"]+$`` as a property-name pattern was weakened on llguidance (its
    values' patterns were printed without controls already). Beside ``additionalProperties:
    false`` the names are printed the same way."""
    if names == "patternProperties":
        schema: dict[str, Any] = {
            "type": "object",
            "additionalProperties": False,
            "patternProperties": {'^[^"]+$': {"type": "integer"}},
        }
    else:
        schema = {"type": "object", "propertyNames": {"pattern": '^[^"\\\\]{1,5}$'}}
    compiled, report = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    assert report.backend == "llguidance" and not report.weakened
    for value, valid in (({"ab": 1}, True), ({'a"b': 1}, False), ({"a\\b": 1}, None)):
        expected = validate_instance(schema, value).valid if valid is None else valid
        assert accepts(compiled, toy_tokenizer, value) == expected, value


def test_a_long_ref_chain_is_a_clear_error(toy_tokenizer: Any) -> None:
    # 1,000 refs each to the next: a RecursionError in the ref resolver ended INTERNAL
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(1000)}
    defs["d1000"] = {"type": "integer"}
    spec = GrammarSpec.json_schema({"$defs": defs, "$ref": "#/$defs/d0"})
    with pytest.raises(InvalidGrammarError, match="too deep to compile"):
        compile_grammar(spec, toy_tokenizer)


@pytest.mark.parametrize(
    ("schema", "rewritten"),
    [
        ({"type": "string", "maxLength": 2**53}, {"type": "string"}),
        ({"type": "array", "maxItems": 1e12, "minItems": 2}, {"type": "array", "minItems": 2}),
        ({"type": "object", "maxProperties": 2**64}, {"type": "object"}),
        ({"type": "array", "minItems": 2**64}, False),
        ({"type": ["string", "null"], "minLength": 10**12}, {"type": ["null"]}),
        (
            {"minProperties": 2**31},
            {"type": ["array", "boolean", "integer", "null", "number", "string"]},
        ),
        ({"type": "string", "maxLength": 2**31 - 1}, {"type": "string", "maxLength": 2**31 - 1}),
        ({"type": "string", "minLength": 2**31 - 1}, {"type": "string", "minLength": 2**31 - 1}),
    ],
)
def test_counts_past_what_an_output_holds_are_rewritten(schema: Any, rewritten: Any) -> None:
    # llguidance failed to parse its own regex for maxLength 2**53 ("decimal literal invalid"),
    # xgrammar refused minItems past 2**31 - 1, outlines-core wrapped 2**64 to 0
    assert normalize_schema(schema) == rewritten


@pytest.mark.parametrize("backend", ["auto", "llguidance", "xgrammar", "outlines_core"])
def test_a_maximum_count_past_what_an_output_holds_compiles_exactly(
    backend: str, toy_tokenizer: Any
) -> None:
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": 10**12}},
        "required": ["s"],
    }
    compiled, report = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer, backend)
    assert report.weakened == ()
    assert accepts(compiled, toy_tokenizer, {"s": "abc"})
    assert not accepts(compiled, toy_tokenizer, {"s": 1})


def test_a_minimum_count_past_what_an_output_holds_leaves_the_other_types(
    toy_tokenizer: Any,
) -> None:
    spec = GrammarSpec.json_schema({"anyOf": [{"type": "integer"}, {"minLength": 2**40}]})
    compiled, _ = compile_grammar(spec, toy_tokenizer)
    assert accepts(compiled, toy_tokenizer, 5)
    assert accepts(compiled, toy_tokenizer, [1])  # not a string: minLength holds
    assert not accepts(compiled, toy_tokenizer, "ab")
    too_many = GrammarSpec.json_schema({"type": "array", "minItems": 2**64})
    with pytest.raises(EmptyLanguageError, match="more characters, items or properties"):
        compile_grammar(too_many, toy_tokenizer)
    required = {"type": "object", "properties": {"a": {"type": "string", "minLength": 2**40}}}
    with pytest.raises(EmptyLanguageError) as caught:
        compile_grammar(GrammarSpec.json_schema({**required, "required": ["a"]}), toy_tokenizer)
    assert caught.value.pointer == "/properties/a"


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "integer", "minimum": 1e19}, "minimum"),  # xgrammar: "Check failed"
        ({"type": "integer", "maximum": -(2**63) - 1}, "maximum"),
        ({"type": "integer", "minimum": 10**400 - 1}, "minimum"),  # xgrammar: "RuntimeError"
        ({"type": "number", "minimum": 2**53 + 1}, "minimum"),  # xgrammar took 2**53
    ],
)
def test_bounds_no_backend_reads_exactly_are_refused_by_name(
    schema: Any, keyword: str, toy_tokenizer: Any
) -> None:
    with pytest.raises(SchemaNotEnforceableError) as caught:
        compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    assert f"'{keyword}' at /" in str(caught.value)


@pytest.mark.parametrize("regex", ["(a)\\1", "a(?=b)b"])
def test_what_no_backend_reads_is_autos_verdict(regex: str, toy_tokenizer: Any) -> None:
    """A held-out sweep: ``(a)\\1`` under auto was "backend 'llguidance' does not support ..."
    on the field ``constraint.backend``, a backend the caller never named."""
    with pytest.raises(UnsupportedGrammarError) as caught:
        compile_grammar(GrammarSpec.regex(regex), toy_tokenizer)
    assert caught.value.backend == "auto"
    assert "none of llguidance, xgrammar, outlines_core takes it" in str(caught.value)
    with pytest.raises(UnsupportedGrammarError) as named:
        compile_grammar(GrammarSpec.regex(regex), toy_tokenizer, "llguidance")
    assert named.value.backend == "llguidance"


def test_a_circular_ref_with_siblings_is_unsupported_on_llguidance_not_invalid(
    toy_tokenizer: Any,
) -> None:
    """A held-out sweep: a valid schema whose recursive ``$ref`` has sibling keywords came back
    INVALID_GRAMMAR ("invalid json_schema: circular references with sibling keys are not
    supported"), naming a ``$defs/refN_*`` of espalier's own rewrite. It is a form llguidance
    does not take: UNSUPPORTED_GRAMMAR, and ``auto`` tries the other backends."""
    from espalier.constrained.errors import UnsupportedGrammarError

    schema = {"type": "object", "properties": {"c": {"$ref": "#", "maxProperties": 1}}}
    with pytest.raises(UnsupportedGrammarError, match="circular references") as info:
        compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer, "llguidance")
    assert info.value.reason == "UNSUPPORTED_GRAMMAR"
