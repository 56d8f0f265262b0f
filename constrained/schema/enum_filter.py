"""Exact rewrite of ``enum`` / ``const`` next to other keywords: keep the members that can match.

An ``enum`` (or ``const``) lists concrete values, so every other keyword of the same schema object
can be decided on each member: a member that fails one of them can never be valid. Backends do not
all intersect the two (xgrammar emits the ``enum`` and drops a conflicting ``type``, so
``{"enum": ["A"], "type": "object"}`` accepted ``"A"``); after this rewrite they need not.

:func:`filter_enums` validates each member against its schema object without ``enum`` / ``const``
(``jsonschema`` with format assertion on and ``regex`` patterns, as the post-validation checks an
output; ``$ref`` resolved against the root), keeps the members that pass, and then:

- drops the sibling keywords: every member left satisfies them, so the object is equivalent to the
  ``enum`` alone (annotations, identifiers and unknown keywords stay). Not done when ``annotations``
  matter (``unevaluated*`` anywhere): dropping ``properties`` / ``items`` / applicators would change
  what a parent's ``unevaluated*`` sees, so the siblings stay (the keyword table then marks the
  ``enum`` not exact);
- no member left: the object matches nothing. At the root that is :class:`InvalidGrammarError`
  naming the pointer; below the root the object becomes ``false`` (exact: an optional property or
  an ``anyOf`` branch may be unsatisfiable while the schema is not).

An ``enum`` / ``const`` alone in an ``allOf`` branch counts as one next to the ``allOf``.

A member whose check raises (a pattern Python cannot compile, an unresolvable ``$dynamicRef``)
leaves its object unchanged. Input: a Draft 2020-12 schema whose refs are local (the output of
:func:`refs.resolve_refs` and :func:`rewrite.normalize_schema`'s other rewrites).
"""

from __future__ import annotations

import json
from typing import Any

from espalier.constrained.errors import InvalidGrammarError
from espalier.constrained.schema.features import NOT_ASSERTING, VOCABULARY, values_with_siblings
from espalier.constrained.schema.walk import map_subschemas

VALUES = ("enum", "const")


class _Undecided(Exception):
    """The members could not be checked: the object is left as it is."""


def filter_enums(schema: Any, *, annotations_matter: bool) -> Any:
    """``schema`` with every ``enum``/``const`` object reduced to its possible members (above)."""
    if not isinstance(schema, dict):
        return schema
    text = json.dumps(schema)
    if '"enum"' not in text and '"const"' not in text:
        return schema
    from espalier.constrained.postvalidate import schema_validator, time_limit

    try:
        root = schema_validator(schema)
    except Exception:  # a schema jsonschema cannot build a validator for: nothing to decide with
        return schema
    # past the limit each member check left is undecided (a backtracking pattern ran on a
    # compile thread for good: a compile timeout cannot stop a thread)
    with time_limit(ENUM_CHECK_S):
        return _filter(schema, "", root, annotations_matter)


ENUM_CHECK_S = 2.0
"""Time for all the member checks of one schema; the objects left then stay as they are."""


def _filter(node: Any, pointer: str, root: Any, annotations_matter: bool) -> Any:
    if not isinstance(node, dict):
        return node
    node = map_subschemas(node, pointer, lambda sub, at: _filter(sub, at, root, annotations_matter))
    node = _values_out_of_all_of(node)
    if not values_with_siblings(node):
        return node
    members = _members(node)
    if members is None:
        return node
    rest = {k: v for k, v in node.items() if k not in VALUES}
    if "enum" in node and "const" in node:
        rest["const"] = node["const"]  # an enum member must also equal the const
    try:
        kept = _passing(root, rest, members)
    except _Undecided:
        return node
    if not kept:
        if pointer == "":
            raise _unsatisfiable(pointer, node)
        return False
    if annotations_matter:
        out = dict(node)
    else:
        out = {k: v for k, v in node.items() if k not in VOCABULARY or k in NOT_ASSERTING}
    if "enum" in node:
        out.pop("const", None)
        out["enum"] = kept
    else:
        out["const"] = kept[0]
    return out


def _values_out_of_all_of(node: dict[str, Any]) -> dict[str, Any]:
    """``allOf: [{"enum": E}, B, ...]`` → ``enum: E`` next to ``allOf: [B, ...]``: both must
    hold either way, and the members are then checked against ``B, ...`` as siblings are."""
    branches = node.get("allOf")
    if "enum" in node or "const" in node or not isinstance(branches, list):
        return node
    for i, branch in enumerate(branches):
        if (
            isinstance(branch, dict)
            and len(set(branch) & set(VALUES)) == 1
            and all(k in VALUES or k in NOT_ASSERTING or k not in VOCABULARY for k in branch)
        ):
            rest = [b for j, b in enumerate(branches) if j != i]
            out = {k: v for k, v in node.items() if k != "allOf"}
            out.update({k: branch[k] for k in VALUES if k in branch})
            return {**out, "allOf": rest} if rest else out
    return node


def _members(node: dict[str, Any]) -> list[Any] | None:
    if "enum" in node:
        return node["enum"] if isinstance(node["enum"], list) else None
    return [node["const"]]


def _passing(root: Any, schema: dict[str, Any], members: list[Any]) -> list[Any]:
    """The members valid against ``schema`` (refs resolved against ``root``'s schema)."""
    try:
        validator = root.evolve(schema=schema)
        return [m for m in members if validator.is_valid(m)]
    except Exception as exc:  # bad patterns, unresolvable refs: no verdict
        raise _Undecided from exc


def _unsatisfiable(pointer: str, node: Any) -> InvalidGrammarError:
    others = sorted(
        k for k in node if k in VOCABULARY and k not in NOT_ASSERTING and k not in VALUES
    )
    which = "'enum'" if "enum" in node else "'const'"
    return InvalidGrammarError(
        "json_schema",
        f"the schema matches no value: no value of {which} satisfies the keywords next to it "
        f"({', '.join(others)})",
        pointer=pointer,
    )
