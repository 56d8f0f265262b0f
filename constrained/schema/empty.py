"""Find the JSON schemas that no finite JSON value satisfies, past a grammar's start state.

``productive.py`` asks a compiled grammar's matcher at its start state. A schema such as
``{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}`` passes that (``{``
is allowed), yet every output must nest forever: generation can only stop at ``max_tokens``. Here
the prepared schema (every ``$ref`` a ``#/$defs/<name>``, ``constrained/refs.py``) is read as a
least fixpoint: a subschema is *productive* when a finite value may satisfy it, given which of
its subschemas are productive. Each subschema's test over-approximates (a keyword it does not
read counts as satisfiable), so a schema found unproductive has no finite instance at all: a
refusal is never wrong; an empty schema it cannot see (``minLength`` above ``maxLength``, a
``not`` of everything) is left to the backends.

Read: ``false``; ``$ref`` to ``#`` or ``#/$defs/...``; ``allOf`` (every member), ``anyOf`` /
``oneOf`` (some member); ``enum: []``; ``type``; for objects, each ``required`` name through
``properties``, or through ``additionalProperties`` when no ``patternProperties`` may apply,
and ``minProperties`` against the keys ``properties`` and finite ``patternProperties`` can make
when ``additionalProperties`` is ``false``;
for arrays, the first ``minItems`` items through ``prefixItems`` / ``items`` (older drafts:
an ``items`` list and ``additionalItems``), and ``contains`` unless ``minContains`` is 0.
"""

from __future__ import annotations

from typing import Any

from espalier.constrained.schema.walk import escape_pointer_token, walk

SCALARS = frozenset({"string", "number", "integer", "boolean", "null"})


def unproductive_pointer(schema: dict[str, Any] | bool) -> str | None:
    """None when the root may have a finite instance; else the JSON pointer of the first
    subschema that every value of the root must satisfy and no finite value satisfies (``""``:
    the root itself).

    ``schema``: a prepared schema (refs resolved to ``#/$defs/<name>``; other refs count as
    satisfiable). Each round is linear in the schema's size; at most one round per subschema.
    """
    if isinstance(schema, bool):
        return None if schema else ""
    fixpoint = _Fixpoint(schema)
    if "" in fixpoint.productive:
        return None
    return fixpoint.blame()


class _Fixpoint:
    """The productive subschemas of one schema, by JSON pointer (least fixpoint)."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.nodes = {node.pointer: node.schema for node in walk(schema)}
        self.inherited = self._inherited_types()
        self.productive: set[str] = set()
        changed = True
        while changed:
            changed = False
            for at, node in self.nodes.items():
                if at not in self.productive and all(ok for _, ok in self.checks(node, at)):
                    self.productive.add(at)
                    changed = True

    def _inherited_types(self) -> dict[str, Any]:
        """The ``type`` an ``allOf`` / ``anyOf`` / ``oneOf`` member without one takes from the
        node holding it (transitively): a value must satisfy both, so only the holder's types
        can satisfy the member there. (SMG's tool calls are ``{"type": "object", "anyOf":
        [{"properties": ..., "required": [...]}]}``: read alone, a member is satisfied by any
        non-object.) Members are never ``$ref`` targets, so the member is read only there."""
        inherited: dict[str, Any] = {}
        for at, node in self.nodes.items():  # walk order: a holder before its members
            head, _, index = at.rpartition("/")
            holder_at, _, key = head.rpartition("/")
            if key not in ("allOf", "anyOf", "oneOf") or not index.isdigit():
                continue
            if not isinstance(node, dict) or "type" in node:
                continue
            holder = self.nodes.get(holder_at)
            if isinstance(holder, dict):
                kind = holder.get("type", inherited.get(holder_at))
                if kind is not None:
                    inherited[at] = kind
        return inherited

    def holds(self, sub: Any, at: str) -> bool:
        """Whether the subschema ``sub`` at ``at`` may have a finite instance (so far)."""
        if isinstance(sub, bool):
            return sub
        if isinstance(sub, dict):
            return at in self.productive
        return True  # not a schema (an invalid one is refused elsewhere): read nothing into it

    def checks(self, node: Any, at: str) -> list[tuple[str, bool]]:
        """``(pointer to blame, holds)`` for each necessary condition of ``node`` read here."""
        if isinstance(node, bool):
            return [(at, node)]
        out: list[tuple[str, bool]] = []
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/$defs/")):
            target = ref[1:]
            if target in self.nodes:
                out.append((target, self.holds(self.nodes[target], target)))
        for key, need_all in (("allOf", True), ("anyOf", False), ("oneOf", False)):
            members = node.get(key)
            if isinstance(members, list) and members:
                held = [self.holds(m, f"{at}/{key}/{i}") for i, m in enumerate(members)]
                failing = f"{at}/{key}/{held.index(False)}" if False in held else at
                out.append((failing if need_all else at, all(held) if need_all else any(held)))
        out.append(self.types(node, at))
        return out

    def types(self, node: dict[str, Any], at: str) -> tuple[str, bool]:
        """Whether a value of one of the allowed types may satisfy ``node``, and whom to blame."""
        if isinstance(node.get("enum"), list) and not node["enum"]:
            return at, False
        if "enum" in node or "const" in node:
            return at, True  # a listed value: finite
        kind = node.get("type", self.inherited.get(at))
        types = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else None
        if types is None or types & SCALARS:
            return at, True
        failing = [self.object_fails(node, at) if "object" in types else at]
        failing.append(self.array_fails(node, at) if "array" in types else at)
        if None in failing:
            return at, True
        blamed = [p for p in failing if p is not None and p != at]
        return (blamed[0] if len(blamed) == 1 else at), False

    def object_fails(self, node: dict[str, Any], at: str) -> str | None:
        """The pointer of a required property's schema with no finite value, or None (``at``
        itself: ``minProperties`` asks for more keys than the object's names can make)."""
        least = node.get("minProperties")
        if isinstance(least, int) and least > 0 and most_keys(node, least) is not None:
            return at
        required = node.get("required")
        properties = node.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        for name in required if isinstance(required, list) else ():
            if not isinstance(name, str):
                continue
            if name in properties:
                child = f"{at}/properties/{escape_pointer_token(name)}"
                if not self.holds(properties[name], child):
                    return child
            elif "patternProperties" not in node:
                extra = node.get("additionalProperties", True)
                if not self.holds(extra, f"{at}/additionalProperties"):
                    return f"{at}/additionalProperties"
        return None

    def array_fails(self, node: dict[str, Any], at: str) -> str | None:
        """The pointer of a required item's schema with no finite value, or None."""
        items = node.get("items", True)
        if isinstance(items, list):  # older drafts: a tuple, then additionalItems
            prefix, prefix_at = items, f"{at}/items"
            rest, rest_at = node.get("additionalItems", True), f"{at}/additionalItems"
        else:
            prefix = node.get("prefixItems", [])
            prefix = prefix if isinstance(prefix, list) else []
            prefix_at, rest, rest_at = f"{at}/prefixItems", items, f"{at}/items"
        least = node.get("minItems", 0)
        least = least if isinstance(least, int) else 0
        for i, sub in enumerate(prefix[:least]):
            if not self.holds(sub, f"{prefix_at}/{i}"):
                return f"{prefix_at}/{i}"
        if least > len(prefix) and not self.holds(rest, rest_at):
            return rest_at
        contains, wanted = node.get("contains"), node.get("minContains", 1)
        if contains is not None and wanted != 0 and not self.holds(contains, f"{at}/contains"):
            return f"{at}/contains"
        return None

    def blame(self) -> str:
        """The root's first failing condition below it (a required property, an item, a member,
        a ref target), or ``""`` when the root fails on its own keywords."""
        failing = [p for p, ok in self.checks(self.nodes[""], "") if not ok and p != ""]
        return failing[0] if failing else ""


def most_keys(node: dict[str, Any], least: int) -> int | None:
    """How many distinct keys an object of ``node`` may hold, when that is fewer than
    ``least``; None otherwise (more, unbounded, or patterns not read). Keys come only from
    ``properties`` and the (finite) ``patternProperties`` languages once
    ``additionalProperties`` is ``false``; overlaps are counted twice (an over-count: never a
    wrong refusal)."""
    from espalier.constrained.schema.regular import pattern_word_count

    if node.get("additionalProperties", True) is not False:
        return None
    names = node.get("properties")
    total = len(names) if isinstance(names, dict) else 0
    patterns = node.get("patternProperties")
    for pattern in patterns if isinstance(patterns, dict) else ():
        words = pattern_word_count(pattern, least)
        if words is None:
            return None
        total += words
    return total if total < least else None
