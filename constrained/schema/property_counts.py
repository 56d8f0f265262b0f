"""``minProperties`` / ``maxProperties`` over optional listed properties as ``anyOf`` branches.

llguidance counts properties only where every name listed in ``properties`` is required (a
name listed as ``false`` does not count as listed); xgrammar and outlines-core enforce other
keywords less. An object's property count is ``|R| + |S| + e``: ``R`` the ``required`` names,
``S`` the optional listed names present (``opt``, listed and not ``false``), ``e`` the other
names present (none when ``additionalProperties: false`` and no ``patternProperties``: the
object is *closed*). Branching on ``S`` makes every branch a shape llguidance counts:

- ``minProperties: m``: ``{required: T}`` for each ``T ⊆ opt`` with ``|T| = m - |R|`` (at least
  ``m`` present), and, when the object is not closed, ``{required: S, properties: {opt - S:
  false}, minProperties: m}`` for each smaller ``S`` (exactly ``S`` present, the rest counted);
- ``maxProperties: M``: closed, ``{properties: {opt - T: false}}`` for each ``T`` with
  ``|T| = M - |R|`` (only names of ``T`` present); not closed, ``{required: S, properties:
  {opt - S: false}, maxProperties: M}`` for each ``|S| <= M - |R|``.

Every branch holds only object keywords, so non-objects pass; no branch at all means no object
passes (``type`` without ``object``). Past :data:`MAX_BRANCHES` branches the node is left alone
(llguidance then refuses it, naming the keyword). So is an object whose names cannot make
``minProperties`` keys (``empty.most_keys``): ``empty.py`` refuses it with its pointer.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from espalier.constrained.schema.empty import most_keys
from espalier.constrained.schema.logic import ALL_TYPES, Defs, deref

MAX_BRANCHES = 64
NOT_OBJECT = [t for t in ALL_TYPES if t != "object"]


def rewrite_property_counts(node: dict[str, Any], defs: Defs) -> dict[str, Any]:
    """``node`` with ``minProperties`` / ``maxProperties`` replaced as above, or unchanged."""
    low, high = node.get("minProperties", 0), node.get("maxProperties")
    listed, required = node.get("properties", {}), node.get("required", [])
    if not _count(low) or (high is not None and not _count(high)) or (low == 0 and high is None):
        return node
    if not isinstance(listed, dict) or not isinstance(required, list):
        return node
    if low > 0 and most_keys(node, low) is not None:
        return node  # no object has that many keys: left for ``empty.py`` to refuse here
    if not all(isinstance(name, str) for name in required):
        return node
    present = set(required)
    optional = [n for n, s in listed.items() if n not in present and deref(s, defs) is not False]
    if not optional:
        return node  # every listed name is required: counted as it is
    closed = node.get("additionalProperties") is False and not node.get("patternProperties")
    parts = []
    if low > 0:
        parts.append(_at_least(optional, low - len(present), low, closed))
    if high is not None:
        parts.append(_at_most(optional, high - len(present), high, closed))
    if any(p is None for p in parts) or math.prod(len(p or ()) for p in parts) > MAX_BRANCHES:
        return node
    rest = {k: v for k, v in node.items() if k not in ("minProperties", "maxProperties")}
    extra = [{"anyOf": p} if p else {"type": NOT_OBJECT} for p in parts if p != [{}]]
    if not extra:
        return rest
    return {**rest, "allOf": [*rest.get("allOf", []), *extra]}


def _at_least(
    optional: list[str], needed: int, low: int, closed: bool
) -> list[dict[str, Any]] | None:
    """Branches whose union is "at least ``low`` properties" (``needed`` of them optional)."""
    if needed <= 0:
        return [{}]  # the required names are enough
    if _subsets(len(optional), range(needed, needed + 1)) > MAX_BRANCHES:
        return None
    branches: list[dict[str, Any]] = [
        {"required": list(t)} for t in itertools.combinations(optional, needed)
    ]
    if not closed:
        if _subsets(len(optional), range(needed)) + len(branches) > MAX_BRANCHES:
            return None
        branches += [
            _exactly(optional, s, {"minProperties": low}) for s in _smaller(optional, needed)
        ]
    return branches


def _at_most(
    optional: list[str], allowed: int, high: int, closed: bool
) -> list[dict[str, Any]] | None:
    """Branches whose union is "at most ``high`` properties" (``allowed`` of them optional)."""
    if allowed < 0:
        return []  # the required names alone are too many
    if closed:
        if allowed >= len(optional):
            return [{}]
        if _subsets(len(optional), range(allowed, allowed + 1)) > MAX_BRANCHES:
            return None
        return [
            {"properties": {n: False for n in optional if n not in t}}
            for t in itertools.combinations(optional, allowed)
        ]
    if _subsets(len(optional), range(min(allowed, len(optional)) + 1)) > MAX_BRANCHES:
        return None
    return [_exactly(optional, s, {"maxProperties": high}) for s in _smaller(optional, allowed + 1)]


def _exactly(optional: list[str], chosen: tuple[str, ...], count: dict[str, int]) -> dict[str, Any]:
    """Exactly the names ``chosen`` of ``optional`` present, and the property ``count``."""
    absent = {n: False for n in optional if n not in chosen}
    return {**({"required": list(chosen)} if chosen else {}), "properties": absent, **count}


def _smaller(optional: list[str], size: int) -> list[tuple[str, ...]]:
    """Every subset of ``optional`` with fewer than ``size`` names."""
    top = min(size, len(optional) + 1)
    return [t for k in range(top) for t in itertools.combinations(optional, k)]


def _subsets(n: int, sizes: range) -> int:
    return sum(math.comb(n, k) for k in sizes if 0 <= k <= n)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
