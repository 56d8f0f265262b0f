"""Keywords a known schema already guarantees, dropped before a complement is taken.

Where the complement of ``B`` is only ever used next to schemas ``G`` that hold too (``this
branch and no other`` in a ``oneOf``, ``not`` / ``if`` next to their siblings), each keyword of
``B`` that ``G`` implies cannot be the one violated: ``G and not B`` equals ``G and not B'``
with ``B'`` = ``B`` less those keywords. :func:`without_implied` builds ``B'``, which often has
a complement where ``B`` has none (a shared ``$ref``'d property, the same
``additionalProperties``). Implied here: a keyword with an equal value in ``G`` (JSON equality;
a keyword read with siblings, such as ``items`` with ``prefixItems``, only when those are equal
too; ``additionalProperties`` only when the names and patterns it depends on are the same), each
``properties`` entry equal to ``G``'s (its subschema becomes ``true``: the name stays listed for
``additionalProperties``), ``required`` names ``G`` requires, a ``type`` covering ``G``'s. A
``properties`` entry that ``G`` lists with another subschema loses, the same way, what ``G``'s
subschemas for that name imply (a present name matches them; up to MAX_NESTING levels), and
becomes ``false`` where one of those is disjoint from it (every present value violates it).
"""

from __future__ import annotations

from typing import Any

from espalier.constrained.schema.disjoint import disjoint
from espalier.constrained.schema.logic import Defs, canonical, deref

# keywords whose meaning depends on siblings: implied only when those are equal too
READ_WITH = {
    "items": ("prefixItems",),
    "contains": ("minContains", "maxContains"),
    "minContains": ("contains",),
    "maxContains": ("contains",),
    "if": ("then", "else"),
    "then": ("if",),
    "else": ("if",),
}
NEVER = frozenset({"unevaluatedProperties", "unevaluatedItems"})  # read every sibling
_ABSENT: Any = object()  # a keyword not present (equal only to itself)
MAX_NESTING = 4  # property levels looked into


def without_implied(schema: Any, givens: list[Any], defs: Defs, depth: int = 0) -> Any:
    """``schema`` less the keywords ``givens`` (schemas known to hold) imply, as above."""
    schema = deref(schema, defs)
    facts = _flatten(givens, defs)
    if not isinstance(schema, dict) or not facts:
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "properties" and isinstance(value, dict):
            out[key] = {
                n: _property_less_implied(n, s, facts, defs, depth) for n, s in value.items()
            }
        elif key == "required" and isinstance(value, list):
            present = {n for f in facts for n in _list(f.get("required"))}
            out[key] = [n for n in value if n not in present]
        elif not any(_implies(f, key, schema) for f in facts):
            out[key] = value
    return out


def _property_less_implied(
    name: str, sub: Any, facts: list[dict[str, Any]], defs: Defs, depth: int
) -> Any:
    """Property ``name``'s subschema less what the facts' own subschemas for ``name`` imply: a
    present ``name`` matches each of those, so only the rest of ``sub`` can be violated."""
    if _same_property(name, sub, facts):
        return True
    given = [
        f["properties"][name]
        for f in facts
        if isinstance(f.get("properties"), dict) and name in f["properties"]
    ]
    if not given or depth >= MAX_NESTING:
        return sub
    if any(disjoint(sub, g, defs) for g in given):
        return False  # every value a fact allows violates ``sub``
    return without_implied(sub, given, defs, depth + 1)


def _implies(fact: dict[str, Any], key: str, schema: dict[str, Any]) -> bool:
    """Whether ``fact`` guarantees keyword ``key`` of ``schema``."""
    if key == "type":
        return _covers(schema[key], fact.get("type"))
    if key == "additionalProperties":
        return _same_openness(schema, fact)
    if key in NEVER or key not in fact:
        return False
    together = (key, *READ_WITH.get(key, ()))
    return all(_equal(fact.get(k, _ABSENT), schema.get(k, _ABSENT)) for k in together)


def _flatten(givens: list[Any], defs: Defs, depth: int = 0) -> list[dict[str, Any]]:
    """The schema objects that hold: ``givens`` and their ``allOf`` members, refs followed."""
    out: list[dict[str, Any]] = []
    for given in givens:
        given = deref(given, defs)
        if not isinstance(given, dict):
            continue
        out.append(given)
        members = given.get("allOf")
        if isinstance(members, list) and depth < 4:
            out += _flatten(members, defs, depth + 1)
    return out


def _equal(a: Any, b: Any) -> bool:
    if a is _ABSENT or b is _ABSENT:
        return a is b
    return canonical(a) == canonical(b)


def _same_property(name: str, sub: Any, facts: list[dict[str, Any]]) -> bool:
    """Whether a fact gives property ``name`` the same subschema (so a present ``name`` passes)."""
    return any(
        isinstance(f.get("properties"), dict)
        and name in f["properties"]
        and _equal(f["properties"][name], sub)
        for f in facts
    )


def _same_openness(schema: dict[str, Any], fact: dict[str, Any]) -> bool:
    """Whether ``fact`` has the same ``additionalProperties`` over the same listed names and
    patterns (then every name it lets through, ``schema`` lets through too)."""
    if "additionalProperties" not in fact:
        return False
    if not _equal(fact["additionalProperties"], schema["additionalProperties"]):
        return False
    mine, theirs = schema.get("properties", {}), fact.get("properties", {})
    if not isinstance(mine, dict) or not isinstance(theirs, dict) or set(mine) != set(theirs):
        return False
    return _equal(fact.get("patternProperties", {}), schema.get("patternProperties", {}))


def _covers(value: Any, given: Any) -> bool:
    """Whether ``type: value`` admits every instance ``type: given`` admits."""
    names = _names(value)
    known = _names(given)
    if names is None or known is None:
        return False
    if "number" in names:
        names = names | {"integer"}
    return known <= names


def _names(value: Any) -> set[str] | None:
    if isinstance(value, str):
        return {value}
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return set(value)
    return None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
