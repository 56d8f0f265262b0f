"""Patterns the backends read otherwise than the post-validator, printed back in the subset they
read alike.

A ``pattern`` (or a ``patternProperties`` name) means what ``regex.search`` makes of it (the
post-validator, :mod:`pattern_parse`). Some syntax the three backends refuse or read otherwise:
a lookahead (llguidance and outlines-core refuse it: "look-around ... is not supported"), an
anchor away from the ends of the pattern (``^(/?(a|b)($|/))*$``: llguidance calls ``$`` a
lookaround), ``\\<`` / ``\\>`` (Python: the characters ``<`` / ``>``; Rust's regex: word
boundaries). Where the pattern algebra (:mod:`regular`) reads such a pattern, its language is
printed back as one ``^(?:...)$`` of explicit classes (:func:`regular.intersect_patterns` of the
pattern alone), which every backend reads within it; otherwise the pattern stays as it is (and
the backend's error or the keyword profile refuses the schema, as before).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from espalier.constrained.schema.features import escape_class_misread
from espalier.constrained.schema.logic import ALL_TYPES, append_all_of, without
from espalier.constrained.schema.pattern_parse import has_inner_anchor
from espalier.constrained.schema.regular import intersect_patterns
from espalier.constrained.schema.walk import map_subschemas

_LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")


def respell_patterns(node: dict[str, Any]) -> dict[str, Any]:
    """``node`` with its ``pattern`` and ``patternProperties`` names respelled where needed:
    a pattern no string matches becomes "not a string", one every string matches is dropped."""
    out = node
    pattern = node.get("pattern")
    if isinstance(pattern, str) and read_otherwise(pattern):
        printed = intersect_patterns((pattern,))
        if isinstance(printed, str):
            out = {**out, "pattern": printed}
        elif printed is True:
            out = without(out, "pattern")
        elif printed is False:
            others = [t for t in ALL_TYPES if t != "string"]
            out = append_all_of(without(out, "pattern"), {"type": others})
    named = node.get("patternProperties")
    if isinstance(named, dict) and any(read_otherwise(p) for p in named):

        def respelled(name: str) -> str | None:  # None: matches no name, constrains nothing
            printed = intersect_patterns((name,)) if read_otherwise(name) else name
            return None if printed is False else printed if isinstance(printed, str) else name

        kept = _printed_names(named, respelled)
        if kept is not None:
            out = {**out, "patternProperties": kept}
    return out


def _printed_names(
    named: dict[str, Any], printer: Callable[[str], str | None]
) -> dict[str, Any] | None:
    """``patternProperties`` with each name replaced by ``printer(name)`` (None: the entry
    dropped); None when two names print alike (left as written)."""
    kept: dict[str, Any] = {}
    for name, sub in named.items():
        key = printer(name)
        if key is None:
            continue
        if key in kept:
            return None
        kept[key] = sub
    return kept


def read_otherwise(pattern: str) -> bool:
    """Whether ``pattern`` holds a lookaround, ``\\<`` / ``\\>``, a word boundary (``\\b``,
    ``\\B``), a backreference (``\\1``, ``(?P=name)``, ``\\k<name>``, ``\\g<name>``) or an
    anchor inside (not at the ends of the pattern or of its top-level branches: ``^b$|c`` is
    read alike). No backend takes the first ones (``^(a|b)\\1$``: "backreferences are not
    supported", ``\\b``: "Word boundary is not supported yet")."""
    if no_backend_compiles(pattern):
        return True
    found = _scan(pattern)
    return found is not None and (found or has_inner_anchor(pattern))


def _scan(pattern: str) -> bool | None:
    """True: a lookaround or ``\\<`` / ``\\>``; False: a ``^`` / ``$`` that is not the first /
    last character (outside classes and escapes), maybe inside; None: neither."""
    anchor: bool | None = None
    at, end = 0, len(pattern)
    while at < end:
        char = pattern[at]
        if char == "\\":
            if pattern[at + 1 : at + 2] in ("<", ">"):
                return True
            at += 2
        elif char == "[":
            at = class_end(pattern, at)
        else:
            if char == "(" and pattern.startswith(_LOOKAROUND, at):
                return True
            if (char == "^" and at > 0) or (char == "$" and at < end - 1):
                anchor = False
            at += 1
    return anchor


def respell_wider(node: dict[str, Any]) -> dict[str, Any]:
    """``node`` with a ``pattern`` the backends read wider (:func:`read_wider`, or llguidance's
    :func:`~espalier.constrained.schema.features.escape_class_misread`: ``^[^"]+$``, "no
    quotes", took ``\\"``) printed from the algebra, where it can be; else ``node``. The last
    pass of ``normalize_schema``: only a pattern the backends read is narrowed (one a ``not``
    complements is taken as written, or narrowing it would widen the complement), and
    ``patternProperties`` names only beside ``additionalProperties: false``
    (:func:`_narrowed_names`). The printed pattern also leaves out control characters,
    so that no class of it holds U+0000 and U+001F (what llguidance misreads)."""
    out = _narrowed_names(node)
    pattern = out.get("pattern")
    if not isinstance(pattern, str) or not _narrowed(pattern):
        return out
    # without control characters: ``\\s`` printed as ``[\\t-\\r ]`` is ignored by xgrammar
    # (it reads a pattern against the escaped JSON text), where the pattern as written compiled
    printed = intersect_patterns((pattern,), controls=False)
    return {**out, "pattern": printed} if isinstance(printed, str) else out


def _narrowed(pattern: str) -> bool:
    """Whether :func:`respell_wider` prints ``pattern`` from the algebra."""
    if read_otherwise(pattern):
        return False
    return read_wider(pattern) or escape_class_misread(pattern)


def _narrowed_names(node: dict[str, Any]) -> dict[str, Any]:
    """``node``'s ``patternProperties`` names printed as :func:`respell_wider` prints a
    pattern, where ``additionalProperties`` is ``false`` (a name the printed pattern misses is
    then refused, as its control characters make it unlikely; beside any other
    ``additionalProperties`` it would be taken by that schema instead). ``propertyNames``
    patterns become such names (``^[^"]+$``, "no quotes", was weakened on llguidance)."""
    named = node.get("patternProperties")
    if node.get("additionalProperties") is not False or not isinstance(named, dict):
        return node
    if not any(_narrowed(name) for name in named):
        return node

    def narrowed(name: str) -> str:
        printed = intersect_patterns((name,), controls=False) if _narrowed(name) else name
        return printed if isinstance(printed, str) else name

    kept = _printed_names(named, narrowed)
    return node if kept is None else {**node, "patternProperties": kept}


def read_wider(pattern: str) -> bool:
    """Whether ``pattern`` holds a class shorthand the backends read wider than what both
    readings of it agree on (``regular.BOTH_READINGS``): ``\\W``, ``\\D``, ``\\S`` (ECMA-262
    and Rust call non-ASCII letters and digits ``\\W`` / ``\\D``, Python does not), ``\\s``
    (Rust and Python take U+0085, ECMA-262 does not), or ``\\w`` / ``\\d`` in a negated class.
    :func:`respell_wider` prints such a pattern from the algebra where it can; where it
    cannot, the pattern stays (the post-validator reports what it lets through)."""
    at, end = 0, len(pattern)
    while at < end:
        char = pattern[at]
        if char == "\\":
            if pattern[at + 1 : at + 2] in ("W", "D", "S", "s"):
                return True
            at += 2
        elif char == "[":
            stop = class_end(pattern, at)
            inside = pattern[at:stop].replace("\\\\", "")
            pairs = (("\\s", "\\S"), ("\\w", "\\W"), ("\\d", "\\D"))
            if any(a in inside and b in inside for a, b in pairs):  # [\s\S]: any character
                at = stop
                continue
            negated = inside.startswith("[^")
            for shorthand in ("\\W", "\\D", "\\S", "\\s") + (("\\w", "\\d") if negated else ()):
                if shorthand in inside:
                    return True
            at = stop
        else:
            at += 1
    return False


def no_backend_compiles(pattern: str) -> bool:
    """Whether ``pattern`` holds a word boundary (``\\b``, ``\\B``) or a backreference
    (``\\1``, ``(?P=name)``, ``\\k<name>``, ``\\g<name>``) outside classes: every backend
    fails its compile ("backreferences are not supported", "Word boundary is not supported
    yet"), so ``allow_weakening`` drops such a pattern."""
    at, end = 0, len(pattern)
    while at < end:
        char = pattern[at]
        if char == "\\":
            if _uncompilable_escape(pattern, at):
                return True
            at += 2
        elif char == "[":
            at = class_end(pattern, at)
        else:
            if pattern.startswith("(?P=", at):
                return True
            at += 1
    return False


def _uncompilable_escape(pattern: str, at: int) -> bool:
    after = pattern[at + 1 : at + 2]
    if after in ("b", "B") or (after.isdigit() and after != "0"):
        return True
    return after in ("k", "g") and pattern[at + 2 : at + 3] == "<"


def class_end(pattern: str, at: int) -> int:
    """Past the ``[...]`` starting at ``at`` (a first ``]`` is literal; escapes skipped)."""
    at += 1
    if pattern[at : at + 1] == "^":
        at += 1
    if pattern[at : at + 1] == "]":
        at += 1
    while at < len(pattern) and pattern[at] != "]":
        at += 2 if pattern[at] == "\\" else 1
    return at + 1


def with_open_ends(pattern: str) -> str | None:
    """``pattern`` anchored at both ends with ``.*`` for each open end of its top-level
    branches (``a|^b`` -> ``^(?:.*(?:a).*|(?:b).*)$``): the strings ``regex.search`` finds it
    in (those without a newline, which such a backend never writes raw in a JSON string),
    spelled for a backend that reads every pattern as a full match (xgrammar). None: anchored
    everywhere already, or not read here (an anchor inside a group or away from a branch's
    ends, ``\\A`` / ``\\Z``, a leading flag group): left as it is, which such a backend
    reads as a narrower language, never a wider one."""
    if pattern.startswith("(?") and not pattern.startswith(("(?:", "(?P", "(?<", "(?=", "(?!")):
        return None
    branches: list[str] = []
    depth, start, at, end = 0, 0, 0, len(pattern)
    anchors: list[int] = []
    while at < end:
        char = pattern[at]
        if char == "\\":
            if pattern[at + 1 : at + 2] in ("A", "Z", "z"):
                return None
            at += 2
            continue
        if char == "[":
            at = class_end(pattern, at)
            continue
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char in "^$":
            if depth:
                return None
            anchors.append(at)
        elif char == "|" and depth == 0:
            branches.append(pattern[start:at])
            start = at + 1
        at += 1
    branches.append(pattern[start:])
    out: list[str] = []
    opened = False
    begin = 0
    for branch in branches:
        stop = begin + len(branch)
        mine = [a for a in anchors if begin <= a < stop]
        head = bool(mine) and mine[0] == begin and pattern[begin] == "^"
        tail = bool(mine) and mine[-1] == stop - 1 and pattern[stop - 1] == "$"
        if len(mine) > head + tail or (head and tail and len(mine) == 1):
            return None  # an anchor away from the ends (or one "^" or "$" read as both)
        body = pattern[begin + head : stop - tail]
        begin = stop + 1
        opened = opened or not (head and tail)
        ends = ("" if head else ".*", "" if tail else ".*")
        out.append(f"{ends[0]}(?:{body}){ends[1]}" if body else ends[0] or ends[1])
    return f"^(?:{'|'.join(out)})$" if opened else None


def open_pattern_ends(schema: Any, pointer: str = "") -> Any:
    """``schema`` with every ``pattern`` and ``patternProperties`` name spelled by
    :func:`with_open_ends` (for a backend that reads patterns as full matches); shares the
    parts it leaves alone."""
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, pointer, open_pattern_ends)
    pattern = out.get("pattern")
    if isinstance(pattern, str) and (spelled := with_open_ends(pattern)) is not None:
        out["pattern"] = spelled
    named = out.get("patternProperties")
    if isinstance(named, dict):
        spelled_named = {with_open_ends(n) or n: sub for n, sub in named.items()}
        if len(spelled_named) == len(named):  # no two names spelled alike
            out["patternProperties"] = spelled_named
    return out
