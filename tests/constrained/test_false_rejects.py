"""false_reject_cause names a policy only when the respelled instance is accepted."""

from __future__ import annotations

import json

from espalier.constrained.false_rejects import false_reject_cause

# a union of two object kinds that declare shared names in different orders
UNION = {
    "type": "array",
    "items": {
        "anyOf": [
            {"properties": {"kind": {}, "x": {}, "y": {}}},
            {"properties": {"y": {}, "x": {}, "z": {}}},
        ]
    },
}


def test_each_object_is_tried_in_the_order_of_its_own_properties() -> None:
    data = [{"x": 1, "kind": "a", "y": 2}, {"z": 3, "x": 1, "y": 2}]
    declared = json.dumps([{"kind": "a", "x": 1, "y": 2}, {"y": 2, "x": 1, "z": 3}])
    assert false_reject_cause(lambda text: text == declared, UNION, data) == "property_order"


def test_an_order_no_schema_declares_is_not_a_policy() -> None:
    data = [{"x": 1, "kind": "a", "y": 2}]
    unseen = json.dumps([{"y": 2, "kind": "a", "x": 1}])
    assert false_reject_cause(lambda text: text == unseen, UNION, data) == "other"


def test_properties_a_branch_adds_come_after_the_nodes_own() -> None:
    """A nested object whose schema declares ``radius`` itself and ``shape`` in a ``oneOf``
    branch (Glaiveai2K/calculate_area_a5ac6157), reached through a ``$ref``: a backend merging
    the branch writes ``radius`` first. A name-ranking over the whole schema cannot see that."""
    schema = {
        "definitions": {
            "dims": {
                "oneOf": [{"properties": {"shape": {"const": "circle"}}, "required": ["radius"]}],
                "properties": {"radius": {"type": "number"}},
            }
        },
        "properties": {"shape": {"type": "string"}, "dims": {"$ref": "#/definitions/dims"}},
    }
    data = {"shape": "circle", "dims": {"shape": "circle", "radius": 10}}
    declared = json.dumps({"shape": "circle", "dims": {"radius": 10, "shape": "circle"}})
    assert false_reject_cause(lambda text: text == declared, schema, data) == "property_order"


def test_a_number_outside_the_narrowed_language_is_the_number_policy() -> None:
    """More fraction digits than the policy writes, or a ``number`` past 10**15, is ``number``
    even when the properties are out of order too; a plain number never is."""
    schema = {"properties": {"a": {"type": "number"}, "b": {"type": "number"}}}
    never = lambda text: False  # noqa: E731
    for value in (0.0280134, 9007199254740991, 1e-07):
        assert false_reject_cause(never, schema, {"b": value, "a": 1}) == "number", value
    assert false_reject_cause(never, schema, {"b": 0.25, "a": 1}) == "other"


def test_a_backend_may_write_the_branches_properties_first() -> None:
    """``allOf: [{$ref}]`` next to the node's own ``properties`` (Github_medium/o59186): the
    merged order may start with the branch's names."""
    node = {
        "properties": {"next": {"type": "boolean"}, "value": {}},
        "allOf": [{"$ref": "#/definitions/path"}],
    }
    schema = {
        "properties": {"allow": node},
        "definitions": {"path": {"properties": {"path": {"type": "string"}}}},
    }
    data = {"allow": {"value": 1, "path": "/a", "next": True}}
    declared = json.dumps({"allow": {"path": "/a", "next": True, "value": 1}})
    assert false_reject_cause(lambda text: text == declared, schema, data) == "property_order"


def test_a_value_outside_a_narrower_format_pattern_is_the_format_policy() -> None:
    """``uri-template`` and ``hostname`` are spelled as patterns that take less than their
    checkers (``rewrite.FORMAT_PATTERNS``): a valid value outside them is the format policy;
    a value inside them rejected for another reason is not."""
    schema = {
        "$defs": {"template": {"type": "string", "format": "uri-template"}},
        "type": "object",
        "properties": {"href": {"$ref": "#/$defs/template"}, "host": {"format": "hostname"}},
    }
    long_host = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61]) + "."  # 254 characters
    for data in ({"href": "/a{,b}"}, {"href": "{x[]}"}, {"host": long_host}):
        assert false_reject_cause(lambda text: False, schema, data) == "format", data
    assert false_reject_cause(lambda text: False, schema, {"href": "/a{b}", "host": "h"}) == "other"
