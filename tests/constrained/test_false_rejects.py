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
