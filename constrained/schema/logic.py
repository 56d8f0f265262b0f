"""Reasoning about schemas as sets of instances: types, values, complements.

Used by :mod:`rewrite` to express ``not``, ``if/then/else`` and ``oneOf`` with keywords the
backends enforce (a ``pattern``'s complement comes from :mod:`regular`; disjointness is
:mod:`disjoint`). Every function is exact or gives up (returns None / False): a schema built here
matches exactly the instances its docstring says. ``defs`` is the root ``$defs`` after
:func:`refs.resolve_refs`, so ``{"$ref": "#/$defs/<name>"}`` can be looked through.
"""

from __future__ import annotations

import json
import math
from typing import Any

from espalier.constrained.schema.features import ANNOTATIONS, VOCABULARY
from espalier.constrained.schema.regular import complement_pattern
from espalier.constrained.schema.value_complement import json_type, values_complement

ALL_TYPES = ("null", "boolean", "object", "array", "number", "string")
DEFS_PREFIX = "#/$defs/"
MAX_DEPTH = 8  # how deep complements and type inference follow refs and nesting
MAX_LENGTH_FLOOR = 3  # the most of a sibling minLength a pattern's complement is cut to
BOUND_COMPLEMENT = {
    "minimum": ("number", "exclusiveMaximum"),
    "exclusiveMinimum": ("number", "maximum"),
    "maximum": ("number", "exclusiveMinimum"),
    "exclusiveMaximum": ("number", "minimum"),
}
COUNT_COMPLEMENT = {
    "minLength": ("string", "maxLength", -1),
    "maxLength": ("string", "minLength", 1),
    "minItems": ("array", "maxItems", -1),
    "maxItems": ("array", "minItems", 1),
    "minProperties": ("object", "maxProperties", -1),
    "maxProperties": ("object", "minProperties", 1),
}
NO_CONSTRAINT = frozenset(
    {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
     "writeOnly", "contentMediaType", "contentEncoding", "contentSchema", "$defs", "definitions"}
)  # fmt: skip
Defs = dict[str, Any]


def deref(schema: Any, defs: Defs) -> Any:
    """Follow a lone ``{"$ref": "#/$defs/x"}`` to its target (up to MAX_DEPTH hops)."""
    depth = 0
    while (
        isinstance(schema, dict)
        and set(schema) == {"$ref"}
        and isinstance(schema["$ref"], str)
        and schema["$ref"].startswith(DEFS_PREFIX)
        and depth < MAX_DEPTH
    ):
        schema = defs.get(schema["$ref"][len(DEFS_PREFIX) :], schema)
        depth += 1
    return schema


def types_of(branch: Any, defs: Defs) -> set[str] | None:
    """The JSON types ``branch`` can match ("integer" counted as "number"); None when unknown."""
    branch = deref(branch, defs)
    if not isinstance(branch, dict):
        return set(ALL_TYPES) if branch else set()
    if "const" in branch:
        return {json_type(branch["const"])}
    if isinstance(branch.get("enum"), list):
        return {json_type(v) for v in branch["enum"]}
    value = branch.get("type")
    names = [value] if isinstance(value, str) else value if isinstance(value, list) else None
    if names is None:
        return None
    return {"number" if t == "integer" else t for t in names}


def canonical(value: Any) -> str:
    """Canonical JSON text where equal JSON values (1 and 1.0) give equal text."""

    def norm(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v

    return json.dumps(norm(value), sort_keys=True)


def values_of(branch: Any, defs: Defs) -> set[str] | None:
    """Canonical texts of the only values ``branch`` allows (const / enum); None if unbounded."""
    branch = deref(branch, defs)
    if not isinstance(branch, dict):
        return None if branch else set()
    if "const" in branch:
        return {canonical(branch["const"])}
    if isinstance(branch.get("enum"), list):
        return {canonical(v) for v in branch["enum"]}
    return None


def key_set(schema: Any, defs: Defs, depth: int = 0) -> frozenset[str] | None:
    """A finite set holding every property name an object matching ``schema`` can have (a
    superset is fine); None when the names are open. From ``additionalProperties: false``
    without ``patternProperties``, through ``allOf`` and every-branch ``anyOf`` / ``oneOf``."""
    schema = deref(schema, defs)
    if schema is False:
        return frozenset()
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return None
    keys: frozenset[str] | None = None
    listed = schema.get("properties", {})
    if (
        schema.get("additionalProperties") is False
        and not schema.get("patternProperties")
        and isinstance(listed, dict)
    ):
        keys = frozenset(listed)
    for sub in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
        keys = meet(keys, key_set(sub, defs, depth + 1))
    for union in ("anyOf", "oneOf"):
        branches = schema.get(union)
        if isinstance(branches, list) and branches:
            sets = [key_set(b, defs, depth + 1) for b in branches]
            if all(k is not None for k in sets):
                keys = meet(keys, frozenset().union(*(k for k in sets if k is not None)))
    return keys


def meet(a: frozenset[str] | None, b: frozenset[str] | None) -> frozenset[str] | None:
    return b if a is None else a if b is None else a & b


def complement(
    schema: Any,
    defs: Defs,
    depth: int = 0,
    keys: frozenset[str] | None = None,
    min_length: int = 0,
) -> Any:
    """A schema matching exactly the instances ``schema`` rejects; None when not expressible.

    A schema object is the conjunction of its keywords, so its complement is the ``anyOf`` of the
    keywords' complements; each keyword handled here constrains independently of the others.
    ``keys``: the instances in question are known to have property names in this finite set
    only (when objects); then ``additionalProperties`` / ``patternProperties`` have a
    complement: one of those names present with a value they reject. Keywords of no JSON Schema
    vocabulary constrain nothing. ``min_length``: the instances in question are known to be
    at least that long when strings (a sibling ``minLength``); a ``pattern``'s complement is
    then exact on those strings only.
    """
    schema = deref(schema, defs)
    if isinstance(schema, bool):
        return not schema
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return None
    parts: list[Any] = []
    for key, value in schema.items():
        if key in NO_CONSTRAINT or key not in VOCABULARY:
            continue
        if key in ("additionalProperties", "patternProperties"):
            part = _open_complement(key, schema, defs, depth + 1, keys)
        elif key == "properties" and isinstance(value, dict) and keys is not None:
            # a name outside ``keys`` is never present: its subschema cannot be violated
            kept = {name: sub for name, sub in value.items() if name in keys}
            part = _keyword_complement(key, kept, defs, depth + 1)
        elif key in ("allOf", "anyOf") and isinstance(value, list) and value:
            negated = [complement(sub, defs, depth + 1, keys, min_length) for sub in value]
            part = (
                None
                if any(n is None for n in negated)
                else {"anyOf" if key == "allOf" else "allOf": negated}
            )
        else:
            part = _keyword_complement(key, value, defs, depth + 1, min_length)
        if part is None:
            return None
        parts.append(part)
    parts = [p for p in parts if p is not False]
    if not parts:
        return False
    if any(p is True for p in parts):
        return True
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


def _open_complement(
    key: str, schema: dict[str, Any], defs: Defs, depth: int, keys: frozenset[str] | None
) -> Any:
    """Some name of ``keys`` present whose value ``schema``'s ``key`` rejects."""
    patterns = schema.get("patternProperties", {})
    listed = schema.get("properties", {})
    if keys is None or not isinstance(patterns, dict) or not isinstance(listed, dict):
        return None
    parts = []
    from espalier.constrained.postvalidate import pattern_search

    for name in sorted(keys):
        found = {p: pattern_search(p, name) for p in patterns}
        if None in found.values():  # a pattern that does not compile or backtracks too long
            return None
        matched = [sub for p, sub in patterns.items() if found[p]]
        if key == "additionalProperties":
            subs = [] if name in listed or matched else [schema["additionalProperties"]]
        else:
            subs = matched
        for sub in subs:
            negated = complement(sub, defs, depth)
            if negated is None:
                return None
            if negated is not False:
                parts.append({"type": "object", "required": [name], "properties": {name: negated}})
    return False if not parts else parts[0] if len(parts) == 1 else {"anyOf": parts}


def _keyword_complement(key: str, value: Any, defs: Defs, depth: int, min_length: int = 0) -> Any:
    if key == "type":
        names = set(value) if isinstance(value, list) else {value}
        types = types_of({"type": value}, defs)
        if types is None or ("integer" in names and "number" not in names):
            return None  # "not integer" means non-integral numbers: no type says that
        rest = [t for t in ALL_TYPES if t not in types]
        return {"type": rest} if rest else False
    if key in BOUND_COMPLEMENT and isinstance(value, (int, float)) and not isinstance(value, bool):
        kind, opposite = BOUND_COMPLEMENT[key]
        return {"type": kind, opposite: value}
    if key in COUNT_COMPLEMENT and isinstance(value, int) and not isinstance(value, bool):
        kind, opposite, step = COUNT_COMPLEMENT[key]
        if value + step < 0:
            return False  # minLength 0 etc. rejects nothing
        return {"type": kind, opposite: value + step}
    if key == "required" and isinstance(value, list):
        if not value:
            return False
        absent = [{"properties": {name: False}} for name in value]
        if len(absent) == 1:
            return {"type": "object", **absent[0]}
        return {"type": "object", "anyOf": absent}
    if key == "properties" and isinstance(value, dict):
        parts = []
        for name, sub in value.items():
            negated = complement(sub, defs, depth)
            if negated is None:
                return None
            if negated is not False:
                parts.append({"type": "object", "required": [name], "properties": {name: negated}})
        return False if not parts else parts[0] if len(parts) == 1 else {"anyOf": parts}
    if key == "pattern" and isinstance(value, str):
        # a floor only where the plain complement cannot be said: it adds automaton states
        floors = range(min(min_length, MAX_LENGTH_FLOOR) + 1)
        negated = next((n for k in floors if (n := complement_pattern(value, k)) is not None), None)
        if negated is None or negated is False:
            return negated  # not expressible / every string matches
        return {"type": "string"} if negated is True else {"type": "string", "pattern": negated}
    if key == "not":
        return value
    if key == "const":
        return values_complement([value])
    if key == "enum" and isinstance(value, list):
        return values_complement(value)
    if key in ("allOf", "anyOf") and isinstance(value, list) and value:
        negated = [complement(sub, defs, depth, min_length=min_length) for sub in value]
        if any(n is None for n in negated):
            return None
        return {"anyOf" if key == "allOf" else "allOf": negated}
    return None


def without(node: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in node.items() if k != key}


def append_all_of(node: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Both apply: one schema object when :func:`merged` can write it, else one more
    ``allOf`` branch."""
    joined = merged(node, extra)
    if joined is not None:
        return joined
    return {**node, "allOf": [*node.get("allOf", []), extra]}


def fold_all_of(node: dict[str, Any]) -> dict[str, Any]:
    """``node`` with each ``allOf`` branch :func:`merged` into it where it can be (the
    branches left stay in ``allOf``). Why: xgrammar compiles a node with an ``allOf`` as the
    ``allOf`` alone and outlines-core compiles the keywords beside it alone, so a rewrite's
    ``{..., "allOf": [{...}]}`` is enforced only once folded."""
    branches = node.get("allOf")
    if not isinstance(branches, list):
        return node
    out, left = without(node, "allOf"), []
    for branch in branches:
        joined = merged(out, branch) if isinstance(branch, dict) else None
        if joined is None:
            left.append(branch)
        else:
            out = joined
    if "allOf" in out:  # a branch's own allOf, now the node's
        left = [*out.pop("allOf"), *left]
        if left and left != branches:
            return fold_all_of({**out, "allOf": left})
    return {**out, "allOf": left} if left else out


def distributed_branches(node: dict[str, Any]) -> dict[str, Any]:
    """``node`` with the keywords beside its ``anyOf`` or ``oneOf`` :func:`merged` into every
    branch (``S and (A or B)`` is ``(S and A) or (S and B)``; for ``oneOf`` likewise, since a
    branch without ``S`` holds only where ``S`` does; ``false`` branches dropped); ``node``
    itself where a branch cannot be merged, the node has both keywords or an ``allOf`` left, or
    an ``enum`` / ``const`` is beside them (the enum filter reads those). Why: xgrammar and
    outlines-core compile such a node as its branches alone: ``{"type": "integer", "anyOf":
    [{}], "maximum": 6}`` wrote 6422 (a held-out sweep; :mod:`features` reports what stays
    beside them)."""
    keys = [k for k in ("anyOf", "oneOf") if isinstance(node.get(k), list)]
    if len(keys) != 1 or "allOf" in node or not node[keys[0]]:
        return node
    key = keys[0]
    beside = {k: v for k, v in node.items() if k in VOCABULARY and k not in _KEPT and k != key}
    if not beside or "enum" in beside or "const" in beside:  # the enum filter reads those
        return node
    if '"uniqueItems"' in json.dumps(beside):  # the tracker follows no place under branches
        return node
    out = []
    for branch in node[key]:
        if branch is False:
            continue  # holds nowhere: neither branch of an anyOf nor one of a oneOf's count
        joined = merged(beside, {} if branch is True else branch) if branch is not None else None
        if joined is None or not isinstance(branch, (dict, bool)):
            return node
        if not _crossed(joined):  # a merged branch whose bounds cross holds nothing: dropped
            out.append(joined)
    if not any(out):
        return node
    kept = {k: v for k, v in node.items() if k not in beside}
    return {**kept, key: out}


def _closed_object_empty(node: dict[str, Any]) -> bool:
    """Whether an object closed by ``additionalProperties: false`` (no ``patternProperties``)
    requires a name it does not list, or asks ``minProperties`` past the names it lists."""
    listed = node.get("properties", {})
    if node.get("additionalProperties") is not False or "patternProperties" in node:
        return False
    if not isinstance(listed, dict):
        return False
    names = {name for name, sub in listed.items() if sub is not False}
    required = node.get("required", [])
    if isinstance(required, list) and any(name not in names for name in required):
        return True
    least = node.get("minProperties")
    return isinstance(least, int) and not isinstance(least, bool) and least > len(names)


_RANGES = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"))


def _crossed(node: dict[str, Any]) -> bool:
    """Whether a lower bound of ``node`` passes its upper bound (no value of the bounded kind;
    read only where ``type`` names that kind alone)."""
    kinds = type_list(node.get("type"))
    if kinds is None or len(kinds) != 1:
        return False

    def num(key: str) -> float | None:
        value = node.get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    if kinds[0] in ("integer", "number"):
        lows = [(v, k == "exclusiveMinimum") for k in ("minimum", "exclusiveMinimum")
                if (v := num(k)) is not None]  # fmt: skip
        highs = [(v, k == "exclusiveMaximum") for k in ("maximum", "exclusiveMaximum")
                 if (v := num(k)) is not None]  # fmt: skip
        if not lows or not highs or not all(math.isfinite(b[0]) for b in lows + highs):
            return False
        low, low_open = max(lows, key=lambda b: (b[0], b[1]))
        high, high_open = min(highs, key=lambda b: (b[0], not b[1]))
        if kinds[0] == "integer":  # the least and greatest integers within
            least = math.floor(low) + 1 if low_open or low != math.floor(low) else low
            most = math.ceil(high) - 1 if high_open or high != math.ceil(high) else high
            return bool(least > most)
        return bool(low > high or (low == high and (low_open or high_open)))
    if kinds[0] == "object" and _closed_object_empty(node):
        return True
    pairs = {"string": _RANGES[0], "array": _RANGES[1], "object": _RANGES[2]}.get(kinds[0])
    if pairs is None:
        return False
    fewest, greatest = num(pairs[0]), num(pairs[1])
    return fewest is not None and greatest is not None and fewest > greatest


def typed_branches(node: dict[str, Any]) -> dict[str, Any]:
    """``node`` with its ``type`` also written into each ``anyOf`` branch (a branch of no
    type in common dropped): ``{"type": "integer", "anyOf": [{"type": "string"}, {"maximum":
    3}]}`` -> ``{"type": "integer", "anyOf": [{"type": "integer", "maximum": 3}]}``. The same
    values; why: xgrammar drops a type beside an anyOf whose branches are not within it (the
    complements of ``not`` and ``oneOf`` list every other type). Unchanged where a branch is
    not a plain schema object or none would be left."""
    kinds = type_list(node.get("type"))
    branches = node.get("anyOf")
    if kinds is None or not isinstance(branches, list) or not branches:
        return node
    out = []
    for branch in branches:
        if branch is False:
            continue
        branch = {} if branch is True else branch
        if not isinstance(branch, dict) or _SCOPED & set(branch) or "anyOf" in branch:
            return node
        if "enum" in branch or "const" in branch:  # its values, not a type beside them
            values = [branch["const"]] if "const" in branch else branch["enum"]
            if not isinstance(values, list):
                return node
            kept = [v for v in values if of_types(v, kinds)]
            if kept == values:
                out.append(branch)
            elif kept:
                rest = {k: v for k, v in branch.items() if k not in ("const", "enum")}
                out.append({**rest, "enum": kept})
            continue
        theirs = type_list(branch.get("type", list(ALL_TYPES)))
        if theirs is None:
            return node
        common = _common_types(kinds, theirs)
        if common:
            out.append({**branch, "type": common[0] if len(common) == 1 else common})
    if not out or out == branches:
        return node
    return {**node, "anyOf": out}


def of_types(value: Any, kinds: list[str]) -> bool:
    """Whether JSON ``value`` is of one of the type names ``kinds``."""
    kind = json_type(value)
    if kind == "number" and "number" not in kinds and "integer" in kinds:
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return kind in kinds


def type_list(value: Any) -> list[str] | None:
    names = [value] if isinstance(value, str) else value if isinstance(value, list) else None
    if names is None or not all(isinstance(n, str) for n in names):
        return None
    return names


def _common_types(mine: list[str], theirs: list[str]) -> list[str]:
    """The types both lists admit ("integer" within "number"), in ``mine``'s order."""
    out = []
    for kind in mine:
        if kind in theirs or (kind == "integer" and "number" in theirs):
            out.append(kind)
        elif kind == "number" and "integer" in theirs:
            out.append("integer")
    return list(dict.fromkeys(out))


# keywords read together: in one schema object, one keyword changes what another applies to
_TOGETHER = (
    frozenset({"properties", "patternProperties", "additionalProperties"}),
    frozenset({"prefixItems", "items", "additionalItems"}),
    frozenset({"contains", "minContains", "maxContains"}),
    frozenset({"if", "then", "else"}),
)
# keywords never merged: scopes and references (a backend may drop a $ref's siblings), and
# unevaluated* (they read the annotations of the whole object, allOf branches included)
_KEPT = ANNOTATIONS | {"$schema", "$dynamicAnchor", "$recursiveAnchor", "$defs", "definitions"}
"""Keywords that stay on a node whose other keywords move into its branches."""
_SCOPED = frozenset(
    {
        "$ref",
        "$dynamicRef",
        "$recursiveRef",
        "$id",
        "$anchor",
        "$dynamicAnchor",
        "$recursiveAnchor",
        "$defs",
        "definitions",
        "$schema",
        "unevaluatedProperties",
        "unevaluatedItems",
    }
)


def merged(node: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any] | None:
    """One schema object that means ``node`` and ``extra`` both apply, when written simply:
    keys apart, or shared as ``required`` (the union), an equal ``type`` or ``properties`` of
    both (each shared name's schemas joined the same way), and no keyword of one that changes
    what the other's keywords apply to (``additionalProperties`` beside another's
    ``properties``); None otherwise."""
    if _SCOPED & (set(node) | set(extra)):
        return None
    for group in _TOGETHER:
        mine, theirs = group & set(node), group & set(extra)
        if mine and theirs and not _names_kept(node, extra, mine, theirs):
            return None
    out = dict(node)
    for key, value in extra.items():
        if key not in out or key in ANNOTATIONS:
            out.setdefault(key, value)
        elif key == "required" and isinstance(value, list) and isinstance(out[key], list):
            out[key] = list(dict.fromkeys([*out[key], *value]))
        elif key == "type":
            mine_types, their_types = type_list(out[key]), type_list(value)
            if mine_types is None or their_types is None:
                return None
            common = _common_types(mine_types, their_types)
            if not common:
                return None  # no value: left as it is, for the emptiness checks to name
            out[key] = common[0] if len(common) == 1 else common
        elif key == "properties" and isinstance(value, dict) and isinstance(out[key], dict):
            joined = dict(out[key])
            for name, sub in value.items():
                joined[name] = _both(joined[name], sub) if name in joined else sub
            out[key] = joined
        else:
            return None
    return out


def _names_kept(
    node: dict[str, Any], extra: dict[str, Any], mine: frozenset[str], theirs: frozenset[str]
) -> bool:
    """Whether joining ``properties`` keeps what the other keywords of the group apply to:
    ``properties`` on both sides, and the side with only ``properties`` lists no name the
    other side does not (so an ``additionalProperties`` beside them covers the same names)."""
    if "properties" not in mine or "properties" not in theirs:
        return False
    if mine == theirs == {"properties"}:
        return True
    if theirs == {"properties"}:
        small, large = extra["properties"], node["properties"]
    elif mine == {"properties"}:
        small, large = node["properties"], extra["properties"]
    else:
        return False
    return isinstance(small, dict) and isinstance(large, dict) and set(small) <= set(large)


def _both(first: Any, second: Any) -> Any:
    """A schema for values both schemas accept."""
    if first is True or second is False:
        return second
    if second is True or first is False:
        return first
    if isinstance(first, dict) and isinstance(second, dict):
        return append_all_of(first, second)
    return {"allOf": [first, second]}
