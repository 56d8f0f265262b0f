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

from typing import Any

from espalier.constrained.schema.logic import ALL_TYPES, append_all_of, without
from espalier.constrained.schema.pattern_parse import has_inner_anchor
from espalier.constrained.schema.regular import intersect_patterns

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
        kept: list[tuple[str, Any]] = []
        for name, sub in named.items():
            printed = intersect_patterns((name,)) if read_otherwise(name) else name
            if printed is not False:  # False: matches no property name, constrains nothing
                kept.append((printed if isinstance(printed, str) else name, sub))
        if len(dict(kept)) == len(kept):  # no two names respelled alike
            out = {**out, "patternProperties": dict(kept)}
    return out


def read_otherwise(pattern: str) -> bool:
    """Whether ``pattern`` holds a lookaround, ``\\<`` / ``\\>`` or an anchor inside (not at
    the ends of the pattern or of its top-level branches: ``^b$|c`` is read alike)."""
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
