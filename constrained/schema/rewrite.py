"""Exact schema rewrites: equivalent forms the grammar backends can enforce.

Each rewrite keeps the set of valid instances exactly the same (Draft 2020-12 semantics); the
result is a Draft 2020-12 schema without ``$schema``. Applied per schema object, children first:

- older drafts: ``items: [...]`` → ``prefixItems``, ``additionalItems`` → ``items``,
  ``dependencies`` → ``dependentRequired`` / ``dependentSchemas``, Draft 4 boolean
  ``exclusiveMinimum`` / ``exclusiveMaximum`` → numeric ones;
- ``unevaluatedProperties`` / ``unevaluatedItems`` whose evaluated set is static (no in-place
  applicator but ``allOf`` / ``$ref`` / ``not``) → plain ``additionalProperties`` / ``items``
  (:mod:`unevaluated`), before every other rewrite, which then need not keep annotations;
- ``oneOf`` whose branches cannot both match (disjoint types or values, a required property
  with distinct ``const`` values, strings with distinct leading characters; through ``allOf``
  members, refs and unions, also where the ``oneOf`` is an ``allOf`` member and the rest of
  its parent holds the discriminator) → ``anyOf`` (and
  ``type: string`` when every branch asserts string keywords only: non-strings match them all);
  ``oneOf`` decided type by type (two branches matching every instance of a type drop it)
  → ``type`` and ``anyOf``; other ``oneOf`` → ``anyOf`` of "this branch and the complement of
  each other one" when the complements exist (:mod:`one_of`);
- ``not X`` → the complement of ``X`` (less what its siblings guarantee: :mod:`implied`) when
  it can be written (types, bounds, lengths, counts,
  ``required``, ``properties``, ``allOf``/``anyOf`` of those); ``if/then/else`` likewise;
- a ``pattern`` / ``patternProperties`` name the backends read otherwise (a lookahead, an
  anchor inside, ``\\<``) → its language printed back in the syntax they read alike
  (:mod:`respell`);
- ``format`` names no draft defines, or on a node whose ``type`` excludes strings → dropped
  (they constrain nothing); ``date`` / ``time`` / ``date-time`` / ``json-pointer`` /
  ``relative-json-pointer`` / ``hostname`` / ``idn-email`` → exact ``pattern``s (and lengths);
  ``uri-reference`` → its checker's own expression (:mod:`checker_patterns`); ``uri-template``
  → a ``pattern`` within its checker's language (plain names, operators, prefixes, defaults);
- ``uniqueItems`` over a finite item domain → an ``enum`` of the allowed arrays
  (:mod:`unique_items`);
- ``contains`` whose count needs no counter (``minContains: 0``, ``maxContains: 0``, an item
  schema matching everything or nothing, ``maxContains < minContains``) → ``items`` /
  ``minItems`` / ``maxItems`` / ``type`` (:mod:`contains`);
- ``patternProperties`` matching every name or a single name → ``additionalProperties`` /
  ``properties`` (:mod:`pattern_properties`), so that the rest are disjoint for llguidance;
- ``propertyNames`` saying one thing (pattern, lengths, names) → ``patternProperties`` /
  ``properties`` and ``additionalProperties: false`` (:mod:`property_names`);
- ``minProperties`` / ``maxProperties`` next to optional listed properties → ``anyOf`` of
  branches on which of them are present (:mod:`property_counts`), last, everywhere;
- ``dependentRequired`` / ``dependentSchemas`` → ``anyOf`` of "property absent"
  (``properties: {p: false}``) and "present and ..." branches;
- ``enum`` / ``const`` next to other keywords → the members that satisfy them, alone
  (:mod:`enum_filter`; none left: ``false``, or an error at the root);
- a count (``minLength`` ... ``maxContains``) past :data:`COUNT_LIMIT`: a maximum is dropped, a
  minimum drops its type from ``type`` (``false`` when none is left). The one rewrite that is
  exact only on instances of fewer than ``2**31`` characters, items and properties, which every
  output is (a generation's budget is far below): the backends cannot read such counts
  (llguidance's regexes take ``u32``, xgrammar refuses ``minItems`` past ``2**31 - 1``,
  outlines-core wraps them), and the post-validation keeps the caller's;
- keywords without effect: ``if`` without ``then``/``else``, ``then``/``else`` without ``if``,
  ``uniqueItems: false``, ``uniqueItems`` with ``maxItems <= 1``, ``minContains`` / ``maxContains``
  without ``contains``, ``additionalItems`` (not a Draft 2020-12 keyword),
  ``propertyNames: {}``; ``propertyNames: false`` → ``maxProperties: 0``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from espalier.constrained.schema.checker_patterns import checker_pattern
from espalier.constrained.schema.contains import rewrite_contains
from espalier.constrained.schema.enum_filter import filter_enums
from espalier.constrained.schema.implied import without_implied
from espalier.constrained.schema.logic import (
    Defs,
    append_all_of,
    complement,
    distributed_branches,
    fold_all_of,
    key_set,
    typed_branches,
    types_of,
    without,
)
from espalier.constrained.schema.one_of import rewrite_one_of, rewrite_one_of_in_all_of
from espalier.constrained.schema.pattern_properties import finite_names, rewrite_pattern_properties
from espalier.constrained.schema.property_counts import rewrite_property_counts
from espalier.constrained.schema.property_names import rewrite_property_names
from espalier.constrained.schema.refs import inline_boolean_refs, prune_unused_defs
from espalier.constrained.schema.respell import respell_patterns, respell_wider
from espalier.constrained.schema.unevaluated import resolve_unevaluated
from espalier.constrained.schema.unique_items import rewrite_unique_items
from espalier.constrained.schema.walk import DRAFT_2020_12, dialect_of, map_subschemas


@dataclass(frozen=True)
class _Context:
    """``annotations_matter``: the schema still uses
    ``unevaluated*``, which sees which properties/items subschemas evaluated, so rewrites that
    change annotations (dropping ``additionalProperties: {}`` or a lone ``if``, negations,
    conditionals, ``oneOf``) are skipped. ``defs``: the root ``$defs`` (hoisted ref targets)."""

    annotations_matter: bool
    defs: Defs


def normalize_schema(schema: dict[str, Any] | bool) -> dict[str, Any] | bool:
    """The equivalent Draft 2020-12 schema with the rewrites above applied everywhere."""
    legacy = dialect_of(schema) != DRAFT_2020_12
    if legacy:
        unknown = _not_in_draft(schema)
        schema = _map_tree(
            schema, lambda node: _from_legacy({k: v for k, v in node.items() if k not in unknown})
        )
    elif '"dependencies"' in json.dumps(schema):
        schema = _map_tree(schema, _split_dependencies)
    defs = schema.get("$defs") if isinstance(schema, dict) else None
    if '"unevaluated' in json.dumps(schema):
        schema = resolve_unevaluated(schema, defs if isinstance(defs, dict) else {})
        defs = schema.get("$defs") if isinstance(schema, dict) else None
    text = json.dumps(schema)
    ctx = _Context(
        annotations_matter='"unevaluatedProperties"' in text or '"unevaluatedItems"' in text,
        defs=defs if isinstance(defs, dict) else {},
    )
    out = _rewrite(schema, "", ctx)
    if not ctx.annotations_matter:  # last: counts that complements wrote are rewritten too
        out = _map_tree(out, lambda node: rewrite_property_counts(node, ctx.defs))
    if isinstance(out, dict):
        out.pop("$schema", None)
    # the allOf branches the rewrites wrote, and the types beside their anyOfs; then the enum
    # members a fold put beside other keywords are filtered
    out = _map_tree(out, respell_wider)  # after every complement was taken
    out = _map_tree(out, lambda node: typed_branches(distributed_branches(fold_all_of(node))))
    out = filter_enums(out, annotations_matter=ctx.annotations_matter)
    # rewrites and filtered enums can leave $defs entries no ref reaches: they constrain nothing
    out = prune_unused_defs(inline_boolean_refs(out))
    # the schema true is {} (llguidance and outlines-core take only an object at the root)
    return {} if out is True else out


def _rewrite(node: Any, pointer: str, ctx: _Context) -> Any:
    """Rewrite one schema object, children first."""
    if not isinstance(node, dict):
        return node
    node = map_subschemas(node, pointer, lambda sub, at: _rewrite(sub, at, ctx))
    node = _drop_no_ops(node, ctx.annotations_matter)
    if not isinstance(node, dict):
        return node
    if "format" in node:
        node = _format(node)
    if "pattern" in node or "patternProperties" in node:
        node = respell_patterns(node)
    if ctx.annotations_matter:
        return node
    if "patternProperties" in node:
        node = rewrite_pattern_properties(node)
    if "propertyNames" in node:
        node = rewrite_property_names(node)
    if "patternProperties" in node:
        node = finite_names(node)
    if node.get("uniqueItems") is True:
        node = rewrite_unique_items(node, ctx.defs)
        if not isinstance(node, dict):
            return node
    if "contains" in node:
        node = rewrite_contains(node, ctx.defs)
    if "oneOf" in node and isinstance(node["oneOf"], list):
        node = rewrite_one_of(node, ctx.defs)
        if not isinstance(node, dict):
            return node
    if isinstance(node.get("allOf"), list) and any(
        isinstance(m, dict) and "oneOf" in m for m in node["allOf"]
    ):
        node = rewrite_one_of_in_all_of(node, ctx.defs)
    if "not" in node:
        node = _negate(node, ctx.defs)
        if not isinstance(node, dict):
            return node
    if "if" in node:
        node = _conditional(node, ctx.defs)
    if "dependentRequired" in node or "dependentSchemas" in node:
        node = _dependents(node)
    return node


def _map_tree(node: Any, fn: Any, pointer: str = "") -> Any:
    """``fn`` applied to every schema object, parents first."""
    if not isinstance(node, dict):
        return node
    return map_subschemas(fn(node), pointer, lambda sub, at: _map_tree(sub, fn, at))


# Keywords of later drafts: in a schema that declares one of these drafts they are unknown
# words, which constrain nothing (the post-validation, jsonschema's validator for the declared
# draft, ignores them).
NOT_IN_DRAFT = {
    "draft-04": frozenset({"const", "contains", "propertyNames", "if", "then", "else"}),
    "draft-06": frozenset({"if", "then", "else"}),
}


def _not_in_draft(schema: Any) -> frozenset[str]:
    """The keywords :data:`NOT_IN_DRAFT` for the draft ``schema`` declares at its root."""
    uri = schema.get("$schema") if isinstance(schema, dict) else None
    found = [words for draft, words in NOT_IN_DRAFT.items() if draft in str(uri)]
    return found[0] if found else frozenset()


def _from_legacy(node: dict[str, Any]) -> dict[str, Any]:
    node = dict(node)
    items = node.get("items")
    if isinstance(items, list):
        node["prefixItems"] = node.pop("items")
        if "additionalItems" in node:
            node["items"] = node.pop("additionalItems")
    else:
        node.pop("additionalItems", None)  # ignored unless items is an array
    node = _split_dependencies(node)
    for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(flag), bool) and node.pop(flag) and bound in node:
            node[flag] = node.pop(bound)
    return node


def _split_dependencies(node: dict[str, Any]) -> dict[str, Any]:
    """Draft 7's ``dependencies`` as ``dependentRequired`` / ``dependentSchemas``. Also applied
    in 2019-09 / 2020-12, where the keyword no longer exists: a schema that uses it means the
    split keywords, and enforcing them only narrows (an output still validates either way)."""
    node = dict(node)
    deps = node.pop("dependencies", None)
    if isinstance(deps, dict):
        required = {k: v for k, v in deps.items() if isinstance(v, list)}
        schemas = {k: v for k, v in deps.items() if not isinstance(v, list)}
        if required:
            node["dependentRequired"] = {**node.get("dependentRequired", {}), **required}
        if schemas:
            node["dependentSchemas"] = {**node.get("dependentSchemas", {}), **schemas}
    return node


COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
          "minContains", "maxContains")  # fmt: skip
COUNT_LIMIT = 2**31 - 1
"""More characters, items or properties than any output holds (see the module docstring)."""
_COUNTED = {"minLength": "string", "minItems": "array", "minContains": "array",
            "minProperties": "object"}  # fmt: skip
_ALL_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")


def _declared_types(node: dict[str, Any]) -> list[str]:
    """The types ``node``'s ``type`` lists (every type when it has none)."""
    value = node.get("type", list(_ALL_TYPES))
    return [value] if isinstance(value, str) else list(value)


def _drop_no_ops(node: dict[str, Any], annotations_matter: bool) -> dict[str, Any] | bool:
    node = dict(node)
    for key in COUNTS:  # 2.0 is the integer 2 in JSON Schema
        value = node.get(key)
        if isinstance(value, float) and value.is_integer():
            node[key] = value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and value > COUNT_LIMIT:
            del node[key]  # a maximum: no output reaches it
            if key in _COUNTED:  # a minimum: no output of that type meets it
                kept = [t for t in _declared_types(node) if t != _COUNTED[key]]
                if not kept:
                    return False
                node["type"] = kept
    if "if" in node and "then" not in node and "else" not in node and not annotations_matter:
        node.pop("if")
    if "if" not in node:
        node.pop("then", None)
        node.pop("else", None)
    if node.get("uniqueItems") is False:
        node.pop("uniqueItems")
    max_items = node.get("maxItems")
    if "uniqueItems" in node and isinstance(max_items, int) and max_items <= 1:
        node.pop("uniqueItems")
    # no Draft 2020-12 keyword (older drafts' was turned into "items" above): no effect
    node.pop("additionalItems", None)
    if "contains" not in node:
        node.pop("minContains", None)
        node.pop("maxContains", None)
    evaluating = ("unevaluatedProperties", "unevaluatedItems", "additionalProperties")
    for key in ("propertyNames",) if annotations_matter else ("propertyNames", *evaluating):
        if node.get(key) is True or node.get(key) == {}:
            node.pop(key)
    names = node.get("propertyNames")
    if isinstance(names, dict) and "type" not in names:  # property names are always strings
        node["propertyNames"] = {"type": "string", **names}
    if node.get("propertyNames") is False:
        node.pop("propertyNames")
        node["maxProperties"] = 0
    for key in ("dependentRequired", "dependentSchemas"):
        if node.get(key) == {}:
            node.pop(key)
    return node


# Formats with a meaning in draft 4 or later; any other name constrains nothing (JSON Schema
# ignores it, and so does the post-validation: draft 3's "host-name", "ip-address" and "color"
# included, which no later draft's checker knows).
KNOWN_FORMATS = frozenset(
    {"date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname",
     "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template",
     "json-pointer", "relative-json-pointer", "regex"}
)  # fmt: skip
_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"  # not 0000
_MONTH_DAY = (
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    "|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
# RFC 3339 full-time without leap seconds (as the post-validation's checker: rfc3339-validator).
# The optional fraction is "(?:[.][0-9]+|)": xgrammar reads "(?:[.][0-9]+)?" as also matching
# "1" (schema_features.optional_group_repeats), which let "12:00:001Z" through.
_TIME = (
    "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:[.][0-9]+|)"
    "(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
)
# RFC 6901 (the checker: jsonpointer): "/"-led tokens where "~" is followed by 0 or 1 only.
_POINTER = "(?:/(?:[^~/]|~[01])*)*"
# RFC 1123 host names (the checker: fqdn, "preferred name syntax"): dot-separated labels of 1-63
# letters, digits and inner hyphens, an optional final dot; at most 253 characters (the checker
# allows 254 when the last is the dot: a false reject there, never a false accept)
_LABEL = "[A-Za-z0-9](?:[-A-Za-z0-9]{0,61}[A-Za-z0-9])?"
# RFC 6570 templates as the checker (uri_template.validate) parses them, in part: literals are
# any characters but braces (the checker asks no more of them); an expression is an optional
# operator and comma-separated names (ASCII letters, digits, "_", then also "." and "%XX") with
# a ":n" prefix (1-999) or "*", and a default ("=x" of URI characters but "[],").
# The checker also takes "/" in names, "[]", trailing joiners and the "," operator: false
# rejects, never false accepts. "(...|)", not "(...)?": xgrammar misreads an optional group
# holding a repetition.
_VARSPEC = (
    "[A-Za-z0-9_](?:[A-Za-z0-9_.]|%[0-9A-Fa-f]{2})*(?::[1-9][0-9]{0,2}|[*]|)"
    "(?:=[A-Za-z0-9_.~!$&'()*+;:/?#@%=-]*|)"
)
_TEMPLATE = f"(?:[^{{}}]|[{{][+#./;?&]?{_VARSPEC}(?:,{_VARSPEC})*[}}])*"
FORMAT_MAX_LENGTH = {"hostname": 253}
FORMAT_PATTERNS = {
    "hostname": f"^(?:{_LABEL}[.])*{_LABEL}[.]?$",
    # the checker (jsonschema) only asks for an "@" somewhere, for email and idn-email alike
    "idn-email": "^[\\s\\S]*@[\\s\\S]*$",
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}[Tt]{_TIME}$",
    "json-pointer": f"^{_POINTER}$",
    # the checker (jsonschema) refuses a digit after any "0" ("100"), and takes non-ASCII digits
    # too: this is its ASCII language (a false reject on the others, never a false accept)
    "relative-json-pointer": f"^(?:0|[1-9]+0?)(?:#|{_POINTER})$",
    "uri-template": f"^{_TEMPLATE}$",
}


def _format(node: dict[str, Any]) -> dict[str, Any]:
    """Drop formats that constrain nothing; spell calendar formats as exact patterns."""
    name = node["format"]
    types = types_of({"type": node["type"]}, {}) if "type" in node else None
    if name not in KNOWN_FORMATS or (types is not None and "string" not in types):
        return without(node, "format")
    pattern = FORMAT_PATTERNS.get(name) or checker_pattern(name)
    if pattern is None:
        return node
    limit = FORMAT_MAX_LENGTH.get(name)
    extra = {"pattern": pattern, **({"maxLength": limit} if limit is not None else {})}
    return append_all_of(without(node, "format"), extra)


def _negate(node: dict[str, Any], defs: Defs) -> Any:
    rest = without(node, "not")
    negated = complement(
        without_implied(node["not"], [rest], defs),
        defs,
        keys=key_set(rest, defs),
        min_length=_length_floor(rest),
    )
    if negated is None:
        return node
    if negated is False:
        return False
    if negated is True:
        return rest
    return append_all_of(rest, negated)


def _conditional(node: dict[str, Any], defs: Defs) -> Any:
    """``if/then/else`` = ``anyOf[allOf[if, then], allOf[not if, else]]`` when ``not if`` exists."""
    condition = node["if"]
    rest = {k: v for k, v in node.items() if k not in ("if", "then", "else")}
    otherwise = complement(
        without_implied(condition, [rest], defs),
        defs,
        keys=key_set(rest, defs),
        min_length=_length_floor(rest),
    )
    if otherwise is None:
        return node
    branches = [
        {"allOf": [condition, node.get("then", True)]},
        {"allOf": [otherwise, node.get("else", True)]},
    ]
    return append_all_of(rest, {"anyOf": branches})


def _length_floor(rest: dict[str, Any]) -> int:
    """The ``minLength`` ``rest`` puts on every string instance (0 when none)."""
    value = rest.get("minLength")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _dependents(node: dict[str, Any]) -> dict[str, Any]:
    required = node.get("dependentRequired", {})
    schemas = node.get("dependentSchemas", {})
    if not isinstance(required, dict) or not isinstance(schemas, dict):
        return node
    out = without(without(node, "dependentRequired"), "dependentSchemas")
    for name, needed in required.items():
        if not isinstance(needed, list):
            return node
        branch = {"required": [name, *needed]}
        out = append_all_of(out, {"anyOf": [{"properties": {name: False}}, branch]})
    for name, sub in schemas.items():
        present = {"allOf": [{"required": [name]}, sub]}
        out = append_all_of(out, {"anyOf": [{"properties": {name: False}}, present]})
    return out
