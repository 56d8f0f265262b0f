"""``propertyNames`` as ``properties`` / ``patternProperties`` / ``additionalProperties: false``.

A property-name schema that says one thing about the name — a ``pattern``, length bounds, or a
finite list of names (``const`` / ``enum``) — is the regular language of a regex ``R`` (search
semantics, as ``patternProperties`` matches). In an object with no ``patternProperties`` and no
``additionalProperties`` (other than ``true``), ``propertyNames: N`` then equals: each listed
property whose name fails ``N`` becomes ``false``, ``patternProperties: {R: true}`` admits the other
names that pass, ``additionalProperties: false`` refuses the rest. A finite list of names needs no
regex: the names join ``properties`` (``true`` where not listed). Anything else is left as it is.

With ``additionalProperties: S`` (a schema other than ``true``) the names that pass take ``S``
instead of ``true`` (unlisted allowed names in ``properties``; ``patternProperties: {R: S}``) —
exact when no listed name passes ``R``, since ``patternProperties`` would also apply ``S`` to it,
or when ``S`` is ``false`` (then no ``patternProperties`` is needed).
Names are checked here with Python's ``re``, patterns as written: a pattern Python cannot compile
leaves the node alone.
"""

from __future__ import annotations

from typing import Any

NAME_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default"})


def rewrite_property_names(node: dict[str, Any]) -> dict[str, Any]:
    """``node`` without ``propertyNames`` when the rewrite above applies, else ``node``."""
    names = node.get("propertyNames")
    if not isinstance(names, dict) or "patternProperties" in node:
        return node
    other = node.get("additionalProperties", True)
    if not isinstance(other, (bool, dict)):
        return node
    language = _language(names)
    if language is None:
        return node
    listed = node.get("properties", {})
    if not isinstance(listed, dict):
        return node
    allowed, regex = language
    rest = {k: v for k, v in node.items() if k not in ("propertyNames", "additionalProperties")}
    if allowed is not None:  # a finite set of names
        properties = {n: listed.get(n, other) for n in allowed}
        properties.update({n: False for n in listed if n not in allowed})
        return {**rest, "properties": properties, "additionalProperties": False}
    assert regex is not None
    from espalier.constrained.postvalidate import pattern_search

    verdicts = {n: pattern_search(regex, n) for n in listed}
    if None in verdicts.values():  # a pattern that does not compile, or backtracks past its time
        return node
    passing = {n for n, found in verdicts.items() if found}
    if other is not True and other is not False and passing:
        return node  # patternProperties would apply ``other`` to a listed name too
    properties = {n: s if n in passing else False for n, s in listed.items()}
    out = {**rest, "additionalProperties": False}
    if other is not False:
        out["patternProperties"] = {regex: other}
    if properties:
        out["properties"] = properties
    return out


def _language(names: dict[str, Any]) -> tuple[list[str] | None, str | None] | None:
    """(finite names, None) or (None, regex) for what ``names`` admits; None when neither."""
    keys = set(names) - NAME_ANNOTATIONS
    kind = names.get("type", "string")
    if kind != "string" and not (isinstance(kind, list) and "string" in kind):
        return [], None  # no name is admitted (a name is always a string)
    keys.discard("type")
    if keys in ({"const"}, {"enum"}):
        values = [names["const"]] if "const" in names else names["enum"]
        if not isinstance(values, list):
            return None
        return list(dict.fromkeys(v for v in values if isinstance(v, str))), None
    if keys == {"pattern"} and isinstance(names["pattern"], str):
        return None, names["pattern"]
    if keys and keys <= {"minLength", "maxLength"}:
        low, high = names.get("minLength", 0), names.get("maxLength")
        if not _count(low) or (high is not None and not _count(high)):
            return None
        if high is not None and high < low:
            return [], None
        return None, f"^[\\s\\S]{{{low},{'' if high is None else high}}}$"
    return None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1000
