"""``unevaluatedProperties`` / ``unevaluatedItems`` as plain keywords when what they see is fixed.

``unevaluatedProperties: U`` checks with ``U`` every property that no adjacent keyword and no
in-place subschema that *passed* evaluated. When the only in-place applicators are ``allOf``,
``$ref`` and ``not`` (``not`` never contributes: its annotations are dropped), every contributing
subschema must pass for the object to be valid, so the evaluated set does not depend on the
instance: the property names of each ``properties``, the regexes of each ``patternProperties``,
and "all of them" once some subschema has ``additionalProperties`` or its own
``unevaluatedProperties``. Then ``U`` is exactly one more ``allOf`` branch::

    {"properties": {name: true, ...}, "patternProperties": {"(?:p1)|(?:p2)": true},
     "additionalProperties": U}

(or nothing at all when everything is evaluated). ``unevaluatedItems`` likewise with the longest
``prefixItems`` and "all" for ``items`` or a nested ``unevaluatedItems``. ``anyOf``, ``oneOf``,
``if``/``then``/``else``, ``dependentSchemas``, ``contains`` and dynamic refs make the evaluated
set depend on the instance when their subschemas hold such keywords: the node is then left as it
is (and stays refused in strict mode). Input: a Draft 2020-12 schema whose refs are
``#/$defs/<name>`` (:func:`refs.resolve_refs`); ``defs`` is its root ``$defs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from espalier.constrained.schema.logic import DEFS_PREFIX, Defs
from espalier.constrained.schema.walk import map_subschemas

PROPERTY_KEYS = frozenset(
    {"properties", "patternProperties", "additionalProperties", "unevaluatedProperties"}
)
ITEM_KEYS = frozenset({"prefixItems", "items", "unevaluatedItems", "contains"})
# in-place applicators whose annotations count only when an instance-dependent branch passes
DYNAMIC = ("anyOf", "oneOf", "if", "then", "else", "dependentSchemas", "dependencies")
DYNAMIC_REFS = ("$dynamicRef", "$recursiveRef")
IN_PLACE = frozenset({"allOf", "not", "$ref", *DYNAMIC, *DYNAMIC_REFS})


@dataclass(frozen=True)
class _Evaluated:
    """What the in-place subschemas of one node evaluate, for every valid instance."""

    everything: bool = False
    names: frozenset[str] = frozenset()
    patterns: tuple[str, ...] = ()
    prefix: int = 0


class _Dynamic(Exception):
    """The evaluated set depends on the instance."""


def resolve_unevaluated(schema: Any, defs: Defs) -> Any:
    """``schema`` with each static ``unevaluated*`` rewritten as above, children first."""
    return _resolve(schema, "", defs)


def _resolve(node: Any, pointer: str, defs: Defs) -> Any:
    if not isinstance(node, dict):
        return node
    node = map_subschemas(node, pointer, lambda sub, at: _resolve(sub, at, defs))
    for key, kind in (("unevaluatedProperties", PROPERTY_KEYS), ("unevaluatedItems", ITEM_KEYS)):
        if key not in node:
            continue
        try:
            seen = _collect(node, kind, defs, set(), root=True)
        except _Dynamic:
            continue
        node = _replace(node, key, seen)
    return node


def _replace(node: dict[str, Any], key: str, seen: _Evaluated) -> dict[str, Any]:
    rest = {k: v for k, v in node.items() if k != key}
    value = node[key]
    plain = "additionalProperties" if key == "unevaluatedProperties" else "items"
    if seen.everything:
        return rest
    if value is True or value == {} or not IN_PLACE & set(rest):
        # only the adjacent keywords evaluate; a ``true`` keeps "all evaluated" for a parent
        return {**rest, plain: value}
    if key == "unevaluatedProperties":
        branch: dict[str, Any] = {"properties": dict.fromkeys(sorted(seen.names), True)}
        if seen.patterns:
            branch["patternProperties"] = {"|".join(f"(?:{p})" for p in seen.patterns): True}
        branch["additionalProperties"] = value
    else:
        branch = {"prefixItems": [True] * seen.prefix} if seen.prefix else {}
        branch["items"] = value
    return {**rest, "allOf": [*rest.get("allOf", []), branch]}


def _collect(
    node: Any, kind: frozenset[str], defs: Defs, refs: set[str], root: bool = False
) -> _Evaluated:
    """What ``node`` and its ``allOf`` / ``$ref`` subschemas evaluate; raises _Dynamic."""
    if not isinstance(node, dict):
        return _Evaluated()
    if any(k in node for k in DYNAMIC_REFS):
        raise _Dynamic
    for key in DYNAMIC:
        if key in node and _touches(_subschemas(key, node[key]), kind, defs, set()):
            raise _Dynamic
    parts = [_own(node, kind, root)]
    for sub in node.get("allOf", []) if isinstance(node.get("allOf"), list) else ():
        parts.append(_collect(sub, kind, defs, refs))
    ref = node.get("$ref")
    if ref is not None:
        parts.append(_collect(_target(ref, defs, refs), kind, defs, refs | {ref}))
    return _Evaluated(
        everything=any(p.everything for p in parts),
        names=frozenset().union(*(p.names for p in parts)),
        patterns=tuple(dict.fromkeys(p for part in parts for p in part.patterns)),
        prefix=max(p.prefix for p in parts),
    )


def _own(node: dict[str, Any], kind: frozenset[str], root: bool) -> _Evaluated:
    if kind is PROPERTY_KEYS:
        nested = "unevaluatedProperties" in node and not root
        properties = node.get("properties")
        patterns = node.get("patternProperties")
        return _Evaluated(
            everything="additionalProperties" in node or nested,
            names=frozenset(properties) if isinstance(properties, dict) else frozenset(),
            patterns=tuple(patterns) if isinstance(patterns, dict) else (),
        )
    if "contains" in node:
        raise _Dynamic  # contains evaluates the items that match it
    prefix = node.get("prefixItems")
    nested = "unevaluatedItems" in node and not root
    return _Evaluated(
        everything="items" in node or nested,
        prefix=len(prefix) if isinstance(prefix, list) else 0,
    )


def _target(ref: Any, defs: Defs, refs: set[str]) -> Any:
    if not isinstance(ref, str) or not ref.startswith(DEFS_PREFIX) or ref in refs:
        raise _Dynamic  # unknown target, or an in-place cycle
    name = ref[len(DEFS_PREFIX) :]
    if name not in defs:
        raise _Dynamic
    return defs[name]


def _subschemas(key: str, value: Any) -> list[Any]:
    """The subschemas of one in-place applicator's value."""
    if key in ("dependentSchemas", "dependencies"):
        return list(value.values()) if isinstance(value, dict) else []
    if key in ("anyOf", "oneOf", "allOf"):
        return value if isinstance(value, list) else []
    return [value]


def _touches(subs: list[Any], kind: frozenset[str], defs: Defs, refs: set[str]) -> bool:
    """Whether some of ``subs`` may evaluate properties (items) in place."""
    for sub in subs:
        if not isinstance(sub, dict):
            continue
        if kind & set(sub) or any(k in sub for k in DYNAMIC_REFS):
            return True
        ref = sub.get("$ref")
        if ref is not None:
            try:
                target = _target(ref, defs, refs)
            except _Dynamic:
                return True
            if _touches([target], kind, defs, refs | {ref}):
                return True
        inner = [_subschemas(k, sub[k]) for k in ("allOf", *DYNAMIC) if k in sub]
        if any(_touches(subs, kind, defs, refs) for subs in inner):
            return True
    return False
