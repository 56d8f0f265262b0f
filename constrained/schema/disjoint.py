"""Whether two schemas share no instance: the proof behind ``oneOf`` → ``anyOf``.

A schema object is the conjunction of its keywords and of its ``allOf`` members (refs
followed): its **conjuncts** (:func:`conjuncts`). Two schemas are disjoint given a context
when some conjunct of one and some conjunct of the other exclude each other: no common type
or value, strings with leading characters or patterns they cannot share, a finite
``enum`` / ``const`` with no member valid under the other, or (objects only) a property that
some conjunct requires and that the two allow no common value for. A conjunct holding a union
(``anyOf`` / ``oneOf``; a ``oneOf`` instance matches one of its branches too) is split: the
two are disjoint when every branch, with the rest of its schema, is disjoint from the other.
Every answer True is exact; False means "not proven".
"""

from __future__ import annotations

from typing import Any

from espalier.constrained.schema.logic import MAX_DEPTH, Defs, deref, types_of, values_of
from espalier.constrained.schema.regular import patterns_meet
from espalier.constrained.schema.string_prefix import strings_disjoint

MAX_CONJUNCTS = 32  # per schema, through nested allOf / refs
MAX_UNION = 16  # branches of a union split in a proof
MAX_SPLIT_DEPTH = 3  # nested union splits along one proof
MAX_STEPS = 400  # schema pairs one proof may compare (unions and properties multiply them)


def pairwise_disjoint(branches: Any, defs: Defs, context: Any = True) -> bool:
    if not isinstance(branches, list):
        return False
    return all(
        disjoint(a, b, defs, context) for i, a in enumerate(branches) for b in branches[i + 1 :]
    )


def disjoint(a: Any, b: Any, defs: Defs, context: Any = True) -> bool:
    """True only when no instance can match ``a``, ``b`` and ``context`` (the keywords next to
    the ``oneOf``) together, as the module docstring says (False past MAX_STEPS)."""
    return _disjoint(a, b, defs, context, 0, 0, [MAX_STEPS])


def _disjoint(
    a: Any, b: Any, defs: Defs, context: Any, depth: int, splits: int, budget: list[int]
) -> bool:
    budget[0] -= 1
    if budget[0] < 0:
        return False  # not proven within the budget
    parts_a, parts_b = conjuncts(a, defs), conjuncts(b, defs)
    parts_c = conjuncts(context, defs)
    if parts_a is None or parts_b is None or parts_c is None:
        return False
    if any(p is False for p in (*parts_a, *parts_b, *parts_c)):
        return True
    if _parts_disjoint(parts_a, parts_b, parts_c, a, b, defs, depth, splits, budget):
        return True
    if splits >= MAX_SPLIT_DEPTH or depth >= MAX_DEPTH:
        return False
    for parts, other in ((parts_a, b), (parts_b, a)):
        cases = _union_cases(parts)
        if cases is not None and all(
            _disjoint(case, other, defs, context, depth, splits + 1, budget) for case in cases
        ):
            return True
    return False


def conjuncts(schema: Any, defs: Defs, depth: int = 0) -> list[Any] | None:
    """Schema objects (and booleans) whose conjunction is ``schema``: ``schema`` without its
    ``allOf``, then its ``allOf`` members', refs followed; None past MAX_CONJUNCTS."""
    schema = deref(schema, defs)
    if not isinstance(schema, dict):
        return [schema] if isinstance(schema, bool) else []
    members = schema.get("allOf")
    if not isinstance(members, list) or depth >= MAX_DEPTH:
        return [schema]
    out: list[Any] = [{k: v for k, v in schema.items() if k != "allOf"}]
    for member in members:
        inner = conjuncts(member, defs, depth + 1)
        if inner is None:
            return None
        out += inner
    return out if len(out) <= MAX_CONJUNCTS else None


def _union_cases(parts: list[Any]) -> list[Any] | None:
    """The first union among ``parts`` split into cases, each a schema (the other parts, the
    rest of that part, one branch); None when no part holds a small union."""
    for i, part in enumerate(parts):
        if not isinstance(part, dict):
            continue
        for key in ("anyOf", "oneOf"):
            branches = part.get(key)
            if isinstance(branches, list) and 0 < len(branches) <= MAX_UNION:
                rest = [*parts[:i], {k: v for k, v in part.items() if k != key}, *parts[i + 1 :]]
                return [{"allOf": [*rest, branch]} for branch in branches]
    return None


def _parts_disjoint(
    parts_a: list[Any],
    parts_b: list[Any],
    parts_c: list[Any],
    a: Any,
    b: Any,
    defs: Defs,
    depth: int,
    splits: int,
    budget: list[int],
) -> bool:
    """Whether conjuncts of ``a`` and of ``b`` (``parts_c``: of the context) exclude each other
    without splitting a union here (a property's subschemas may split the splits left)."""
    common: set[str] | None = None
    for part in (*parts_a, *parts_b, *parts_c):
        types = types_of(part, defs)
        if types is not None:
            common = types if common is None else common & types
    if common is not None and not common:
        return True
    left, right = [*parts_a, *parts_c], [*parts_b, *parts_c]
    for x in left:
        for y in right:
            vx, vy = values_of(x, defs), values_of(y, defs)
            if vx is not None and vy is not None and not vx & vy:
                return True
            if common == {"string"} and (strings_disjoint(x, y) or _patterns_disjoint(x, y)):
                return True  # e.g. anchored patterns whose first characters differ
    if any(_no_member_matches(x, b, defs) for x in parts_a) or any(
        _no_member_matches(y, a, defs) for y in parts_b
    ):
        return True  # e.g. enum ["Door", "Window"] against pattern "(\\+)\\w+"
    if common is None or common - {"object"} or depth >= MAX_DEPTH:
        return False  # a non-object instance ignores properties/required: it may match both
    present = set().union(*(_required(p) for p in (*parts_a, *parts_b, *parts_c)))
    for name in sorted(present):
        xs = [s for p in left for s in _applying(p, name, defs)] or [True]
        ys = [s for p in right for s in _applying(p, name, defs)] or [True]
        if any(_disjoint(x, y, defs, True, depth + 1, splits, budget) for x in xs for y in ys):
            return True
    return False


def _patterns_disjoint(a: Any, b: Any) -> bool:
    """Whether the ``pattern``s of two schema objects match no common string (:mod:`regular`)."""
    patterns = tuple(
        s["pattern"] for s in (a, b) if isinstance(s, dict) and isinstance(s.get("pattern"), str)
    )
    return len(patterns) == 2 and patterns_meet(patterns) is False


def _no_member_matches(finite: Any, other: Any, defs: Defs) -> bool:
    """Whether ``finite`` allows a few values only (``const`` / ``enum``, up to 64) and the
    post-validator finds none of them valid under ``other`` (refs against the root ``$defs``)."""
    if not isinstance(finite, dict) or not (
        "const" in finite or isinstance(finite.get("enum"), list)
    ):
        return False
    members = [finite["const"]] if "const" in finite else finite["enum"]
    if len(members) > 64:
        return False
    from espalier.constrained.postvalidate import schema_validator, time_limit

    try:
        validator = schema_validator({"$defs": defs, "allOf": [other]})
        with time_limit(MEMBER_CHECK_S):
            return not any(validator.is_valid(m) for m in members)
    except Exception:  # a pattern Python cannot compile, an unresolvable ref, a timeout: none
        return False


MEMBER_CHECK_S = 0.5
"""Time for the member checks of one pair of branches (a backtracking pattern: no verdict)."""


def _required(schema: Any) -> set[str]:
    names = schema.get("required") if isinstance(schema, dict) else None
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()


def _applying(schema: Any, name: str, defs: Defs) -> list[Any]:
    """The subschemas ``schema`` applies to property ``name`` when present ([] if unknown)."""
    if not isinstance(schema, dict):
        return [schema]
    listed = schema.get("properties")
    out = [listed[name]] if isinstance(listed, dict) and name in listed else []
    patterns = schema.get("patternProperties", {})
    if not isinstance(patterns, dict):
        return out
    from espalier.constrained.postvalidate import pattern_search

    for pattern, sub in patterns.items():
        found = pattern_search(pattern, name)
        if found is None:
            return out  # unknown whether additionalProperties applies
        if found:
            out.append(sub)
    if not out and "additionalProperties" in schema:
        out.append(schema["additionalProperties"])
    return [deref(sub, defs) for sub in out]
