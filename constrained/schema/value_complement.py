"""The complement of a finite set of scalar values (``enum`` / ``const``) as a schema.

Every JSON value outside the set, per type: a type with no member stays whole; ``null`` with a
member is gone; booleans keep the other one; numbers keep the open intervals between the sorted
members (``1`` and ``1.0`` are one number, as in JSON Schema); strings keep a ``pattern`` of the
regular language "every string but these", spelled from the members' trie (linear in their total
length). Arrays or objects among the members: no complement here (None).
"""

from __future__ import annotations

import itertools
from typing import Any

ALL_TYPES = ("null", "boolean", "object", "array", "number", "string")
MAX_TOTAL_CHARS = 4000  # of the string members: the pattern grows with the trie
MAX_MEMBER_CHARS = 256  # the trie is spelled recursively, one level per character


def values_complement(values: list[Any]) -> Any:
    """A schema matching exactly the JSON values not equal to a member; None when unknown."""
    by_type: dict[str, list[Any]] = {}
    for value in values:
        kind = _scalar_type(value)
        if kind is None:
            return None
        by_type.setdefault(kind, []).append(value)
    strings = by_type.get("string", [])
    if sum(len(s) for s in strings) > MAX_TOTAL_CHARS:
        return None
    if any(len(s) > MAX_MEMBER_CHARS for s in strings):
        return None
    parts: list[Any] = []
    free = [t for t in ALL_TYPES if t not in by_type]
    if free:
        parts.append({"type": free[0] if len(free) == 1 else free})
    booleans = set(by_type.get("boolean", []))
    if len(booleans) == 1:
        parts.append({"const": not booleans.pop()})
    parts.extend(_number_gaps(by_type.get("number", [])))
    if strings:
        parts.append({"type": "string", "pattern": f"^{_all_but(sorted(set(strings)))}$"})
    if not parts:
        return False
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


def json_type(value: Any) -> str:
    """The JSON type name of a decoded JSON value (integers are "number")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _scalar_type(value: Any) -> str | None:
    kind = json_type(value)
    return None if kind in ("array", "object") else kind


def _number_gaps(numbers: list[Any]) -> list[dict[str, Any]]:
    if not numbers:
        return []
    ordered = sorted(set(numbers))  # 1 == 1.0: one member
    gaps: list[dict[str, Any]] = [{"type": "number", "exclusiveMaximum": ordered[0]}]
    for low, high in itertools.pairwise(ordered):
        gaps.append({"type": "number", "exclusiveMinimum": low, "exclusiveMaximum": high})
    gaps.append({"type": "number", "exclusiveMinimum": ordered[-1]})
    return gaps


def _all_but(members: list[str], depth: int = 0) -> str:
    """A regex (no anchors) for every string except ``members`` (which share a prefix of
    ``depth`` characters, already matched). A run of characters every member goes on with is
    spelled flat (stop before its character ``i`` and maybe leave it there, or take it all),
    one group level per branching: Rust's regex parser (llguidance) has a nesting limit."""
    chain = _shared_run(members, depth)
    if len(chain) > 1:
        options = [
            "".join(map(_literal, chain[:i])) + f"(?:[^{_class_char(char)}][\\s\\S]*)?"
            for i, char in enumerate(chain)
        ]
        after = _all_but(members, depth + len(chain))
        options.append("".join(map(_literal, chain)) + f"(?:{after})")
        return "(?:" + "|".join(options) + ")"
    ends_here = any(len(m) == depth for m in members)
    nexts = sorted({m[depth] for m in members if len(m) > depth})
    other = "".join(_class_char(c) for c in nexts)
    options = [f"[^{other}][\\s\\S]*" if other else "[\\s\\S]+"]
    for char in nexts:
        rest = [m for m in members if len(m) > depth and m[depth] == char]
        options.append(f"{_literal(char)}(?:{_all_but(rest, depth + 1)})")
    body = "|".join(options)
    # the prefix itself is a string outside the set unless it is a member
    return body if ends_here else f"(?:{body})?"


def _shared_run(members: list[str], depth: int) -> str:
    """The characters from ``depth`` on that every member has, none ending within them."""
    run: list[str] = []
    while all(len(m) > depth + len(run) for m in members):
        nexts = {m[depth + len(run)] for m in members}
        if len(nexts) != 1:
            break
        run.append(nexts.pop())
    return "".join(run)


def _literal(char: str) -> str:
    """``char`` as a regex atom that every engine reads the same way."""
    return char if char.isalnum() and char.isascii() else f"[{_class_char(char)}]"


def _class_char(char: str) -> str:
    """``char`` spelled for inside ``[...]``."""
    if char in "\\]^-[":
        return "\\" + char
    if not char.isprintable():
        return f"\\u{ord(char):04x}" if ord(char) < 0x10000 else char
    return char
