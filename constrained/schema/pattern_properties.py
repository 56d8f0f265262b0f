"""Overlapping ``patternProperties`` made disjoint where no regex reasoning is needed.

llguidance refuses ``patternProperties`` whose regexes may match a common name ("not
disjoint"). Two kinds of regex need no intersection to take apart:

- a regex matching *every* name (``.*``, ``^.*``, ``""``: a pattern is searched, and these
  match the empty prefix): its schema ``U`` applies to every property, so it joins each
  ``properties`` entry and each other pattern's schema (``allOf``), and becomes
  ``additionalProperties`` (which it made dead: no name was left over for it);
- a regex matching *one* name (``^MD5$``, ``^a\\.b$``: anchored, no operator): that name moves
  to ``properties`` with the pattern's schema (``allOf`` with its entry there, if any). A listed
  name still takes the schemas of the other patterns it matches, exactly as before.

Each keeps the valid instances the same (JSON Schema applies every matching pattern and the
``properties`` entry to a name; ``additionalProperties`` only to names none of them matches).
Regexes of other shapes are left as they are.

:func:`finite_names`: in an object with ``additionalProperties: false`` whose patterns match
few names in all (``propertyNames: {pattern: "^[a-c]$"}`` becomes such an object), every name
becomes a declared property. A backend never repeats a declared property, where a free key
goes through the duplicate-key tracker, which looks one token ahead only: with the names
``"a"`` and ``"b"`` written, ``"b`` was a dead end and the request failed (a held-out sweep, 500
through the OpenAI API at temperature 0).
"""

from __future__ import annotations

import re
from typing import Any

# searched, each matches the empty string at position 0: so every name
_UNIVERSAL = frozenset({"", "^", ".*", "^.*", ".*?", "^.*?", "[\\s\\S]*", "^[\\s\\S]*"})
_LITERAL = re.compile(r"\^((?:[^\\^$.|?*+()\[\]{}]|\\[\\^$.|?*+()\[\]{}/-])*)\$")


def rewrite_pattern_properties(node: dict[str, Any]) -> dict[str, Any]:
    """``node`` with universal and single-name patterns taken out as above, or unchanged."""
    patterns = node.get("patternProperties")
    listed = node.get("properties", {})
    if not isinstance(patterns, dict) or len(patterns) < 2 or not isinstance(listed, dict):
        return node
    universal = [p for p in patterns if p in _UNIVERSAL]
    literal = {p: _literal(p) for p in patterns if p not in _UNIVERSAL}
    singles = {p: name for p, name in literal.items() if name is not None}
    if not universal and not singles:
        return node
    out = dict(node)
    kept = {p: s for p, s in patterns.items() if p not in universal and p not in singles}
    listed = dict(listed)
    for pattern, name in singles.items():
        listed[name] = (
            _both(listed[name], patterns[pattern]) if name in listed else patterns[pattern]
        )
    if universal:
        every = _all([patterns[p] for p in universal])
        listed = {name: _both(schema, every) for name, schema in listed.items()}
        kept = {p: _both(s, every) for p, s in kept.items()}
        out["additionalProperties"] = every
    if listed:
        out["properties"] = listed
    if kept:
        out["patternProperties"] = kept
    else:
        out.pop("patternProperties")
    return out


def _literal(pattern: str) -> str | None:
    """The one name ``pattern`` matches, or None when it may match others."""
    match = _LITERAL.fullmatch(pattern)
    if match is None:
        return None
    return re.sub(r"\\(.)", r"\1", match.group(1))


def _both(a: Any, b: Any) -> Any:
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    return {"allOf": [a, b]}


def _all(schemas: list[Any]) -> Any:
    out: Any = True
    for schema in schemas:
        out = _both(out, schema)
    return out


FINITE_NAMES = 64
"""Names listed at most (all patterns of one object): past it, the patterns stay."""


def finite_names(node: dict[str, Any]) -> dict[str, Any]:
    """``node`` with its ``patternProperties`` listed as ``properties`` (module docstring) when
    ``additionalProperties`` is false and the patterns match fewer than :data:`FINITE_NAMES`
    names in all (a name's schema: every pattern's that matches it, under ``regex.search`` as
    the post-validator reads it, and its own ``properties`` entry); else ``node``.
    The names are those both readings of the classes take (``regular.pattern_words``); a name
    that needs escapes (``"``, ``\\``, control characters) is declared as any other (the
    backends write a declared name escaped)."""
    patterns = node.get("patternProperties")
    listed = node.get("properties", {})
    if node.get("additionalProperties") is not False or not isinstance(patterns, dict):
        return node
    if not patterns or not isinstance(listed, dict):
        return node
    from espalier.constrained.postvalidate import pattern_search
    from espalier.constrained.schema.regular import pattern_words

    names: set[str] = set()
    for pattern in patterns:
        words = pattern_words(pattern, FINITE_NAMES) if isinstance(pattern, str) else None
        if words is None or len(names | set(words)) >= FINITE_NAMES:
            return node
        names |= set(words)
    properties = dict(listed)
    for name in sorted(names - set(listed)):
        properties[name] = True
    for name in list(properties):
        matched = [pattern_search(pattern, name) for pattern in patterns]
        if None in matched:  # a pattern that backtracks past its time limit
            return node
        schemas = [patterns[p] for p, found in zip(patterns, matched) if found]
        properties[name] = _all([properties[name], *schemas])
    out = {k: v for k, v in node.items() if k != "patternProperties"}
    out["properties"] = properties
    return out
