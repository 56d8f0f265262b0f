"""``contains`` / ``minContains`` / ``maxContains`` where counting the matches needs no counter.

An array passes ``contains: C`` when the number of its items matching ``C`` lies in
``[minContains (default 1), maxContains (default unbounded)]``; non-arrays always pass. The
backends have no such counter, but these shapes need none (``N`` is the complement of ``C``,
:func:`logic.complement`):

- ``maxContains < minContains``: no array passes → ``type`` without ``array``;
- ``minContains: 0`` and no ``maxContains``: every array passes → the three keywords dropped;
- ``C`` matches every item (``N`` is ``false``): the count is the length → ``minItems`` /
  ``maxItems``;
- ``C`` matches no item (``false``): the count is 0 → arrays pass iff ``minContains`` is 0;
- ``maxContains: 0`` (so ``minContains: 0``): no item may match → ``items: N`` in its own
  ``allOf`` branch (so that it covers the ``prefixItems`` positions too).

Anything else comes back unchanged (feature analysis then refuses ``contains``).
"""

from __future__ import annotations

from typing import Any

from espalier.constrained.schema.logic import ALL_TYPES, Defs, complement

KEYWORDS = ("contains", "minContains", "maxContains")
NOT_ARRAY = [t for t in ALL_TYPES if t != "array"]


def rewrite_contains(node: dict[str, Any], defs: Defs) -> dict[str, Any]:
    """``node`` with its ``contains`` keywords replaced as above, or ``node`` unchanged."""
    low, high = node.get("minContains", 1), node.get("maxContains")
    if not _count(low) or (high is not None and not _count(high)):
        return node
    rest = {k: v for k, v in node.items() if k not in KEYWORDS}
    if high is not None and high < low:
        return _with(rest, {"type": NOT_ARRAY})
    if low == 0 and high is None:
        return rest
    others = _constant(complement(node["contains"], defs))
    if others is False:  # every item matches: the count is the length
        lengths = {"minItems": low, **({"maxItems": high} if high is not None else {})}
        return _with(rest, lengths)
    if others is True:  # no item matches: the count is 0
        return rest if low == 0 else _with(rest, {"type": NOT_ARRAY})
    if high == 0 and others is not None:
        return _with(rest, {"items": others})
    return node


def _constant(schema: Any) -> Any:
    """``schema``, or True / False when it is an ``allOf`` / ``anyOf`` of booleans only."""
    if not isinstance(schema, dict) or not schema or set(schema) - {"allOf", "anyOf"}:
        return schema
    values = []
    for key, subs in schema.items():
        if not isinstance(subs, list) or not subs:
            return schema
        members = [_constant(sub) for sub in subs]
        if not all(isinstance(m, bool) for m in members):
            return schema
        values.append(all(members) if key == "allOf" else any(members))
    return all(values)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _with(node: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Both apply: ``extra`` as one more ``allOf`` branch, where no sibling can change its
    meaning (``items`` next to ``prefixItems`` would skip the prefix)."""
    return {**node, "allOf": [*node.get("allOf", []), extra]}
