"""Probe tests of the ``oneOf`` disjointness proof through conjuncts (:mod:`disjoint`): ``allOf``
members and refs, unions split branch by branch, and a ``oneOf`` inside ``allOf`` told apart by
its parent. ``jsonschema`` gives every random instance (objects drawn so that they hit the
discriminators, including ones that match two branches when the context is left out) the same
verdict on the original and the rewritten schema; where two branches can both match, the
``oneOf`` stays."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from espalier.constrained.postvalidate import validate_instance
from espalier.constrained.schema.disjoint import conjuncts, disjoint
from espalier.constrained.schema.refs import resolve_refs
from espalier.constrained.schema.rewrite import normalize_schema
from espalier.constrained.schema.walk import walk

NAMES = ("kind", "ref", "url", "x", "y")
VALUES = (None, True, False, 0, 3, 2.5, "", "a", "b", "c", "section", "reference")


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """Objects over a few names with small values (nested once), sometimes arrays or scalars."""
    roll = rng.random()
    if depth >= 2 or roll < 0.15:
        return rng.choice(VALUES)
    if roll < 0.25:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    names = rng.sample(NAMES, rng.randrange(len(NAMES) + 1))
    return {name: random_value(rng, depth + 1) for name in names}


def rewrite(schema: Any) -> Any:
    return normalize_schema(resolve_refs(schema).schema)


def has_one_of(schema: Any) -> bool:
    return any(isinstance(n.schema, dict) and "oneOf" in n.schema for n in walk(schema))


def same_verdicts(schema: Any, rewritten: Any, values: list[Any]) -> list[Any]:
    """The values whose verdict differs (expected: none)."""
    return [
        v
        for v in values
        if validate_instance(schema, v).valid != validate_instance(rewritten, v).valid
    ]


def pool(seed: int, count: int = 1500) -> list[Any]:
    rng = random.Random(seed)
    return [random_value(rng) for _ in range(count)]


SECTION = {
    "type": "object",
    "required": ["kind", "url"],
    "additionalProperties": False,
    "properties": {"kind": {"enum": ["section"]}, "url": {"type": "string"}},
}
REFERENCE = {
    "type": "object",
    "required": ["kind", "ref"],
    "additionalProperties": False,
    "properties": {
        "kind": {"enum": ["reference"]},
        "ref": {"type": "object", "properties": {"kind": {}, "x": {}}},
    },
}
# hand-made instances next to the random ones: each valid under some schema below, or matching
# two branches of one when its context is left out
EXAMPLES: list[Any] = [
    {"kind": "section", "url": "a"},
    {"kind": "reference", "ref": {"kind": "a"}},
    {"kind": "reference", "ref": {"kind": "b"}},
    {"kind": "section", "url": "a", "ref": {}},
    {"kind": "a"},
    {"kind": "c", "x": 3},
    {"kind": False},
    {"x": False},
    {"kind": "b", "y": "a", "x": 0},
    {"x": 1},
    {},
    "a",
    None,
    [],
]
DISJOINT = [
    # a branch is an allOf of a ref and a refinement: the ref's own discriminator tells them apart
    {"$defs": {"section": SECTION, "reference": REFERENCE},
     "oneOf": [{"$ref": "#/$defs/section"},
               {"allOf": [{"$ref": "#/$defs/reference"},
                          {"properties": {"ref": {"properties": {"kind": {"enum": ["a"]}}}}}]}]},
    # a branch is itself a oneOf of discriminated objects; the other allows only false values
    {"$defs": {"repo": {"type": "object",
                        "oneOf": [{"required": ["kind"], "properties": {"kind": {"const": "a"}}},
                                  {"required": ["kind"],
                                   "properties": {"kind": {"enum": ["b", "c"]}}}]}},
     "oneOf": [{"$ref": "#/$defs/repo"},
               {"type": "object", "additionalProperties": {"const": False},
                "minProperties": 1, "maxProperties": 1}]},
    # the discriminator is required by the parent of the allOf holding the oneOf
    {"type": "object", "required": ["kind"],
     "allOf": [{"properties": {"x": {"type": "integer"}}},
               {"oneOf": [{"properties": {"kind": {"const": "a"}}},
                          {"properties": {"kind": {"const": "b"}, "y": {"type": "string"}}},
                          {"$ref": "#/$defs/c"}]}],
     "$defs": {"c": {"allOf": [{"properties": {"kind": {"enum": ["c", 3]}}}]}}},
    # an anyOf branch: each of its branches differs from the other oneOf branch by type
    {"oneOf": [{"anyOf": [{"type": "string"}, {"type": "object", "required": ["x"]}]},
               {"allOf": [{"type": ["array", "null", "object"]}, {"properties": {"x": False}}]}]},
]  # fmt: skip


@pytest.mark.parametrize("schema", DISJOINT, ids=[json.dumps(s)[:60] for s in DISJOINT])
def test_one_of_disjoint_through_conjuncts_becomes_any_of(schema: Any) -> None:
    rewritten = rewrite(schema)
    assert not has_one_of(rewritten), rewritten
    assert same_verdicts(schema, rewritten, pool(7) + EXAMPLES) == []
    verdicts = {validate_instance(schema, v).valid for v in pool(7) + EXAMPLES}
    assert verdicts == {True, False}  # the instances tell valid from invalid ones


OVERLAPPING = [
    # the discriminator is not required anywhere: {} matches both branches of the member
    {"type": "object",
     "allOf": [{"properties": {"x": {"type": "integer"}}},
               {"oneOf": [{"properties": {"kind": {"const": "a"}}, "required": ["x"]},
                          {"properties": {"kind": {"const": "b"}}, "required": ["y"]}]}]},
    # one case of the anyOf branch overlaps the other branch (objects with x)
    {"oneOf": [{"anyOf": [{"type": "string"}, {"type": "object", "required": ["x"]}]},
               {"type": "object", "required": ["y"], "properties": {"y": {"minItems": 1}}}]},
    # the ref's discriminator allows a value the other branch allows too
    {"$defs": {"r": {"allOf": [{"required": ["kind"]},
                               {"properties": {"kind": {"enum": ["a", "b"]}}}]}},
     "oneOf": [{"$ref": "#/$defs/r"},
               {"required": ["kind"], "properties": {"kind": {"enum": ["b", "c"]}}}]},
]  # fmt: skip


@pytest.mark.parametrize("schema", OVERLAPPING, ids=[json.dumps(s)[:60] for s in OVERLAPPING])
def test_overlapping_one_of_keeps_its_meaning(schema: Any) -> None:
    """Not proven disjoint: either left as ``oneOf`` or rewritten by an exact other form; an
    instance matching two branches stays invalid."""
    defs = resolve_refs(schema).schema.get("$defs", {})
    branches = next(
        n.schema["oneOf"]
        for n in walk(resolve_refs(schema).schema)
        if isinstance(n.schema, dict) and "oneOf" in n.schema
    )
    assert not disjoint(branches[0], branches[1], defs)
    rewritten = rewrite(schema)
    values = pool(11)
    assert same_verdicts(schema, rewritten, values) == []


def test_two_branch_matches_are_invalid_after_the_rewrite() -> None:
    schema = OVERLAPPING[0]
    both = {"x": 1, "y": 2}  # matches both branches of the member: oneOf rejects it
    rewritten = rewrite(schema)
    assert not validate_instance(schema, both).valid
    assert not validate_instance(rewritten, both).valid


def test_conjuncts_flatten_all_of_and_refs() -> None:
    defs = {"d": {"allOf": [{"type": "object"}, {"required": ["a"]}], "title": "t"}}
    parts = conjuncts({"allOf": [{"$ref": "#/$defs/d"}, {"minProperties": 1}]}, defs)
    assert parts == [{}, {"title": "t"}, {"type": "object"}, {"required": ["a"]},
                     {"minProperties": 1}]  # fmt: skip


LESS_IMPLIED = [
    # a property both branches list: only what this branch's subschema leaves open can differ
    # (item counts here), so the other's items need no complement
    {"type": "object",
     "oneOf": [{"properties": {"x": {"type": "array", "items": {"required": ["kind"]},
                                     "minItems": 1, "maxItems": 1}}},
               {"properties": {"x": {"type": "array", "items": {"required": ["kind"]},
                                     "minItems": 2}}}]},
    # the branches' subschemas for the property are disjoint: any present value violates one
    {"oneOf": [{"properties": {"x": {"type": "array", "items": {"enum": ["a", "b"]}}}},
               {"properties": {"x": {"enum": ["a", "b"]}}}]},
    # a branch without a complement, disjoint from the others, which overlap each other
    {"oneOf": [{"type": "array", "items": {"type": "integer"}},
               {"type": "object", "required": ["x"]},
               {"type": "object", "required": ["y"]}]},
    # two equal branches: an instance matching them matches two, it is never valid
    {"oneOf": [{"required": ["x"], "properties": {"kind": {"const": "a"}}},
               {"type": "object", "required": ["kind"], "properties": {"kind": {"const": "b"}}},
               {"required": ["x"], "properties": {"kind": {"const": "a"}}}]},
    # many branches, one overlapping pair: one complement per overlapping pair
    {"oneOf": [{"type": "string"}, {"type": "null"}, {"type": "boolean"}, {"const": 3},
               {"type": "number", "maximum": 0}, {"type": "array", "maxItems": 1},
               {"type": "object", "required": ["x"]}, {"type": "object", "required": ["y"]}]},
]  # fmt: skip
LESS_IMPLIED_EXAMPLES: list[Any] = [
    {},
    {"x": [{"kind": "a"}]},
    {"x": [{"kind": "a"}, {"kind": "b"}]},
    {"x": [{"kind": 1}, 3]},
    {"x": [{}]},
    {"x": []},
    {"x": "a"},
    {"x": ["a"]},
    {"x": ["a", "c"]},
    {"x": 3},
    {"x": 1, "y": 2},
    {"y": 2},
    {"x": 1, "kind": "a"},
    {"x": 1, "kind": "b"},
    {"kind": "b"},
    [1, 2],
    [1, "a"],
    [],
    "a",
]


@pytest.mark.parametrize("schema", LESS_IMPLIED, ids=[json.dumps(s)[:60] for s in LESS_IMPLIED])
def test_exactly_one_complements_only_overlapping_branches(schema: Any) -> None:
    rewritten = rewrite(schema)
    assert not has_one_of(rewritten), rewritten
    values = pool(5) + LESS_IMPLIED_EXAMPLES
    assert same_verdicts(schema, rewritten, values) == []
    assert {validate_instance(schema, v).valid for v in values} == {True, False}


def test_a_proof_past_its_step_budget_is_not_proven() -> None:
    def nested(levels: int) -> Any:
        if levels == 0:
            return {"type": "string"}
        return {"anyOf": [nested(levels - 1) for _ in range(16)]}

    # 16 x 16 cases: within the budget, every case is a string
    assert disjoint(nested(2), {"type": "number"}, {})
    # 16 x 16 x 16 cases: past MAX_STEPS, "not proven" (the oneOf is left alone, never wrong)
    assert not disjoint(nested(3), {"type": "number"}, {})
