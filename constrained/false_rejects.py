"""Why a grammar rejected a valid instance: a generation policy, or a defect ("other").

The grammars narrow on purpose (``docs/decisions/conformance-generation-policies.md``):

- ``format``: ``format`` is asserted (the post-validation checks it), while Draft 2019-09 / 2020-12
  make it an annotation by default: an instance failing its format is rejected;
- ``number``: numbers are spelled the way a model writes them (no exponent, integers without
  ``.0``) and bounded (:mod:`number_bounds`): ``1e-07``, ``1.0`` for an integer or ``1e300`` are
  rejected although valid;
- ``property_order``: properties come in the order the schema declares them;
- ``whitespace``: at most ``json_max_whitespace`` characters between tokens.

:func:`false_reject_cause` decides by trying the instance again, respelled: what makes the grammar
accept it names the cause; nothing does: ``other``.
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
INTEGER_LIMIT = 2**53 - 1  # number_bounds' default integer bound
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

    def accepts(value: Any, **dumps: Any) -> bool:
        return accepts_text(json.dumps(value, ensure_ascii=False, **dumps))

    positions = _key_positions(schema)
    ordered = _reorder(data, positions)
    if _has_unusual_number(data) and (
        accepts_text(_respelled(data)) or accepts_text(_respelled(ordered)) or _beyond_bounds(data)
    ):
        return "number"
    fitted = _reorder_fitted(data, _declared_orders(schema))
    for candidate in (ordered, fitted):
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
    return any(isinstance(n, float) or abs(n) > INTEGER_LIMIT for n in _numbers(data))


def _beyond_bounds(data: Any) -> bool:
    return any(abs(n) > INTEGER_LIMIT or "e" in repr(n) for n in _numbers(data))


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
