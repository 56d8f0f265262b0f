"""What the first characters of a string must be, read from ``pattern`` / ``format``.

:func:`string_prefix` gives, for a schema object, one set of allowed characters per leading
position that every matching *string* must have (an anchored ``pattern``'s leading literals and
simple classes; a ``uuid``'s first character). :func:`strings_disjoint` says two schemas match no
common string when at some position their sets share no character. Reading stops at anything
else (``(``, ``|``, ``.``, class escapes such as ``\\d``, a quantifier making the atom optional),
so the sets are always supersets of the truth: a "disjoint" answer is never wrong.
"""

from __future__ import annotations

from typing import Any

_HEX = frozenset("0123456789abcdefABCDEF")
# jsonschema's uuid checker: UUID(text) with dashes at 8, 13, 18, 23; UUID() strips "urn:",
# "uuid:" and braces first, so the first character is a hex digit, "u" or "{"
FORMAT_FIRST = {"uuid": _HEX | {"u", "{"}}
_STOP = set(".()*+?{}|$^")


def string_prefix(schema: Any) -> list[frozenset[str]]:
    """Allowed characters at each leading position of a string ``schema`` matches ([] if none
    known). ``schema`` is one schema object; only its own ``pattern`` and ``format`` are read."""
    if not isinstance(schema, dict):
        return []
    pattern = schema.get("pattern")
    out = _pattern_prefix(pattern) if isinstance(pattern, str) else []
    first = FORMAT_FIRST.get(schema.get("format", ""))
    if first is not None:
        out = [out[0] & first, *out[1:]] if out else [first]
    return out


def strings_disjoint(a: Any, b: Any) -> bool:
    """True only when no string matches both ``a`` and ``b`` (by :func:`string_prefix`)."""
    return any(not x & y for x, y in zip(string_prefix(a), string_prefix(b), strict=False))


def _pattern_prefix(pattern: str) -> list[frozenset[str]]:
    if not pattern.startswith("^") or _has_top_level_bar(pattern):
        return []
    out: list[frozenset[str]] = []
    i = 1
    while i < len(pattern):
        atom, end = _atom(pattern, i)
        if atom is None:
            break
        follow = pattern[end : end + 1]
        if follow in ("?", "*", "{"):
            break  # the atom may be absent or repeated: later positions unknown
        out.append(atom)
        if follow == "+":
            break
        i = end
    return out


def _atom(pattern: str, i: int) -> tuple[frozenset[str] | None, int]:
    """The character set of the atom at ``i`` and where it ends; None when not a plain one."""
    char = pattern[i]
    if char == "\\":
        nxt = pattern[i + 1 : i + 2]
        return (frozenset(nxt), i + 2) if nxt and not nxt.isalnum() else (None, i)
    if char == "[":
        return _class(pattern, i)
    if char in _STOP:
        return None, i
    return frozenset(char), i + 1


def _class(pattern: str, i: int) -> tuple[frozenset[str] | None, int]:
    """A ``[...]`` of literal characters and ``a-z`` ranges (no negation, no escapes)."""
    end = pattern.find("]", i + 1)
    body = pattern[i + 1 : end] if end > i + 1 else ""
    if not body or body[0] == "^" or "\\" in body or "[" in body:
        return None, i
    chars: set[str] = set()
    j = 0
    while j < len(body):
        if j + 2 < len(body) and body[j + 1] == "-":
            low, high = ord(body[j]), ord(body[j + 2])
            if high < low or high - low > 0x3000:
                return None, i
            chars.update(chr(c) for c in range(low, high + 1))
            j += 3
        else:
            chars.add(body[j])
            j += 1
    return frozenset(chars), end + 1


def _has_top_level_bar(pattern: str) -> bool:
    """Whether ``|`` appears outside groups and classes (``^`` then anchors one branch only)."""
    depth, i, in_class = 0, 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            if pattern[i + 1 : i + 2] == "]":
                i += 1  # a "]" first in a class is literal
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "|" and depth == 0:
            return True
        i += 1
    return False
