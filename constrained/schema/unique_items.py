"""``uniqueItems: true`` over a finite item domain as an ``enum`` of every array it allows.

When each position's subschema admits finitely many values (``const`` / ``enum``, ``type``
boolean or null, an integer range of at most :data:`MAX_INTEGERS` values, ``false``) and the
length is bounded (``maxItems``, ``items: false`` after ``prefixItems``, or the domain's size: a
unique array cannot be longer), the arrays with distinct items are few enough to list.
``uniqueItems`` then becomes one more ``allOf`` branch: non-arrays, or one of those arrays (the
other keywords stay and still apply). Equality is JSON Schema's
(``1`` equals ``1.0``, ``true`` does not equal ``1``). More than :data:`MAX_ARRAYS`: left alone.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from espalier.constrained.schema.logic import (
    ALL_TYPES,
    Defs,
    canonical,
    deref,
    of_types,
    type_list,
)

MAX_ARRAYS = 512
MAX_CANDIDATES = 20_000  # arrays tried per length before keeping the unique ones
MAX_INTEGERS = 256  # integers listed for one item range (unique_places.MIN_OPEN_INTEGERS)
VALUE_KEYS = frozenset({"const", "enum", "type"})
INTEGER_KEYS = frozenset(
    {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
)
ARRAY_KEYS = frozenset({"type", "prefixItems", "items", "minItems", "maxItems", "uniqueItems"})
IGNORED = frozenset({"title", "description", "$comment", "default", "examples", "deprecated"})


def rewrite_unique_items(node: dict[str, Any], defs: Defs) -> Any:
    """``node`` with ``uniqueItems: true`` replaced as above, or ``node`` unchanged."""
    if node.get("uniqueItems") is not True:
        return node
    arrays = _unique_arrays(node, defs)
    if arrays is None:
        return node
    kind = node.get("type", list(ALL_TYPES))
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else None
    if kinds is not None and not set(node) - IGNORED - ARRAY_KEYS:
        # the listed arrays satisfy every array keyword of the node: the node is their enum
        others = [t for t in kinds if t != "array"]
        listed = {"enum": arrays} if "array" in kinds else False
        return {"anyOf": [{"type": others}, listed]} if others else listed
    rest = {k: v for k, v in node.items() if k != "uniqueItems"}
    others = [t for t in ALL_TYPES if t != "array"]
    branch = {"anyOf": [{"type": others}, {"type": "array", "enum": arrays}]}
    return {**rest, "allOf": [*rest.get("allOf", []), branch]}


def _unique_arrays(node: dict[str, Any], defs: Defs) -> list[list[Any]] | None:
    prefix = node.get("prefixItems", [])
    if not isinstance(prefix, list):
        return None
    tail = _domain(node.get("items", True), defs)
    heads = [_domain(sub, defs) for sub in prefix]
    low, high = node.get("minItems", 0), node.get("maxItems")
    if not isinstance(low, int) or (high is not None and not isinstance(high, int)):
        return None
    bound = len(prefix) + (len(tail) if tail is not None else 0)
    if tail is None and (high is None or high > len(prefix)):
        return None  # unbounded items after the prefix
    high = bound if high is None else min(high, bound)
    arrays: list[list[Any]] = []
    for length in range(low, high + 1):
        domains = [heads[i] if i < len(heads) else tail for i in range(length)]
        if any(d is None for d in domains):
            return None
        if _product_size(domains) > MAX_CANDIDATES:
            return None
        for combo in itertools.product(*domains):  # type: ignore[arg-type]
            keys = [canonical(v) for v in combo]
            if len(set(keys)) == len(keys):
                arrays.append(list(combo))
                if len(arrays) > MAX_ARRAYS:
                    return None
    return arrays


def _product_size(domains: list[Any]) -> int:
    size = 1
    for domain in domains:
        size *= len(domain)
        if size > MAX_CANDIDATES:
            break
    return size


def _domain(schema: Any, defs: Defs) -> list[Any] | None:
    """The values ``schema`` admits when finitely many and known exactly, else None."""
    schema = deref(schema, defs)
    if schema is False:
        return []
    if not isinstance(schema, dict):
        return None
    if schema.get("type") in ("integer", ["integer"]) and set(schema) - IGNORED <= INTEGER_KEYS:
        return _integers(schema)
    if not set(schema) - IGNORED <= VALUE_KEYS:
        return None
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list) or ("const" in schema and "enum" in schema):
            return None
        if "type" in schema:  # the members of the type (enum_filter runs after this rewrite)
            kinds = type_list(schema["type"])
            if kinds is None:
                return None
            values = [v for v in values if of_types(v, kinds)]
        return list({canonical(v): v for v in values}.values())
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else None
    if kinds is None or not set(kinds) <= {"boolean", "null"}:
        return None
    return [v for k, vs in (("boolean", [False, True]), ("null", [None])) if k in kinds for v in vs]


def _integers(schema: dict[str, Any]) -> list[Any] | None:
    """The integers an integer schema with numeric bounds admits, when at most
    :data:`MAX_INTEGERS`; None when a bound is missing or not a number, the range is wider, or
    it reaches past 2**53 (where a double quotient is no longer exact)."""
    bounds = [schema.get(k) for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")]
    step = schema.get("multipleOf", 1)
    numbers = [*bounds, step]
    if any(isinstance(b, bool) or not isinstance(b, (int, float, type(None))) for b in numbers):
        return None
    if any(isinstance(b, float) and not math.isfinite(b) for b in numbers):
        return None
    low, low_x, high, high_x = bounds
    lows = [math.ceil(low)] if low is not None else []
    lows += [math.floor(low_x) + 1] if low_x is not None else []
    highs = [math.floor(high)] if high is not None else []
    highs += [math.ceil(high_x) - 1] if high_x is not None else []
    if not lows or not highs or step is None or step <= 0:
        return None
    first, last = max(lows), min(highs)
    if last - first >= MAX_INTEGERS or max(abs(first), abs(last)) > 2**53:
        return None
    return [n for n in range(first, last + 1) if _multiple(n, step)]


def _multiple(n: int, step: float) -> bool:
    """``multipleOf`` for an integer ``n`` as ``jsonschema`` (the post-validation) decides it:
    exact for an integer step, the double quotient's integrality for a float one."""
    if isinstance(step, int):
        return n % step == 0
    quotient = n / step
    return math.isfinite(quotient) and quotient.is_integer()
