"""Probe tests of the exact schema rewrites: ``jsonschema`` gives every random instance the same
verdict on the original schema and on the rewritten one (refs resolved, ``normalize_schema``),
and the rewrite removed the keyword it is for (so strict mode can compile it)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from espalier.constrained.backends import get_backend
from espalier.constrained.conformance import grammar_accepts
from espalier.constrained.postvalidate import validate_instance
from espalier.constrained.schema.refs import prune_unused_defs, resolve_refs
from espalier.constrained.schema.rewrite import normalize_schema
from espalier.constrained.schema.walk import walk
from espalier.constrained.spec import GrammarSpec

NAMES = ("a", "b", "c", "foo", "bar", "x1", "aa")
SCALARS = (None, True, False, 0, 1, -2, 2.5, 7, "", "a", "foo", "bar", "xyz", "then")


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value drawn from small pools, so that random objects hit the schemas' names."""
    roll = rng.random()
    if depth >= 2 or roll < 0.4:
        return rng.choice(SCALARS)
    if roll < 0.7:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    names = rng.sample(NAMES, rng.randrange(5))
    return {name: random_value(rng, depth + 1) for name in names}


def mismatches(schema: Any, rewritten: Any, count: int, seed: int = 0) -> list[Any]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        value = random_value(rng)
        if validate_instance(schema, value).valid != validate_instance(rewritten, value).valid:
            out.append(value)
    return out


def rewrite(schema: Any) -> Any:
    return normalize_schema(resolve_refs(schema).schema)


def keywords(schema: Any) -> set[str]:
    return {k for node in walk(schema) if isinstance(node.schema, dict) for k in node.schema}


UNEVALUATED = [
    {"properties": {"a": {}}, "allOf": [{"properties": {"b": {}}}], "unevaluatedProperties": False},
    {
        "allOf": [{"patternProperties": {"^x": {}}}, {"$ref": "#/$defs/f"}],
        "$defs": {"f": {"properties": {"foo": {"type": "string"}}}},
        "unevaluatedProperties": {"type": "integer"},
    },
    {"allOf": [{"additionalProperties": {"type": "string"}}], "unevaluatedProperties": False},
    {"allOf": [{"unevaluatedProperties": True}], "unevaluatedProperties": False},
    {
        "properties": {"a": {"properties": {"b": {}}, "unevaluatedProperties": False}},
        "not": {"properties": {"c": {}}, "required": ["c"]},
        "unevaluatedProperties": False,
    },
    {"prefixItems": [{}], "allOf": [{"prefixItems": [{}, {"type": "string"}]}],
     "unevaluatedItems": False},
    {"allOf": [{"prefixItems": [{}]}, {"unevaluatedItems": True}], "unevaluatedItems": False},
    {"allOf": [{"items": {"type": "integer"}}], "unevaluatedItems": False},
]  # fmt: skip


@pytest.mark.parametrize("schema", UNEVALUATED, ids=[json.dumps(s)[:50] for s in UNEVALUATED])
def test_static_unevaluated_becomes_plain_keywords(schema: Any) -> None:
    rewritten = rewrite(schema)
    assert not {"unevaluatedProperties", "unevaluatedItems"} & keywords(rewritten), rewritten
    assert mismatches(schema, rewritten, 400) == []


@pytest.mark.parametrize(
    "schema",
    [
        {"anyOf": [{"properties": {"a": {}}}, {}], "unevaluatedProperties": False},
        {"if": {"properties": {"a": {}}}, "then": {}, "unevaluatedProperties": False},
        {"contains": {"type": "string"}, "unevaluatedItems": False},
        {"oneOf": [{"prefixItems": [{}]}, {}], "unevaluatedItems": False},
    ],
)
def test_instance_dependent_unevaluated_is_left_alone(schema: Any) -> None:
    rewritten = rewrite(schema)
    assert {"unevaluatedProperties", "unevaluatedItems"} & keywords(rewritten)
    assert mismatches(schema, rewritten, 200) == []


PROPERTY_NAMES = [
    {"propertyNames": {"maxLength": 2}},
    {"propertyNames": {"minLength": 2, "maxLength": 3},
     "properties": {"a": {}, "foo": {"type": "string"}}},
    {"type": "object", "propertyNames": {"pattern": "^[a-c]+$"},
     "properties": {"aa": {"const": 1}, "x1": {}}},
    {"propertyNames": {"enum": ["a", "foo", 3]}, "properties": {"a": {"type": "integer"}, "b": {}}},
    {"propertyNames": {"const": "bar"}, "required": ["bar"]},
    {"propertyNames": {"type": "integer"}},
    {"propertyNames": {"minLength": 3, "maxLength": 2}},
    {"propertyNames": {"maxLength": 2}, "additionalProperties": {"type": "string"}},
    {"propertyNames": {"pattern": "^[a-c]+$"}, "additionalProperties": {"type": "integer"},
     "properties": {"foo": {"type": "string"}, "x1": {}}},
    {"propertyNames": {"pattern": "^[a-c]+$"}, "additionalProperties": False,
     "properties": {"aa": {"type": "string"}, "foo": {}}},
    {"propertyNames": {"enum": ["a", "foo"]}, "additionalProperties": {"type": "string"},
     "properties": {"a": {"type": "integer"}, "b": {}}},
]  # fmt: skip


@pytest.mark.parametrize("schema", PROPERTY_NAMES, ids=[json.dumps(s)[:50] for s in PROPERTY_NAMES])
def test_property_names_become_property_keywords(schema: Any) -> None:
    rewritten = rewrite(schema)
    assert "propertyNames" not in keywords(rewritten), rewritten
    assert mismatches(schema, rewritten, 400) == []


@pytest.mark.parametrize(
    "schema",
    [
        {"propertyNames": {"pattern": "^a", "maxLength": 2}},  # an intersection: no one regex
        {"propertyNames": {"maxLength": 2}, "patternProperties": {"^f": {}}},
        # a listed name that passes would also get additionalProperties' schema
        {
            "propertyNames": {"maxLength": 2},
            "additionalProperties": {"type": "string"},
            "properties": {"a": {"type": "integer"}},
        },
    ],
)
def test_property_names_that_need_more_are_left_alone(schema: Any) -> None:
    assert "propertyNames" in keywords(rewrite(schema))


POINTER_ALPHABET = "/~01a#9"


@pytest.mark.parametrize("name", ["json-pointer", "relative-json-pointer"])
def test_pointer_format_patterns_match_the_checker(name: str) -> None:
    rng = random.Random(1)
    schema = {"type": "string", "format": name}
    rewritten = rewrite(schema)
    assert "format" not in keywords(rewritten)
    texts = ["", "/", "0", "01", "0#", "1#/", "٠"]
    texts += ["".join(rng.choices(POINTER_ALPHABET, k=rng.randrange(6))) for _ in range(1500)]
    wrong = []
    for text in texts:
        checker = validate_instance(schema, text).valid
        if checker != validate_instance(rewritten, text).valid and text.isascii():
            wrong.append(text)
    assert wrong == []


LABEL63 = "a" * 62 + "b"
LONG_HOST = ".".join([LABEL63] * 3 + ["a" * 61])  # 253 characters


def _hostname_texts(rng: random.Random) -> list[str]:
    label63, label64, long_name = LABEL63, "a" * 63 + "b", LONG_HOST
    texts = ["", ".", "a", "a.", "a..b", "-a", "a-", "a-b", "A9.b-c.", "a_b", "a\n", "é.com"]
    texts += [label63, label64, long_name, long_name + ".", long_name + "a", "\u212a"]
    alphabet = "ab9-._Z\n"
    texts += ["".join(rng.choices(alphabet, k=rng.randrange(1, 9))) for _ in range(1500)]
    return texts


def _email_texts(rng: random.Random) -> list[str]:
    texts = ["", "@", "a@b", "ab", "\n@\n", "é@é", "a\nb"]
    return texts + ["".join(rng.choices("a@.\n é", k=rng.randrange(6))) for _ in range(500)]


# where the checker and the pattern may disagree: a false reject, never a false accept
CHECKER_ONLY = {"hostname": {"a\n", "\u212a", LONG_HOST + "."}}


@pytest.mark.parametrize(
    ("name", "texts"), [("hostname", _hostname_texts), ("idn-email", _email_texts)]
)
def test_host_and_email_format_patterns_match_the_checker(name: str, texts: Any) -> None:
    schema = {"type": "string", "format": name}
    rewritten = rewrite(schema)
    assert "format" not in keywords(rewritten)
    wrong = []
    for text in texts(random.Random(2)):
        checker = validate_instance(schema, text).valid
        pattern = validate_instance(rewritten, text).valid
        if pattern and not checker:
            wrong.append(("false accept", text))
        elif checker != pattern and text not in CHECKER_ONLY.get(name, set()):
            wrong.append(("false reject", text))
    assert wrong == []


VALUE_SETS = [
    ["a", "ab", "b", ""],
    ["foo", "fo]o", "^", "-", "a\nb", "é"],
    [1, 7, 2.5, -3, "a", None, True],
    [False, 0],
    # runs every member goes on with are spelled flat (one group level per branching)
    ["abab]^-ab", "abab]x", "ab", "b-b-b"],
]


@pytest.mark.parametrize("values", VALUE_SETS, ids=[json.dumps(v)[:40] for v in VALUE_SETS])
def test_not_enum_is_the_complement_of_the_members(values: list[Any]) -> None:
    schema = {"not": {"enum": values}}
    rewritten = rewrite(schema)
    assert "not" not in keywords(rewritten), rewritten
    rng = random.Random(2)
    alphabet = "ab]^-\né0"
    texts = ["".join(rng.choices(alphabet, k=rng.randrange(4))) for _ in range(400)]
    near = [v[:i] + x for v in values if isinstance(v, str) for i in range(len(v) + 1)
            for x in ("", "a", "]", "\n")]  # fmt: skip
    pool = [*values, *texts, *near, 0, 1.0, 7.5, -4, 1e300, [], {}, None, True, False]
    wrong = [
        value
        for value in pool
        if validate_instance(schema, value).valid != validate_instance(rewritten, value).valid
    ]
    assert wrong == []
    assert mismatches(schema, rewritten, 200) == []


def test_the_complement_of_long_members_stays_within_the_regex_nesting_limit(
    toy_tokenizer: Any,
) -> None:
    """Github_medium/o74551: llguidance refused the trie of a 56-character member nested one
    group per character ("regex parse error")."""
    members = ["megaradrp.products.wavecalibration.WavelengthCalibration",
               "megaradrp.products.tracemap.TraceMap"]  # fmt: skip
    schema = {"type": "string", "not": {"enum": members}}
    rewritten = rewrite(schema)
    compiled = get_backend("llguidance", toy_tokenizer).compile(GrammarSpec.json_schema(rewritten))
    near = [m[:i] + x for m in members for i in range(0, len(m) + 1, 5) for x in ("", "a", ".")]
    for text in [*members, *near]:
        valid = validate_instance(schema, text).valid
        assert grammar_accepts(compiled, toy_tokenizer, json.dumps(text)) == valid, text


ONE_OF = [
    # the discriminator is required next to the oneOf, not in the branches
    {"type": "object", "required": ["a"],
     "oneOf": [{"properties": {"a": {"const": 1}, "b": {}}},
               {"properties": {"a": {"enum": [2, 3]}}}]},
    # a property one branch requires, the other forbids (additionalProperties false)
    {"oneOf": [{"type": "object", "properties": {"a": {}}, "additionalProperties": False},
               {"type": "object", "required": ["b"]}]},
    # a required property whose types the other branch's patternProperties exclude
    {"oneOf": [{"type": "object", "required": ["foo"], "properties": {"foo": {"type": "string"}}},
               {"type": "object", "required": ["bar"],
                "patternProperties": {"^f": {"type": "null"}}}]},
    # overlapping ({} matches both): "this branch and not the other", through const complements
    {"type": "object", "oneOf": [{"properties": {"a": {"const": 1}}},
                                 {"properties": {"a": {"const": "foo"}}}]},
    # closed objects ({} matches both): the other branch's additionalProperties: false is
    # violated by a name this branch allows (GitHub_trivial/o10020)
    {"type": "object",
     "oneOf": [{"additionalProperties": False, "properties": {"a": {"type": "string"}}},
               {"additionalProperties": False, "properties": {"b": {"type": "array"}}}]},
    # the other branch's properties outside this branch's names need no complement (pattern)
    {"type": "object",
     "oneOf": [{"additionalProperties": False, "properties": {"a": {"pattern": "^x"}}},
               {"additionalProperties": False, "properties": {"b": {"pattern": "y"}}}]},
    # closed by the parent; a branch's patternProperties and additionalProperties schema
    {"properties": {"a": {}, "b": {}, "foo": {}}, "additionalProperties": False,
     "oneOf": [{"patternProperties": {"^f": {"type": "string"}}},
               {"properties": {"a": {}}, "additionalProperties": {"type": "string"}},
               {"required": ["b"]}]},
    # an unknown keyword constrains nothing (a typo of additionalProperties)
    {"oneOf": [{"type": "object", "additioalProperties": False, "required": ["a"]},
               {"type": "object", "required": ["b"]}]},
]  # fmt: skip


@pytest.mark.parametrize("schema", ONE_OF, ids=[json.dumps(s)[:50] for s in ONE_OF])
def test_one_of_becomes_any_of(schema: Any) -> None:
    rewritten = rewrite(schema)
    assert "oneOf" not in keywords(rewritten), rewritten
    assert mismatches(schema, rewritten, 600) == []


NOT_IN_CONTEXT = [
    {"additionalProperties": False, "properties": {"a": {}, "b": {}},
     "not": {"additionalProperties": False, "properties": {"a": {}}}},
    {"type": "object", "propertyNames": {"enum": ["a", "foo"]},
     "not": {"patternProperties": {"^f": {"type": "string"}}}},
    {"additionalProperties": False, "properties": {"a": {}, "c": {}},
     "if": {"additionalProperties": {"type": "string"}}, "then": {"required": ["a"]},
     "else": {"required": ["c"]}},
]  # fmt: skip


@pytest.mark.parametrize("schema", NOT_IN_CONTEXT, ids=[json.dumps(s)[:50] for s in NOT_IN_CONTEXT])
def test_not_of_open_keywords_among_closed_names_is_rewritten(schema: Any) -> None:
    rewritten = rewrite(schema)
    assert not {"not", "if"} & keywords(rewritten), rewritten
    assert mismatches(schema, rewritten, 600) == []


def test_not_additional_properties_of_open_names_is_left_alone() -> None:
    schema = {"type": "object", "not": {"additionalProperties": False, "properties": {"a": {}}}}
    assert "not" in keywords(rewrite(schema))


def test_overlapping_one_of_without_complements_is_left_alone() -> None:
    # {} matches both branches, and "not pattern" has no schema for a lookbehind (the pattern
    # algebra does not read it; plain patterns and the lookaheads it reads, such as a final
    # "(?=x)": tests/constrained/test_pattern_rewrites.py)
    behind = [{"properties": {"a": {"pattern": p}}} for p in ("(?<=x)", "(?<=y)")]
    schema = {"type": "object", "oneOf": behind}
    assert "oneOf" in keywords(rewrite(schema))


UNIQUE_ITEMS = [
    {"type": "array", "items": {"enum": ["a", "b", 1, 1.0]}, "uniqueItems": True},
    {"prefixItems": [{"type": "boolean"}, {"type": "boolean"}], "items": False,
     "uniqueItems": True},
    {"items": {"type": ["boolean", "null"]}, "uniqueItems": True, "minItems": 2},
    {"prefixItems": [{"const": 1}], "items": {"enum": [1, 7, "a"]}, "maxItems": 3,
     "uniqueItems": True},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3},
     "uniqueItems": True, "minItems": 2, "maxItems": 4},
    {"items": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9, "multipleOf": 3},
     "uniqueItems": True},
    {"items": {"type": "integer", "minimum": -1.5, "exclusiveMaximum": 2, "multipleOf": 0.5},
     "uniqueItems": True},
]  # fmt: skip


@pytest.mark.parametrize("schema", UNIQUE_ITEMS, ids=[json.dumps(s)[:50] for s in UNIQUE_ITEMS])
def test_unique_items_over_finite_domains_becomes_enum(schema: Any) -> None:
    rewritten = rewrite(schema)
    assert "uniqueItems" not in keywords(rewritten), rewritten
    rng = random.Random(3)
    pool = [None, True, False, -1, 0, 1, 1.0, 1.5, 2, 3, 3.0, 6, 7, 9, "a", "b"]
    arrays = [rng.choices(pool, k=rng.randrange(5)) for _ in range(600)]
    wrong = [
        value
        for value in arrays
        if validate_instance(schema, value).valid != validate_instance(rewritten, value).valid
    ]
    assert wrong == []
    assert mismatches(schema, rewritten, 200) == []


def test_unique_items_over_open_domains_is_left_alone() -> None:
    wide = {"type": "integer", "minimum": 0, "maximum": 256}
    for schema in (
        {"uniqueItems": True},
        {"items": {"type": "string"}, "uniqueItems": True},
        {"items": wide, "uniqueItems": True},
        {"items": {"type": "integer", "minimum": 0}, "uniqueItems": True},
    ):
        assert "uniqueItems" in keywords(rewrite(schema))


DYNAMIC = [
    {  # the outermost $dynamicAnchor in scope wins: items must be strings
        "$id": "https://example.test/root",
        "$ref": "list",
        "$defs": {
            "foo": {"$dynamicAnchor": "items", "type": "string"},
            "list": {
                "$id": "list",
                "type": "array",
                "items": {"$dynamicRef": "#items"},
                "$defs": {"items": {"$dynamicAnchor": "items"}},
            },
        },
    },
    {  # a recursive tree extended in place: every node needs "a", children included
        "$id": "https://example.test/strict",
        "$dynamicAnchor": "node",
        "$ref": "tree",
        "required": ["a"],
        "$defs": {
            "tree": {
                "$id": "tree",
                "$dynamicAnchor": "node",
                "type": "object",
                "properties": {
                    "a": {"type": "integer"},
                    "b": {"type": "array", "items": {"$dynamicRef": "#node"}},
                },
            }
        },
    },
    {  # the same tree alone: the extension's anchor is not in scope
        "$id": "https://example.test/tree",
        "$dynamicAnchor": "node",
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"items": {"$dynamicRef": "#node"}}},
    },
    {  # two paths reach one $dynamicRef with different scopes
        "$id": "https://example.test/paths",
        "anyOf": [{"$ref": "numbers"}, {"$ref": "strings"}],
        "$defs": {
            "generic": {
                "$id": "generic",
                "properties": {"a": {"items": {"$dynamicRef": "#item"}}},
                "$defs": {"default": {"$dynamicAnchor": "item"}},
            },
            "numbers": {
                "$id": "numbers",
                "$ref": "generic",
                "$defs": {"item": {"$dynamicAnchor": "item", "type": "number"}},
            },
            "strings": {
                "$id": "strings",
                "$ref": "generic",
                "required": ["a"],
                "$defs": {"item": {"$dynamicAnchor": "item", "type": "string"}},
            },
        },
    },
    {  # Draft 2019-09: $recursiveRef follows the outermost $recursiveAnchor
        "$schema": "https://json-schema.org/draft/2019-09/schema",
        "$id": "https://example.test/rec",
        "$recursiveAnchor": True,
        "$ref": "tree",
        "required": ["a"],
        "$defs": {
            "tree": {
                "$id": "tree",
                "$recursiveAnchor": True,
                "type": "object",
                "properties": {
                    "a": {"type": "integer"},
                    "b": {"type": "array", "items": {"$recursiveRef": "#"}},
                },
            }
        },
    },
    {  # $dynamicRef to a boolean schema is that boolean
        "$defs": {"t": True, "f": False},
        "properties": {"a": {"$dynamicRef": "#/$defs/t"}, "b": {"$dynamicRef": "#/$defs/f"}},
    },
]
DYNAMIC_KEYWORDS = {"$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor"}


@pytest.mark.parametrize("schema", DYNAMIC, ids=[json.dumps(s)[:60] for s in DYNAMIC])
def test_dynamic_refs_resolve_statically(schema: Any) -> None:
    rewritten = rewrite(schema)
    assert not DYNAMIC_KEYWORDS & keywords(rewritten), rewritten
    assert mismatches(schema, rewritten, 600) == []


def test_dynamic_scopes_past_the_limit_are_left_alone() -> None:
    assert resolve_refs(DYNAMIC[3], max_dynamic_defs=1).schema == DYNAMIC[3]


def test_dynamic_probes_tell_scopes_apart() -> None:
    """The probe instances can see a wrong resolution: read as plain $refs, the first schema's
    items are anything, and the random arrays then disagree with the dynamic verdict."""
    static = json.loads(json.dumps(DYNAMIC[0]).replace('"$dynamicRef"', '"$ref"'))
    static["$defs"]["list"]["$defs"]["items"] = {"$anchor": "items"}
    assert mismatches(DYNAMIC[0], rewrite(static), 600)


CONTAINS = [
    {"contains": True},
    {"contains": {}, "minContains": 2, "maxContains": 3},
    {"contains": False},
    {"contains": False, "minContains": 0},
    {"contains": {"if": False, "else": True}},
    {"contains": {"const": 1}, "minContains": 0},
    {"contains": {"const": 1}, "minContains": 3, "maxContains": 1},
    {"contains": {"type": "string"}, "maxContains": 0, "minContains": 0},
    {"prefixItems": [{}], "contains": {"enum": [1, "a"]}, "maxContains": 0, "minContains": 0},
    {"type": ["array", "string"], "contains": {"minimum": 2}, "minContains": 0, "maxContains": 0},
    {"items": {"type": "integer"}, "contains": {"not": {}}, "maxContains": 0, "minContains": 0},
]


@pytest.mark.parametrize("schema", CONTAINS, ids=[json.dumps(s)[:50] for s in CONTAINS])
def test_contains_without_a_counter_becomes_item_keywords(schema: Any) -> None:
    rewritten = rewrite(schema)
    assert not {"contains", "minContains", "maxContains"} & keywords(rewritten), rewritten
    assert mismatches(schema, rewritten, 600) == []


def test_contains_that_needs_a_counter_is_left_alone() -> None:
    for schema in (
        {"contains": {"minimum": 5}},
        {"contains": {"const": 1}, "minContains": 2},
        {"contains": {"const": 1}, "maxContains": 1},
        {"contains": {"pattern": "(?<=a)", "type": "string"}, "minContains": 0, "maxContains": 0},
    ):
        assert "contains" in rewrite(schema), schema


VALUES_IN_ALL_OF = [
    {"allOf": [{"enum": [None, 1, "a"]}, {"not": {"type": "integer"}}]},
    {"allOf": [{"const": [1, "a"]}, {"not": {"items": {"type": "number"}}}]},
    {"allOf": [{"enum": [1, "foo", [1]], "title": "t"}, {"not": {"type": "string"}}, {}]},
    {"type": "array", "additionalItems": False, "items": {"type": "integer"}},
]


@pytest.mark.parametrize(
    "schema", VALUES_IN_ALL_OF, ids=[json.dumps(s)[:50] for s in VALUES_IN_ALL_OF]
)
def test_values_in_all_of_are_filtered_by_the_other_branches(schema: Any) -> None:
    rewritten = rewrite(schema)
    assert not {"not", "additionalItems"} & keywords(rewritten), rewritten
    assert mismatches(schema, rewritten, 600) == []


UNUSED_DEFS = [
    {"$defs": {"a": {"not": {"type": "integer"}}}, "type": "string"},
    {  # the filtered const no longer needs the def holding the refused keyword
        "const": {"x": 1},
        "allOf": [{"$ref": "#/$defs/n"}],
        "$defs": {"n": {"not": {"required": ["y"], "patternProperties": {"y": False}}}},
    },
    {
        "properties": {"a": {"$ref": "#/$defs/used"}},
        "$defs": {
            "used": {"items": {"$ref": "#/$defs/also"}},
            "also": {"type": "integer"},
            "unused": {"not": {"multipleOf": 3}},
        },
    },
    {"type": "string", "format": "host-name"},
]


@pytest.mark.parametrize("schema", UNUSED_DEFS, ids=[json.dumps(s)[:50] for s in UNUSED_DEFS])
def test_unused_defs_and_draft3_formats_are_dropped(schema: Any) -> None:
    rewritten = rewrite(schema)
    assert not {"not", "format"} & keywords(rewritten), rewritten
    assert mismatches(schema, rewritten, 600) == []


def test_defs_reached_by_other_ref_forms_are_kept() -> None:
    schema = {"$defs": {"a": {"$anchor": "x", "not": {"type": "integer"}}}, "items": {"$ref": "#x"}}
    assert prune_unused_defs(schema) == schema


STRING_ONE_OF = [
    {"type": "string", "oneOf": [{"pattern": "^https?://.+$"}, {"pattern": "^\\./.+$"}]},
    {"oneOf": [{"format": "uuid"}, {"pattern": "^\\$[A-Z0-9-_]+"}]},
    {"oneOf": [{"pattern": "^[a-c]x"}, {"pattern": "^[d-e]"}, {"pattern": "^foo", "minLength": 4}]},
    {"type": ["string", "null"], "oneOf": [{"pattern": "^a"}, {"pattern": "^b", "maxLength": 2}]},
]


@pytest.mark.parametrize("schema", STRING_ONE_OF, ids=[json.dumps(s)[:50] for s in STRING_ONE_OF])
def test_one_of_strings_with_distinct_first_characters_becomes_any_of(schema: Any) -> None:
    rewritten = rewrite(schema)
    assert "oneOf" not in keywords(rewritten), rewritten
    assert mismatches(schema, rewritten, 600) == []
    texts = ["", "a", "b", "ab", "ax", "bx", "dx", "foo", "fooo", "./x", "http://x", "$A", "u"]
    texts += ["123e4567-e89b-12d3-a456-426614174000", "$123e4567-e89b-12d3-a456-426614174000"]
    for text in texts:
        assert validate_instance(schema, text).valid == validate_instance(rewritten, text).valid


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "oneOf": [{"pattern": "^ab?c(?<=c)x"}, {"pattern": "^a"}]},
        {"type": "string", "oneOf": [{"pattern": "^a|^b(?!c)"}, {"pattern": "^b"}]},
        {"type": "string", "oneOf": [{"pattern": "^[^a]"}, {"pattern": "^b"}]},
        {"type": "string", "oneOf": [{"pattern": "a\\b"}, {"pattern": "^b"}]},
    ],
)
def test_one_of_strings_that_may_overlap_is_left_alone(schema: Any) -> None:
    assert "oneOf" in keywords(rewrite(schema))


def test_large_dynamic_schemas_get_fewer_scopes() -> None:
    """Each scope copies up to the whole schema: a large one is left dynamic (and refused)
    before the copies grow past a few MB."""
    padded = {**DYNAMIC[3], "description": "x" * (2 << 20)}
    assert resolve_refs(padded).schema == padded
    assert resolve_refs(DYNAMIC[3]).schema != DYNAMIC[3]


DEPENDENCIES = [
    {"dependencies": {"a": ["b"], "foo": ["bar", "c"]}},
    {"properties": {"a": {"type": "integer"}}, "dependencies": {"a": {"required": ["x1"]}}},
    {"type": "object", "dependencies": {"b": ["a"], "c": {"properties": {"a": {"const": 1}}}}},
]


@pytest.mark.parametrize("schema", DEPENDENCIES, ids=[json.dumps(s)[:50] for s in DEPENDENCIES])
def test_dependencies_keep_their_draft_7_meaning_in_every_draft(schema: Any) -> None:
    """Without ``$schema`` (2020-12, where ``dependencies`` is no keyword) the rewrite enforces
    draft 7's meaning: equal to the draft-7 reading, and only narrower than the 2020-12 one."""
    rewritten = rewrite(schema)
    assert "dependencies" not in keywords(rewritten), rewritten
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", **schema}
    assert mismatches(draft7, rewritten, 400) == []
    rng = random.Random(1)
    narrowed = 0
    for _ in range(400):
        value = random_value(rng)
        if validate_instance(rewritten, value).valid:
            assert validate_instance(schema, value).valid, value
        else:
            narrowed += validate_instance(schema, value).valid
    assert narrowed > 0  # the draft-7 meaning did constrain some instances


ONE_OF_BY_TYPE = [
    # non-objects match every branch (properties / required alone): only objects can be valid
    {"oneOf": [{"required": ["a"], "properties": {"a": {"const": 1}}},
               {"required": ["a"], "properties": {"a": {"const": "foo"}}}]},
    # arrays that can share only []: [] matches both and is not valid
    {"oneOf": [{"type": "array", "items": {"type": "number"}},
               {"type": "array", "items": {"type": "string"}}]},
    # ... unless one branch needs an item: [] then matches exactly one
    {"oneOf": [{"type": "array", "items": {"type": "number"}},
               {"type": "array", "prefixItems": [{"type": "string"}], "minItems": 1}]},
    # one branch takes every string, the others no string; one branch per other type
    {"oneOf": [{"type": "string"}, {"type": "integer", "maximum": 0},
               {"type": "array", "minItems": 2}, {"const": True}]},
    # a branch matching everything of a type shared with no other
    {"oneOf": [{"minLength": 2}, {"type": "object"}, {"type": "null"}]},
    # numbers match all three branches (not valid), strings at most one of the patterns
    {"oneOf": [{"pattern": "^a"}, {"pattern": "^b"}, {"type": "number"}]},
]  # fmt: skip


@pytest.mark.parametrize("schema", ONE_OF_BY_TYPE, ids=[json.dumps(s)[:50] for s in ONE_OF_BY_TYPE])
def test_one_of_decided_type_by_type_becomes_any_of(schema: Any) -> None:
    rewritten = rewrite(schema)
    assert "oneOf" not in keywords(rewritten), rewritten
    assert mismatches(schema, rewritten, 800) == []
    for value in ([], [1], ["a"], [1, "a"], {}, {"a": 1}, {"a": "foo"}, "", "ab", -1, 0.5, 3, None):
        assert validate_instance(schema, value).valid == validate_instance(rewritten, value).valid


NEEDS_A_COMPLEMENT = [
    # every string matches the first branch and some match the second: a complement
    {"oneOf": [{"type": "string"}, {"type": "string", "pattern": "^a(?<=a)b"}]},
    # arrays whose first items may overlap
    {"oneOf": [{"type": "array", "items": {"type": "number"}},
               {"type": "array", "items": {"minimum": 2}}]},
]  # fmt: skip


@pytest.mark.parametrize("schema", NEEDS_A_COMPLEMENT)
def test_one_of_that_needs_a_complement_by_type_is_left_alone(schema: Any) -> None:
    assert "oneOf" in keywords(rewrite(schema))


SHARED = {"type": "object", "patternProperties": {"^x": {"type": "string"}}}
IMPLIED = [
    # closed objects sharing a property whose schema has no complement (open names)
    {"$defs": {"p": SHARED},
     "oneOf": [{"type": "object", "additionalProperties": False, "required": ["a"],
                "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"enum": ["none"]}}},
               {"type": "object", "additionalProperties": False, "required": ["a"],
                "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"enum": ["foo", "bar"]},
                               "c": {}}}]},
    # the same open additionalProperties in both branches, told apart by a const
    {"oneOf": [{"properties": {"a": {"const": 1}}, "additionalProperties": {"type": "string"}},
               {"properties": {"a": {"const": 7}}, "additionalProperties": {"type": "string"}}],
     "type": "object"},
    # not / if next to siblings that already guarantee part of them
    {"properties": {"a": SHARED}, "not": {"properties": {"a": SHARED}, "required": ["b"]}},
    {"type": "object", "required": ["a"], "properties": {"a": SHARED},
     "if": {"properties": {"a": SHARED, "b": {"const": 1}}, "required": ["a", "b"]},
     "then": {"required": ["c"]}, "else": {"maxProperties": 2}},
]  # fmt: skip


@pytest.mark.parametrize("schema", IMPLIED, ids=[json.dumps(s)[:50] for s in IMPLIED])
def test_complements_skip_what_the_siblings_guarantee(schema: Any) -> None:
    rewritten = rewrite(schema)
    assert not {"oneOf", "not", "if"} & keywords(rewritten), rewritten
    assert mismatches(schema, rewritten, 1500) == []
    assert mismatches(schema, rewritten, 1500, seed=1) == []


def test_not_of_a_long_string_is_left_alone_not_a_crash() -> None:
    """The "every string but these" pattern is spelled one trie level per character: a member
    longer than the limit leaves the ``not`` in place (refused in strict mode) instead of
    recursing past Python's stack limit."""
    schema = {"not": {"const": "a" * 5000}}
    assert "not" in keywords(rewrite(schema))


def test_keywords_read_with_siblings_are_implied_only_with_them() -> None:
    """``items`` after a ``prefixItems`` covers fewer positions than ``items`` alone: the
    sibling's ``items`` does not imply the ``not``'s, which stays (no complement of items)."""
    schema = {"prefixItems": [{"type": "string"}], "items": {"type": "integer"},
              "not": {"items": {"type": "integer"}}}  # fmt: skip
    rewritten = rewrite(schema)
    assert "not" in keywords(rewritten), rewritten
    assert validate_instance(rewritten, ["a", 1]).valid


OPEN = {"properties": {"a": {"type": "integer"}, "b": {}, "foo": False}}
CLOSED = {**OPEN, "additionalProperties": False}
PROPERTY_COUNTS = [
    {**OPEN, "minProperties": 1},
    {**OPEN, "minProperties": 2, "required": ["a"]},
    {**OPEN, "minProperties": 3},
    {**OPEN, "maxProperties": 1},
    {**OPEN, "maxProperties": 2, "minProperties": 1, "required": ["b"]},
    {**CLOSED, "minProperties": 1},
    {**CLOSED, "minProperties": 3},
    {**CLOSED, "maxProperties": 1},
    {**CLOSED, "maxProperties": 0, "minProperties": 0},
    {**CLOSED, "maxProperties": 1, "required": ["a", "b"], "type": ["object", "string"]},
    {**OPEN, "patternProperties": {"^x": {}}, "additionalProperties": False, "minProperties": 2},
    {"type": "object", "properties": {n: {} for n in NAMES[:4]}, "minProperties": 2},
    {"type": "object", "properties": {"a": {}, "b": {}}, "propertyNames": False},
]


def _counted_with_optional(schema: Any) -> list[Any]:
    """Nodes with a property count next to a listed name that is neither required nor false:
    the shape llguidance refuses."""
    out = []
    for node in walk(schema):
        counted = isinstance(node.schema, dict) and (
            "minProperties" in node.schema or "maxProperties" in node.schema
        )
        if counted:
            required = set(node.schema.get("required", []))
            listed = node.schema.get("properties", {})
            if any(n not in required and s is not False for n, s in listed.items()):
                out.append(node.schema)
    return out


@pytest.mark.parametrize(
    "schema", PROPERTY_COUNTS, ids=[json.dumps(s)[:60] for s in PROPERTY_COUNTS]
)
def test_property_counts_over_optional_names_become_branches(schema: Any) -> None:
    rewritten = rewrite(schema)
    assert _counted_with_optional(rewritten) == [], rewritten
    assert mismatches(schema, rewritten, 800) == []


def test_property_counts_past_the_branch_limit_are_left_alone() -> None:
    many = {"properties": {f"p{i}": {} for i in range(20)}, "minProperties": 3}
    assert rewrite(many)["minProperties"] == 3


BOOLEAN_REFS = [
    {"properties": {"a": {"$ref": "#/$defs/no"}, "b": {"$ref": "#/$defs/yes"}},
     "$defs": {"no": False, "yes": True}},
    {"patternProperties": {"^a": {"$ref": "#/$defs/no"}}, "items": {"$ref": "#/$defs/no"},
     "$defs": {"no": False}},
    {"anyOf": [{"$ref": "#/$defs/via"}, {"type": "string"}],
     "$defs": {"via": {"$ref": "#/$defs/no"}, "no": False}},
]  # fmt: skip


@pytest.mark.parametrize("schema", BOOLEAN_REFS, ids=[json.dumps(s)[:60] for s in BOOLEAN_REFS])
def test_refs_to_boolean_defs_become_the_boolean(schema: Any) -> None:
    rewritten = rewrite(schema)
    assert "$ref" not in keywords(rewritten), rewritten
    assert mismatches(schema, rewritten, 600) == []


PATTERN_PROPERTIES = [
    {"patternProperties": {".*": {"type": "integer"}, "^a": {"minimum": 1}}},
    {"properties": {"b": {"maximum": 5}}, "additionalProperties": False,
     "patternProperties": {"": {"type": "integer"}, "^x": {"minimum": 1}, "a": {"const": 7}}},
    {"patternProperties": {"^foo$": {"type": "string"}, "o": {"const": "foo"}, "^a$": False}},
    {"properties": {"foo": {"minLength": 2}}, "additionalProperties": {"type": "null"},
     "patternProperties": {"^foo$": {"type": "string"}, "^f": {"maxLength": 3}}},
    {"patternProperties": {"^.*": {"type": ["integer", "string"]}, "^x1$": {"type": "string"},
                           "1": {"minLength": 2}}},
]  # fmt: skip


@pytest.mark.parametrize(
    "schema", PATTERN_PROPERTIES, ids=[json.dumps(s)[:60] for s in PATTERN_PROPERTIES]
)
def test_universal_and_single_name_patterns_leave_the_pattern_properties(schema: Any) -> None:
    rewritten = rewrite(schema)
    patterns = rewritten.get("patternProperties", {})
    assert len(patterns) < len(schema["patternProperties"]), rewritten
    assert mismatches(schema, rewritten, 800) == []


def test_patterns_of_other_shapes_are_left_alone() -> None:
    schema = {"patternProperties": {"a": {"type": "integer"}, "^b$|c": {"minimum": 1}}}
    assert rewrite(schema) == schema


BESIDE_ALL_OF = [
    # a rewrite's allOf branch beside the keywords it came from (held-out sweep: xgrammar
    # compiled the allOf alone and wrote {"a": "..."} for an integer property)
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
     "not": {"properties": {"a": {"const": 3}}}},
    {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
     "additionalProperties": False, "not": {"properties": {"a": {"const": True}}}},
    {"type": "object", "properties": {"a": {"type": ["string", "null"]}}, "required": ["a"],
     "not": {"properties": {"a": {"type": "null"}}}},
]  # fmt: skip


@pytest.mark.parametrize("schema", BESIDE_ALL_OF, ids=[json.dumps(s)[:60] for s in BESIDE_ALL_OF])
def test_allof_branches_fold_into_their_node_and_xgrammar_enforces_them(
    schema: Any, toy_tokenizer: Any
) -> None:
    rewritten = rewrite(schema)
    assert not [n for n in walk(rewritten) if isinstance(n.schema, dict) and "allOf" in n.schema]
    assert mismatches(schema, rewritten, 600) == []
    compiled = get_backend("xgrammar", toy_tokenizer).compile(GrammarSpec.json_schema(rewritten))
    pool = [1, 3, -2, True, False, None, "x", "", [1], {"b": 1}]
    for value in [{"a": v} for v in pool] + [{}, {"a": 1, "b": 2}, 5, "a"]:
        text = json.dumps(value)
        expected = validate_instance(schema, value).valid
        assert grammar_accepts(compiled, toy_tokenizer, text) == expected, text


TYPED_BRANCHES = [
    {"type": "integer", "anyOf": [{"enum": [1, "a", 2.5, 3.0]}, {"minimum": 10}]},
    {"type": ["string", "null"], "anyOf": [{"type": "number"}, {"maxLength": 2}, {"const": None}]},
    {"type": "number", "anyOf": [{"type": "integer", "maximum": 0}, {"type": "string"}, True]},
]  # fmt: skip


@pytest.mark.parametrize("schema", TYPED_BRANCHES, ids=[json.dumps(s)[:60] for s in TYPED_BRANCHES])
def test_a_type_beside_an_anyof_is_written_into_its_branches(schema: Any) -> None:
    from espalier.constrained.schema.logic import typed_branches

    typed = typed_branches(schema)
    assert typed != schema
    for branch in typed["anyOf"]:  # every branch within the type: xgrammar keeps the type
        assert {"type", "enum", "const"} & set(branch), branch
    pool = [None, True, 1, 3.0, 2.5, -4, 12, "", "a", "abc", [1], {}]
    wrong = [
        v for v in pool if validate_instance(schema, v).valid != validate_instance(typed, v).valid
    ]
    assert wrong == []
    assert mismatches(schema, typed, 300) == []


def test_an_enum_folded_beside_a_type_is_filtered_by_it() -> None:
    """A fold put an allOf branch's enum beside the node's type; the enum filter runs after the
    fold, so the members are filtered and the type dropped (an enum with siblings is weakened
    on every backend)."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "allOf": [{"properties": {"a": {"enum": [1, 2, "x"]}}}],
    }
    assert rewrite(schema)["properties"]["a"] == {"enum": [1, 2]}
    assert mismatches(schema, rewrite(schema), 300) == []
