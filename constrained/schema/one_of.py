"""``oneOf`` as keywords the backends enforce: ``anyOf`` where at most one branch can match.

Three exact forms, tried in order by :func:`rewrite_one_of`:

1. the branches are pairwise disjoint given the keywords next to the ``oneOf``
   (:func:`disjoint.disjoint`: conjuncts through ``allOf`` / refs, unions split): ``anyOf``
   of the branches;
2. **type by type** (:func:`by_type`): for each JSON type ``T`` every branch matches all of
   ``T`` (no keyword of it reads a ``T`` instance), none of ``T`` (its ``type``, ``enum`` or
   ``const`` excludes ``T``) or some. Two or more branches matching all of ``T``: no ``T``
   instance matches exactly one, ``T`` is dropped. One branch matching all of ``T`` and the others
   none, or only "some" branches pairwise disjoint on ``T``: ``T`` is kept, and ``anyOf``
   decides it. Arrays whose branches can share only the empty array (their first items are
   disjoint) are kept too, and ``[]`` is decided concretely (``jsonschema``): matched by two
   branches or more, ``minItems: 1`` removes it. The result is
   ``type: [kept types]`` and ``anyOf`` of the branches. Non-objects match every branch of
   ``properties`` / ``required`` alone, which is how real schemas tell objects apart;
3. otherwise ``anyOf`` of "this branch and no other" when the complements exist
   (:func:`exactly_one`).

None applies: the node is returned unchanged (the keyword table then refuses it in strict mode).
"""

from __future__ import annotations

import itertools
from typing import Any

from espalier.constrained.schema.disjoint import disjoint, pairwise_disjoint
from espalier.constrained.schema.features import NOT_ASSERTING, TYPE_OF, VOCABULARY
from espalier.constrained.schema.implied import without_implied
from espalier.constrained.schema.logic import (
    ALL_TYPES,
    NO_CONSTRAINT,
    Defs,
    append_all_of,
    complement,
    deref,
    key_set,
    meet,
    without,
)
from espalier.constrained.schema.value_complement import json_type

ALL, NONE, SOME = "all", "none", "some"
MAX_BRANCHES = 64  # pairwise disjointness checks grow with the square
MAX_OVERLAPS = 28  # branch pairs that need complements: the rewrite grows with each


def rewrite_one_of(node: dict[str, Any], defs: Defs) -> Any:
    """``node`` with its ``oneOf`` rewritten by the first form above that applies."""
    branches = node["oneOf"]
    context = without(node, "oneOf")
    if pairwise_disjoint(branches, defs, context=context):
        return append_all_of(context, {"anyOf": branches})
    split = by_type(branches, context, defs)
    if split is not None:
        return append_all_of(context, split) if split is not False else False
    exclusive = exactly_one(branches, defs, context=context)
    if exclusive is None:
        return node
    if exclusive is False:
        return False
    return append_all_of(context, exclusive)


def rewrite_one_of_in_all_of(node: dict[str, Any], defs: Defs) -> dict[str, Any]:
    """``node`` with each ``allOf`` member that holds a ``oneOf`` whose branches are pairwise
    disjoint given everything else ``node`` asserts (its other keywords, the other members,
    the member's own other keywords) turned into ``anyOf``; real schemas put the discriminator's
    ``required`` next to ``allOf: [base, {oneOf: [...]}]``, out of the member's sight."""
    members = node["allOf"]
    out = list(members)
    for i, member in enumerate(members):
        if not isinstance(member, dict) or not isinstance(member.get("oneOf"), list):
            continue
        others = [m for j, m in enumerate(out) if j != i]
        context = {**without(node, "allOf"), "allOf": [without(member, "oneOf"), *others]}
        if pairwise_disjoint(member["oneOf"], defs, context=context):
            out[i] = append_all_of(without(member, "oneOf"), {"anyOf": member["oneOf"]})
    return node if out == members else {**node, "allOf": out}


def by_type(branches: list[Any], context: dict[str, Any], defs: Defs) -> Any:
    """The type-by-type form (2. above) as a schema to add next to ``context``; ``False`` when
    no instance can match exactly one branch; None when some type needs a complement."""
    if len(branches) < 2 or len(branches) > 64:
        return None
    kept: list[str] = []
    check_empty_array = False
    for kind in ALL_TYPES:
        if type_verdict(context, kind, defs) == NONE:
            continue  # the siblings exclude this type: whatever oneOf says about it is moot
        verdicts = [type_verdict(b, kind, defs) for b in branches]
        alls = verdicts.count(ALL)
        some = [b for b, v in zip(branches, verdicts, strict=True) if v == SOME]
        if alls >= 2 or (alls == 0 and not some):
            continue  # matched by two branches, or by none
        if alls == 1:
            if some:
                return None  # "all of T but the others' T instances": a complement
            kept.append(kind)
            continue
        on_kind = {**context, "type": kind}
        if pairwise_disjoint(some, defs, context=on_kind):
            kept.append(kind)
        elif kind == "array" and _disjoint_but_empty(some, defs):
            kept.append(kind)
            check_empty_array = True
        else:
            return None
    if not kept:
        return False
    out: dict[str, Any] = {"type": kept[0] if len(kept) == 1 else kept, "anyOf": branches}
    if check_empty_array:
        matched = _count_valid([], branches, context, defs)
        if matched is None:
            return None
        if matched >= 2:
            out["minItems"] = 1  # [] matches two branches: not valid; minItems is array-only
    return out


def type_verdict(schema: Any, kind: str, defs: Defs, depth: int = 0) -> str:
    """Whether ``schema`` matches all, none or some of the instances of JSON type ``kind``
    ("number" includes integers). "all" and "none" are exact; "some" is the safe answer."""
    schema = deref(schema, defs)
    if isinstance(schema, bool):
        return ALL if schema else NONE
    if not isinstance(schema, dict) or depth > 8:
        return SOME
    verdict = ALL
    for key, value in schema.items():
        if key in NO_CONSTRAINT or key in NOT_ASSERTING or key not in VOCABULARY:
            continue
        if key == "type":
            names = [value] if isinstance(value, str) else value if isinstance(value, list) else []
            if not isinstance(value, (str, list)):
                return SOME
            if kind not in {"number" if n == "integer" else n for n in names}:
                return NONE
            if kind == "number" and "number" not in names:
                verdict = SOME  # integers only
        elif key in ("enum", "const"):
            values = [value] if key == "const" else value
            if not isinstance(values, list):
                return SOME
            if kind not in {json_type(v) for v in values}:
                return NONE
            verdict = SOME
        elif key in TYPE_OF:
            if TYPE_OF[key] == kind:
                verdict = SOME
        elif key == "allOf" and isinstance(value, list):
            inner = {type_verdict(sub, kind, defs, depth + 1) for sub in value}
            if NONE in inner:
                return NONE
            if SOME in inner:
                verdict = SOME
        else:
            verdict = SOME  # anyOf, not, if, a $ref next to other keywords ...
    return verdict


def _disjoint_but_empty(branches: list[Any], defs: Defs) -> bool:
    """Whether array branches can share no array but ``[]``: their first items are disjoint."""
    firsts = [_first_item(b, defs) for b in branches]
    return all(
        a is not None and b is not None and disjoint(a, b, defs)
        for a, b in itertools.combinations(firsts, 2)
    )


def _first_item(branch: Any, defs: Defs) -> Any:
    """The subschema the first item of an array must match under ``branch``; None if unknown."""
    branch = deref(branch, defs)
    if not isinstance(branch, dict):
        return None
    if set(branch) & {"allOf", "anyOf", "oneOf", "not", "if", "$ref", "contains"}:
        return None  # other keywords could constrain the first item too
    prefix = branch.get("prefixItems")
    if isinstance(prefix, list) and prefix:
        return prefix[0]
    return branch.get("items", True)


def _count_valid(value: Any, branches: list[Any], context: Any, defs: Defs) -> int | None:
    """How many branches ``value`` matches next to ``context`` (``jsonschema``, refs against
    the root ``$defs``); None when a branch cannot be checked."""
    from espalier.constrained.postvalidate import schema_validator, time_limit

    try:
        with time_limit(VALUE_CHECK_S):
            if not schema_validator({"$defs": defs, "allOf": [context]}).is_valid(value):
                return 0
            return sum(
                bool(schema_validator({"$defs": defs, "allOf": [b]}).is_valid(value))
                for b in branches
            )
    except Exception:  # a pattern Python cannot compile, an unresolvable ref, a timeout: none
        return None


VALUE_CHECK_S = 0.5
"""Time for one value's checks against the branches (a backtracking pattern: no verdict)."""


def exactly_one(branches: list[Any], defs: Defs, context: Any = True) -> Any:
    """``oneOf`` as ``anyOf`` of "this branch and no other"; None when a complement is missing.

    Each other branch is complemented less what this branch and ``context`` imply
    (:mod:`implied`); a branch disjoint from this one (:func:`disjoint.disjoint`) needs none.
    The growth is one complement per overlapping pair (at most MAX_OVERLAPS pairs).

    The other branches' complements are taken among the objects ``context`` (the keywords next
    to the ``oneOf``) and this branch allow (:func:`key_set`), which makes closed objects'
    ``additionalProperties`` / ``patternProperties`` complementable."""
    if len(branches) > MAX_BRANCHES:
        return None
    overlapping = {
        (i, j)
        for i, j in itertools.combinations(range(len(branches)), 2)
        if not disjoint(branches[i], branches[j], defs, context)
    }
    if len(overlapping) > MAX_OVERLAPS:
        return None  # quadratic growth: leave it
    around = key_set(context, defs)
    options = []
    for i, branch in enumerate(branches):
        keys = meet(around, key_set(branch, defs))
        givens = [branch, context]
        others = [
            complement(without_implied(b, givens, defs), defs, keys=keys)
            for j, b in enumerate(branches)
            if (min(i, j), max(i, j)) in overlapping
        ]
        if any(n is None for n in others):
            return None
        others = [n for n in others if n is not True]
        if any(n is False for n in others):
            continue  # another branch matches everything: this one can never be the only match
        options.append({"allOf": [branch, *others]} if others else branch)
    return {"anyOf": options} if options else False
