"""``enum`` / ``const`` next to other keywords (issue 37): filtered exactly, refused when empty.

Unit checks of :func:`enum_filter.filter_enums` through ``normalize_schema``, then the whole family
of ``schema_probes`` end to end: for every backend chosen by name, strict mode either refuses the
probe's schema or accepts exactly its valid instances (the probes alone show xgrammar and
outlines-core emitting the values and dropping the siblings).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from espalier.constrained.backends import BACKENDS, BackendUnavailableError, get_backend
from espalier.constrained.compile import compile_grammar, prepare_schema
from espalier.constrained.conformance import grammar_accepts
from espalier.constrained.errors import GrammarError, InvalidGrammarError
from espalier.constrained.postvalidate import validate_instance
from espalier.constrained.schema.enum_filter import filter_enums
from espalier.constrained.schema.rewrite import normalize_schema
from espalier.constrained.spec import GrammarSpec
from tests.constrained.schema_probes import PROBES

FAMILY = [p for p in PROBES if p.keyword in ("enum", "const") and "-with-" in p.name]
MEMBERS = ["A", "abc", 1, 5, 2.5, None, True, [1], {"a": 1}, {}]


def test_the_reported_conflict_is_unsatisfiable() -> None:
    prop = {"enum": ["MODIFIABLE", "DELETABLE"], "type": "object"}
    with pytest.raises(InvalidGrammarError) as raised:
        normalize_schema(prop)
    assert raised.value.pointer == ""
    assert "enum" in str(raised.value) and "type" in str(raised.value)
    # below the root the object matches nothing, which is not the whole schema's fate
    schema = {"type": "object", "properties": {"p": prop}}
    assert normalize_schema(schema) == {"type": "object", "properties": {"p": False}}


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        ({"enum": MEMBERS, "type": "string", "minLength": 2}, {"enum": ["abc"]}),
        ({"enum": MEMBERS, "type": "number", "minimum": 2}, {"enum": [5, 2.5]}),
        (
            {"enum": MEMBERS, "multipleOf": 5},
            {"enum": ["A", "abc", 5, None, True, [1], {"a": 1}, {}]},
        ),
        ({"enum": MEMBERS, "type": "object", "required": ["a"]}, {"enum": [{"a": 1}]}),
        ({"enum": MEMBERS, "type": "array", "items": {"type": "string"}}, {"enum": []}),
        (
            {"enum": ["a@b.io", "ab"], "format": "email", "title": "t"},
            {"enum": ["a@b.io"], "title": "t"},
        ),
        ({"enum": ["2024-02-30", "2024-02-29"], "format": "date"}, {"enum": ["2024-02-29"]}),
        ({"enum": ["a1", "b"], "pattern": "^\\p{L}\\d$"}, {"enum": ["a1"]}),
        ({"enum": [1, 2], "const": 2}, {"enum": [2]}),
        ({"enum": [1, 2], "not": {"const": 2}}, {"enum": [1]}),
        ({"const": "ab", "maxLength": 2, "x-unknown": 1}, {"const": "ab", "x-unknown": 1}),
        ({"enum": [1, "a"]}, {"enum": [1, "a"]}),
    ],
)
def test_members_are_filtered_by_their_siblings(schema: Any, expected: Any) -> None:
    if expected == {"enum": []}:
        with pytest.raises(InvalidGrammarError):
            normalize_schema(schema)
        return
    assert normalize_schema(schema) == expected
    # the oracle: a member is kept exactly when the original schema accepts it
    for member in MEMBERS + list(schema.get("enum", [])):
        before = validate_instance(schema, member).valid
        assert before == validate_instance(expected, member).valid, member


def test_refs_resolve_against_the_root() -> None:
    schema = {
        "$defs": {"short": {"type": "string", "maxLength": 2}},
        "properties": {"p": {"enum": ["ab", "abc", 1], "$ref": "#/$defs/short"}},
    }
    out = prepare_schema(schema).schema
    assert isinstance(out, dict)
    assert out["properties"]["p"] == {"enum": ["ab"]}


def test_members_are_filtered_inside_nested_values() -> None:
    schema = {
        "type": "array",
        "items": {
            "anyOf": [{"const": "x", "type": "integer"}, {"enum": [1, "y"], "type": "string"}]
        },
    }
    assert normalize_schema(schema) == {
        "type": "array",
        "items": {"anyOf": [False, {"enum": ["y"]}]},
    }


def test_siblings_stay_where_annotations_matter() -> None:
    # dropping "properties" would change what unevaluatedProperties sees in the parent (under
    # anyOf, what is evaluated depends on the instance: unevaluatedProperties stays)
    child = {"enum": [{"a": 1}, {"a": "x"}], "properties": {"a": {"type": "integer"}}}
    schema = {"anyOf": [child, {"type": "string"}], "unevaluatedProperties": False}
    out = normalize_schema(schema)
    assert isinstance(out, dict)
    assert out["anyOf"][0] == {"enum": [{"a": 1}], "properties": {"a": {"type": "integer"}}}
    # and strict mode does not trust a backend with enum next to siblings
    for backend in BACKENDS:
        assert any(i.keyword == "enum" for i in prepare_schema(schema).issues[backend])


def test_undecidable_members_leave_the_object_alone() -> None:
    schema = {"enum": ["a", "b"], "pattern": "(?<=a)b["}  # Python cannot compile this pattern
    assert normalize_schema(schema) == schema
    assert all(prepare_schema(schema).issues[b] for b in BACKENDS)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("probe", FAMILY, ids=[p.name for p in FAMILY])
def test_strict_mode_never_lets_a_failing_member_through(
    backend: str, probe: Any, toy_tokenizer: Any
) -> None:
    try:
        get_backend(backend, toy_tokenizer)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    try:
        compiled, _ = compile_grammar(GrammarSpec.json_schema(probe.schema), toy_tokenizer, backend)
    except GrammarError:
        assert not probe.valid or backend != "llguidance", "llguidance enforces these: refused?"
        return
    for value in probe.invalid:
        assert not grammar_accepts(compiled, toy_tokenizer, json.dumps(value)), value
    for value in probe.valid:
        if isinstance(value, (dict, list)):
            continue  # xgrammar spells object/array members its own way (a false reject)
        assert grammar_accepts(compiled, toy_tokenizer, json.dumps(value)), value


def test_member_checks_are_bounded_in_time() -> None:
    # a backtracking pattern next to a const: the check ran on a compile thread for good (a
    # compile timeout cannot stop a thread); now the object is left as it is (undecided)
    schema = {"type": "string", "const": "a" * 40 + "b", "pattern": "(a|aa)+$"}
    assert filter_enums(schema, annotations_matter=False) == schema
    # and the checks after it are not timed out by the spent limit
    decided = {"type": "string", "enum": ["ab", "b"], "pattern": "^a"}
    assert filter_enums(decided, annotations_matter=False) == {"enum": ["ab"]}
