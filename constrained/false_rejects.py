"""Why a grammar rejected a valid instance: a generation policy, or a defect ("other").

The grammars narrow on purpose (``docs/decisions/conformance-generation-policies.md``):

- ``format``: ``format`` is asserted (the post-validation checks it), while Draft 2019-09 / 2020-12
  make it an annotation by default: an instance failing its format is rejected;
- ``number``: numbers are spelled the way a model writes them (no exponent, integers without
  ``.0``) and bounded (:mod:`number_bounds`): ``1e-07``, ``1.0`` for an integer or ``1e300`` are
  rejected although valid;
- ``property_order``: properties come in the order the schema declares them (a node's own
  ``properties`` first, then those its ``allOf`` / ``anyOf`` / ``oneOf`` branches add);
- ``whitespace``: at most ``json_max_whitespace`` characters between tokens.

:func:`false_reject_cause` decides by trying the instance again, respelled: what makes the grammar
accept it names the cause; nothing does: ``other``. A number outside the narrowed language (more
than ``number_fraction_digits`` after the point, an integer part past ``number_integer_digits``
or ``integer_limit``, an exponent) is ``number`` however its properties are ordered.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from decimal import Decimal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import referencing

CAUSES = ("format", "number", "property_order", "whitespace", "other")
NUMBER_LIMIT = 10**15  # number_bounds' default: a ``number`` stays within (-10**15, 10**15)
FRACTION_DIGITS = 6  # number_bounds' default: digits after a ``number``'s decimal point
MAX_GUIDE_DEPTH = 64  # how deep the schema-guided reordering follows the instance
_UNDECLARED = object()  # a required name no ``properties`` declares
MAX_PERMUTED_KEYS = 5  # top-level objects this small are also tried in every key order


def false_reject_cause(
    accepts_text: Callable[[str], bool],
    schema: Any,
    data: Any,
    registry: referencing.Registry[Any] | None = None,
) -> str:
    """The cause (one of :data:`CAUSES`) of the rejection of valid instance ``data``;
    ``accepts_text(text)``: whether the grammar accepts that JSON text."""
    from espalier.constrained.postvalidate import validate_instance

    check = validate_instance(schema, data, registry=registry)
    if check.checked and not check.valid:
        return "format"  # valid without format assertion, invalid with it
    if _fails_format_patterns(schema, data, registry):
        return "format"  # outside a format's pattern, which is narrower than its checker

    def accepts(value: Any, **dumps: Any) -> bool:
        return accepts_text(json.dumps(value, ensure_ascii=False, **dumps))

    positions = _key_positions(schema)
    ordered = _reorder(data, positions)
    fitted = _reorder_fitted(data, _declared_orders(schema))
    resolved = _resolved(schema, registry)
    guided = [_reorder_guided(data, resolved, first) for first in (False, True)]
    candidates = (ordered, fitted, *guided)
    if _has_unusual_number(data) and (
        _beyond_bounds(data) or any(accepts_text(_respelled(c)) for c in (data, *candidates))
    ):
        return "number"
    for candidate in candidates:
        reordered = json.dumps(candidate) != json.dumps(data)
        if reordered and (accepts(candidate) or accepts(candidate, separators=(",", ":"))):
            return "property_order"
    if isinstance(data, dict) and 1 < len(data) <= MAX_PERMUTED_KEYS:
        for keys in itertools.permutations(ordered):  # an order the schema text does not show
            if accepts({k: ordered[k] for k in keys}):
                return "property_order"
    if accepts(data, separators=(",", ":")):
        return "whitespace"
    return "other"


def _fails_format_patterns(
    schema: Any, data: Any, registry: referencing.Registry[Any] | None
) -> bool:
    """Whether ``data`` fails ``schema`` once each ``format`` the rewrites spell as a pattern
    (``rewrite.FORMAT_PATTERNS``) is that pattern: some take less than their checker (a
    254-character ``hostname``, a ``uri-template`` with ``[]``), a narrowing of the format
    policy."""
    from espalier.constrained.postvalidate import validate_instance
    from espalier.constrained.schema.rewrite import FORMAT_MAX_LENGTH, FORMAT_PATTERNS
    from espalier.constrained.schema.walk import map_subschemas

    if not any(f'"{name}"' in json.dumps(schema) for name in FORMAT_PATTERNS):
        return False

    def patterned(node: Any, pointer: str) -> Any:
        if not isinstance(node, dict):
            return node
        node = map_subschemas(node, pointer, patterned)
        name = node.get("format")
        if not isinstance(name, str) or name not in FORMAT_PATTERNS:
            return node
        spelled: dict[str, Any] = {"type": "string", "pattern": FORMAT_PATTERNS[name]}
        if name in FORMAT_MAX_LENGTH:
            spelled["maxLength"] = FORMAT_MAX_LENGTH[name]
        rest = {k: v for k, v in node.items() if k != "format"}
        listed = rest.get("allOf")
        branches: list[Any] = listed if isinstance(listed, list) else []
        return {**rest, "allOf": [*branches, {"anyOf": [spelled, {"not": {"type": "string"}}]}]}

    check = validate_instance(patterned(schema, ""), data, registry=registry)
    return check.checked and not check.valid


def _key_positions(schema: Any) -> dict[str, int]:
    """Each property name's rank of first declaration in a ``properties`` of the schema."""
    positions: dict[str, int] = {}
    for names in _declared_orders(schema):
        for name in names:
            positions.setdefault(name, len(positions))
    return positions


def _declared_orders(schema: Any) -> list[list[str]]:
    """The names of every ``properties`` of the schema, each list in declared order."""
    orders: list[list[str]] = []

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "properties" and isinstance(value, dict):
                    orders.append(list(value))
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schema)
    return orders


def _resolved(schema: Any, registry: referencing.Registry[Any] | None) -> Any:
    """``schema`` with its refs as ``#/$defs/...`` (:mod:`refs`); ``schema`` if that fails."""
    from espalier.constrained.schema.refs import resolve_refs

    try:
        return resolve_refs(schema, registry).schema
    except Exception:  # an unresolvable ref: the grammar was compiled, so this is rare
        return schema


def _reorder_guided(data: Any, schema: Any, branches_first: bool = False) -> Any:
    """Each object's keys in the order of the schema node the instance reaches there: the
    node's ``properties``, then those of its ``allOf`` branches and of the first ``anyOf`` /
    ``oneOf`` branch the value matches (the order a backend merging the branches writes them
    in; ``branches_first``: the branches' before the node's own), then ``required`` names none
    of them declares, other keys last."""
    from espalier.constrained.postvalidate import validate_instance

    defs = schema.get("$defs", {}) if isinstance(schema, dict) else {}
    defs = defs if isinstance(defs, dict) else {}
    dialect = (
        {"$schema": schema["$schema"]} if isinstance(schema, dict) and "$schema" in schema else {}
    )

    def matches(value: Any, branch: Any) -> bool:
        if not isinstance(branch, dict):
            return bool(branch)
        try:
            return validate_instance({**dialect, **branch, "$defs": defs}, value).valid
        except Exception:  # a branch jsonschema cannot take alone
            return False

    def node_properties(value: Any, node: Any, depth: int) -> dict[str, Any]:
        node = _deref(node, defs)
        if not isinstance(node, dict) or depth > 8:
            return {}
        own = node.get("properties")
        own = dict(own) if isinstance(own, dict) else {}
        out = {} if branches_first else dict(own)
        branches = node.get("allOf")
        taken = list(branches) if isinstance(branches, list) else []
        for key in ("anyOf", "oneOf"):
            union = node.get(key)
            if isinstance(union, list):
                taken += [b for b in union if matches(value, b)][:1] or union
        for branch in taken:
            for name, sub in node_properties(value, branch, depth + 1).items():
                out.setdefault(name, sub)
        for name, sub in own.items():
            out.setdefault(name, sub)
        required = node.get("required")
        for name in required if isinstance(required, list) else []:
            if isinstance(name, str):
                out.setdefault(name, _UNDECLARED)
        return out

    def guide(value: Any, node: Any, depth: int) -> Any:
        node = _deref(node, defs)
        if depth > MAX_GUIDE_DEPTH or not isinstance(node, dict):
            return value
        if isinstance(value, dict):
            listed = node_properties(value, node, 0)
            rank = {name: i for i, name in enumerate(listed)}
            keys = sorted(value, key=lambda k: rank.get(k, len(rank)))
            subs = {k: listed.get(k, _UNDECLARED) for k in keys}
            subs = {k: _unlisted(node, k) if v is _UNDECLARED else v for k, v in subs.items()}
            return {k: guide(value[k], subs[k], depth + 1) for k in keys}
        if isinstance(value, list):
            prefix = node.get("prefixItems")
            prefix = prefix if isinstance(prefix, list) else []
            rest = node.get("items", True)
            for key in ("anyOf", "oneOf"):  # an array kind chosen by a union
                union = node.get(key)
                if "items" not in node and isinstance(union, list):
                    chosen = [b for b in union if matches(value, b)][:1]
                    if chosen:
                        return guide(value, chosen[0], depth + 1)
            return [
                guide(v, prefix[i] if i < len(prefix) else rest, depth + 1)
                for i, v in enumerate(value)
            ]
        return value

    return guide(data, schema, 0)


def _unlisted(node: dict[str, Any], name: str) -> Any:
    """The schema ``node`` gives a property it does not list: a matching pattern's, else
    ``additionalProperties``."""
    from espalier.constrained.postvalidate import pattern_search

    patterns = node.get("patternProperties")
    for pattern, sub in patterns.items() if isinstance(patterns, dict) else ():
        if pattern_search(pattern, name):
            return sub
    return node.get("additionalProperties", True)


def _deref(node: Any, defs: dict[str, Any]) -> Any:
    for _ in range(8):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not isinstance(ref, str) or not ref.startswith("#/$defs/"):
            break
        target = defs.get(ref[len("#/$defs/") :])
        if target is None:
            break
        # siblings of the ref (2019-09+) still name properties: keep them next to the target
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        node = {**siblings, "allOf": [target, *siblings.get("allOf", [])]} if siblings else target
    return node


def _reorder_fitted(data: Any, orders: list[list[str]]) -> Any:
    """Each object's keys in the order of the ``properties`` that names most of them (the first
    such); where schemas declare shared names in different orders (a union of object kinds), a
    single ranking of all names cannot put every object in its own schema's order."""
    if isinstance(data, dict):
        best = max(orders, key=lambda names: len(set(names) & set(data)), default=[])
        rank = {name: i for i, name in enumerate(best)}
        keys = sorted(data, key=lambda k: rank.get(k, len(rank)))
        return {k: _reorder_fitted(data[k], orders) for k in keys}
    if isinstance(data, list):
        return [_reorder_fitted(v, orders) for v in data]
    return data


def _reorder(data: Any, positions: dict[str, int]) -> Any:
    if isinstance(data, dict):
        keys = sorted(data, key=lambda k: positions.get(k, 1 << 30))
        return {k: _reorder(data[k], positions) for k in keys}
    if isinstance(data, list):
        return [_reorder(v, positions) for v in data]
    return data


def _numbers(data: Any) -> list[Any]:
    if isinstance(data, dict):
        return [n for v in data.values() for n in _numbers(v)]
    if isinstance(data, list):
        return [n for v in data for n in _numbers(v)]
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        return [data]
    return []


def _has_unusual_number(data: Any) -> bool:
    return any(isinstance(n, float) or abs(n) >= NUMBER_LIMIT for n in _numbers(data))


def _beyond_bounds(data: Any) -> bool:
    """Whether a number lies outside every narrowed language (integer or ``number``)."""
    return any(
        abs(n) >= NUMBER_LIMIT  # past a ``number``'s range (an ``integer``'s too past 2**53 - 1)
        or "e" in repr(n)
        or (isinstance(n, float) and len(repr(n).partition(".")[2]) > FRACTION_DIGITS)
        for n in _numbers(data)
    )


def _respelled(data: Any, **dumps: Any) -> str:
    """JSON text of ``data`` with integral floats as integers, other floats without exponent."""
    plain: list[str] = []

    def mark(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        if isinstance(value, float) and value == value and abs(value) != float("inf"):
            plain.append(
                str(int(value)) if value.is_integer() else format(Decimal(repr(value)), "f")
            )
            return f"\x00{len(plain) - 1}\x00"
        return value

    text = json.dumps(mark(data), ensure_ascii=False, **dumps)
    for i, number in enumerate(plain):
        text = text.replace(json.dumps(f"\x00{i}\x00"), number, 1)
    return text
