"""Which JSON Schema keywords each backend enforces exactly, weakens or ignores.

:func:`backend_issues` returns, for one backend, each keyword of a schema (with its JSON pointer)
that it does not enforce exactly. The claims in :data:`PROFILES` are verified one by one in
``tests/constrained/test_schema_features.py`` (each "exact" claim: a violating instance is
rejected and a valid one accepted through the real backend; each "weakened"/"ignored" claim: the
backend refuses or accepts a violating instance). What is not claimed exact is not exact: an
unknown context counts as weakened. "Exact" is about false accepts: an exact keyword never lets an
invalid instance through, though the grammar may still reject some valid ones (it fixes property
order and bounds whitespace).

Support is judged per schema object (context matters: xgrammar enforces ``minLength`` only on a
node typed ``"string"`` and only when no ``pattern``/``format`` is next to it). Pure annotations
(``title``, ``default``, ...) and keywords of no vocabulary constrain nothing and are exact
everywhere. A backend that *refuses* a schema at compile time is not a false accept: ``IGNORED``
here means "this backend cannot enforce it", whether it then refuses or drops it.

Run the analysis on the schema the backend will see, i.e. after :func:`refs.resolve_refs` and
:func:`rewrite.normalize_schema`. ``uniqueItems`` is in no backend's profile: where the run-time
tracker follows it (:mod:`unique_places`, every backend, since the tracker wraps any matcher),
compile has already replaced it by a mark no backend reads; what is left is refused.
"""

from __future__ import annotations

import enum
import functools
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from espalier.constrained.errors import KeywordIssue
from espalier.constrained.schema.number_bounds import is_number
from espalier.constrained.schema.walk import escape_pointer_token, walk

ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "contentMediaType",
        "contentEncoding",
        "contentSchema",
        "$defs",
        "definitions",
        "$id",
        "$anchor",
        "$vocabulary",
    }
)
NUMERIC = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
STRING = frozenset({"minLength", "maxLength", "pattern", "format"})
ARRAY = frozenset(
    {
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "additionalItems",
        "unevaluatedItems",
    }
)
OBJECT = frozenset(
    {
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "minProperties",
        "maxProperties",
        "propertyNames",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "unevaluatedProperties",
    }
)
GENERIC = frozenset(
    {
        "type",
        "enum",
        "const",
        "allOf",
        "anyOf",
        "oneOf",
        "not",
        "if",
        "then",
        "else",
        "$ref",
        "$dynamicRef",
        "$recursiveRef",
        "$dynamicAnchor",
        "$recursiveAnchor",
        "$schema",
    }
)
VOCABULARY = ANNOTATIONS | NUMERIC | STRING | ARRAY | OBJECT | GENERIC
KNOWN_DIALECTS = frozenset(
    {
        "https://json-schema.org/draft/2020-12/schema",
        "https://json-schema.org/draft/2019-09/schema",
        "http://json-schema.org/draft-07/schema",
        "http://json-schema.org/draft-06/schema",
        "http://json-schema.org/draft-04/schema",
    }
)
TYPE_OF = {**{k: "number" for k in NUMERIC}, **{k: "string" for k in STRING}}
TYPE_OF.update({k: "array" for k in ARRAY} | {k: "object" for k in OBJECT})


class Support(enum.Enum):
    EXACT = "exact"
    WEAKENED = "weakened"  # enforced in part: some invalid instances get through
    IGNORED = "ignored"  # not enforced at all, or the backend refuses the schema


Rule = Callable[[str, dict[str, Any]], Support]


@dataclass(frozen=True)
class BackendProfile:
    """What one backend enforces. ``rule(keyword, node)`` handles the context-dependent cases."""

    name: str
    exact: frozenset[str]
    formats: frozenset[str]
    rule: Rule | None = None
    false_schema: bool = True  # enforces a ``false`` subschema (matches nothing)
    false_schema_under: frozenset[str] = frozenset()  # keywords whose ``false`` value it enforces
    # ... in a node where this holds (keyword, node): outlines-core's only where ``properties``
    # is given (its object regex then names those keys alone; without it, a compile error)
    false_schema_where: Callable[[str, dict[str, Any]], bool] | None = None
    # what makes the backend refuse a whole schema at compile, where others drop the keyword:
    # keywords it does not implement, formats outside ``compiled_formats`` (None: it takes any
    # name), ``oneOf`` unless it can read it as ``anyOf`` (:mod:`weaken` drops or rewrites them
    # under ``allow_weakening``; none is in ``exact``, so each is reported as weakened)
    refused: frozenset[str] = frozenset()
    compiled_formats: frozenset[str] | None = None
    one_of_refused: bool = False
    # keyword uses in a node it must never be given, whatever the mode (its compile would not
    # end); each is ``ignored`` by ``rule``, so it is reported, and :mod:`weaken` drops it
    uncompilable: Callable[[dict[str, Any]], frozenset[str]] | None = None


def backend_issues(backend: str, schema: Any) -> list[KeywordIssue]:
    """Each keyword use in ``schema`` that ``backend`` does not enforce exactly."""
    profile = PROFILES[backend]
    issues: list[KeywordIssue] = []
    enforced_false = _enforced_false_pointers(profile, schema)
    for node in walk(schema):
        if isinstance(node.schema, bool):
            if not node.schema and not profile.false_schema and node.pointer not in enforced_false:
                issues.append(KeywordIssue("false", node.pointer, Support.IGNORED.value, backend))
            continue
        for keyword in node.schema:
            support = keyword_support(profile, keyword, node.schema)
            if support is not Support.EXACT:
                issues.append(KeywordIssue(keyword, node.pointer, support.value, backend))
    return issues


def _enforced_false_pointers(profile: BackendProfile, schema: Any) -> set[str]:
    """Pointers of the ``false`` subschemas ``profile`` enforces by the keyword holding them
    (``additionalProperties: false`` on xgrammar), found from the parent so a property that
    happens to be named ``additionalProperties`` does not count."""
    if profile.false_schema or not profile.false_schema_under:
        return set()
    where = profile.false_schema_where
    return {
        f"{node.pointer}/{escape_pointer_token(keyword)}"
        for node in walk(schema)
        if isinstance(node.schema, dict)
        for keyword in profile.false_schema_under
        if node.schema.get(keyword) is False and (where is None or where(keyword, node.schema))
    }


def keyword_support(profile: BackendProfile, keyword: str, node: dict[str, Any]) -> Support:
    """How ``profile`` enforces ``keyword`` in schema object ``node``."""
    if keyword not in VOCABULARY or keyword in ANNOTATIONS:
        return Support.EXACT  # constrains nothing
    if keyword == "$schema":
        uri = str(node[keyword]).rstrip("#")
        return Support.EXACT if uri in KNOWN_DIALECTS else Support.IGNORED
    if keyword not in profile.exact:
        return Support.IGNORED
    if keyword in ("enum", "const") and values_with_siblings(node):
        # members failing a sibling get through where a backend emits the values alone;
        # rewrite.normalize_schema filters them and drops the siblings (enum_filter)
        return Support.WEAKENED
    if keyword == "$ref" and not _is_local_ref(node.get(keyword)):
        return Support.IGNORED  # left unresolved (dynamic scopes): backends drop such refs
    if profile.uncompilable is not None and keyword in profile.uncompilable(node):
        return Support.IGNORED  # dropped before the compile (weaken.py)
    if keyword == "format" and node.get("format") not in profile.formats:
        compiled = profile.compiled_formats
        dropped = compiled is not None and node.get("format") not in compiled
        return Support.IGNORED if dropped else Support.WEAKENED
    if keyword == "pattern" and read_otherwise_by_backends(node["pattern"]):
        return Support.WEAKENED
    if profile.rule is not None:
        return profile.rule(keyword, node)
    return Support.EXACT


NOT_ASSERTING = ANNOTATIONS | {"$schema", "$dynamicAnchor", "$recursiveAnchor"}


def values_with_siblings(node: dict[str, Any]) -> bool:
    """Whether ``node`` has ``enum`` or ``const`` and another keyword that asserts something
    (the other of the two included)."""
    values = ("enum" in node) + ("const" in node)
    if values != 1:
        return values == 2
    return any(k in VOCABULARY and k not in NOT_ASSERTING | {"enum", "const"} for k in node)


def read_otherwise_by_backends(pattern: Any) -> bool:
    """Whether every backend reads ``pattern`` otherwise than the post-validator: a lookaround,
    an inner anchor or ``\\<`` / ``\\>`` that :mod:`respell` left as it is (the pattern algebra
    could not read it). xgrammar ignores a lookahead and an inner ``^`` (its own warning; probe
    ``pattern-lookahead``: ``^(?!a)[a-z]+$`` took ``"abc"``), llguidance and outlines-core refuse
    a lookaround and read ``\\<`` as a word boundary."""
    from espalier.constrained.schema.respell import read_otherwise

    return isinstance(pattern, str) and read_otherwise(pattern)


def _is_local_ref(ref: Any) -> bool:
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def _types(node: dict[str, Any]) -> set[str]:
    value = node.get("type")
    if isinstance(value, str):
        return {value}
    if isinstance(value, list):
        return {t for t in value if isinstance(t, str)}
    return set()


def _string_groups(node: dict[str, Any]) -> int:
    return sum(("pattern" in node, "format" in node, "minLength" in node or "maxLength" in node))


_BOUNDS = NUMERIC - {"multipleOf"}


def _past_float64(value: Any) -> bool:
    """Whether ``value`` is an integer no float64 holds (``10**400``): both JSON backends fail
    to read it (xgrammar: a bare "RuntimeError", llguidance: "number out of range")."""
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**1024


def _xgrammar_uncompilable(node: dict[str, Any]) -> frozenset[str]:
    """``BackendProfile.uncompilable`` of xgrammar: a number it cannot read, an integer's
    bound outside int64 ("Check failed ... Integer exceeds maximum limit"), a pattern that
    writes broken JSON (:func:`breaks_json`)."""
    integer = "integer" in _types(node)
    prefix, most = node.get("prefixItems"), node.get("maxItems")
    # "maxItems is less than the number of prefixItems": refused at compile, though a shorter
    # array is valid (a held-out sweep); dropped under allow_weakening (a wider language)
    short = isinstance(prefix, list) and is_number(most) and most < len(prefix)
    return (
        frozenset({"maxItems"} if short else ())
        | frozenset(
            k
            for k in NUMERIC & node.keys()
            if _past_float64(node[k])
            or (integer and k in _BOUNDS and is_number(node[k]) and not -(2**63) <= node[k] < 2**63)
        )
        | breaks_json(node)
        | _uncompilable_pattern(node)
    )


def _uncompilable_pattern(node: dict[str, Any]) -> frozenset[str]:
    """``{"pattern"}`` when no backend compiles ``node``'s pattern
    (``respell.no_backend_compiles``): dropped under allow_weakening."""
    from espalier.constrained.schema.respell import no_backend_compiles

    pattern = node.get("pattern")
    return frozenset(
        {"pattern"} if isinstance(pattern, str) and no_backend_compiles(pattern) else ()
    )


def _outlines_uncompilable(node: dict[str, Any]) -> frozenset[str]:
    """``BackendProfile.uncompilable`` of outlines-core: patterns no backend compiles, or that
    write broken JSON there."""
    return _uncompilable_pattern(node) | breaks_json(node)


def breaks_json(node: dict[str, Any]) -> frozenset[str]:
    """``{"pattern"}`` when ``node``'s pattern spells out a character JSON writes escaped and
    may match it: xgrammar and outlines-core match it against the JSON text, so ``^\\\\$``
    (one backslash) wrote the string ``"\\"``, unterminated. Dropped under allow_weakening, the
    string is JSON at least (and reported ignored)."""
    pattern = node.get("pattern")
    return frozenset(
        {"pattern"} if isinstance(pattern, str) and _names_escaped_char(pattern) else ()
    )


def _xgrammar_rule(keyword: str, node: dict[str, Any]) -> Support:
    if keyword in ("const", "enum") and _integer_outside(node[keyword], _within(_INT64)):
        return Support.WEAKENED  # written as a float (probe "const-past-int64")
    if beside_branches(keyword, node):
        return Support.IGNORED  # the node is compiled as its branches alone (probe
        # "maximum-beside-anyOf": {"type": "integer", "anyOf": [{}], "maximum": 6} wrote 6422)
    if isinstance(node.get("allOf"), list) and _beside_all_of(node):
        # the node is compiled as its allOf alone: {"type": "integer", "minimum": 0, "allOf":
        # [{"maximum": 5}]} wrote strings (probes "required-beside-allOf", "minimum-beside-allOf",
        # "allOf-beside-siblings")
        return Support.WEAKENED if keyword == "allOf" else Support.IGNORED
    kind = TYPE_OF.get(keyword)
    types = _types(node)
    if kind is not None and not types:
        return Support.IGNORED  # type-specific keywords are dropped where no "type" is given
    # under a "type" list each listed type keeps its own keywords (probes "*-type-list"); a
    # keyword of no listed type constrains nothing (probe "maxLength-of-no-listed-type")
    if kind == "string" and _string_groups(node) > 1:
        return Support.WEAKENED  # at most one of pattern / format / length is enforced
    if keyword in ("minLength", "maxLength") and "string" in types:
        return Support.WEAKENED  # such a string takes raw control characters (probe "minLength")
    if keyword == "required" and required_outside_properties(node):
        return Support.WEAKENED  # probe "required-not-in-properties"
    if keyword == "pattern" and optional_group_repeats(str(node["pattern"])):
        return Support.WEAKENED  # (?:x[0-9]+)? also matches "1" (probe "pattern-optional-repeat")
    value: Any = node.get(keyword)
    if keyword in _BOUNDS and tiny_bound(node):
        return Support.WEAKENED  # [1e-9, 1e-8] took an empty text (probe "number-bounds-tiny")
    bound = keyword in _BOUNDS and "number" in types  # past float64: uncompilable (above)
    if bound and isinstance(value, int) and value != float(value):
        return Support.WEAKENED  # a number's bound is read as a float64: 2**53 took 2**53 + 1
    if keyword == "multipleOf":
        if types != {"integer"} or not (isinstance(value, int) or float(value).is_integer()):
            return Support.WEAKENED
        if any(bound in node for bound in NUMERIC - {"multipleOf"}):
            return Support.WEAKENED  # dropped next to a range (probe "multipleOf-with-range")
        if abs(value) > XGRAMMAR_MULTIPLE_LIMIT:
            return Support.WEAKENED  # silently dropped (probe "multipleOf-past-1024")
    if keyword == "allOf" and len(node["allOf"]) != 1:
        return Support.WEAKENED
    if keyword in ("anyOf", "type") and _type_dropped_beside_branches(node, types):
        return Support.WEAKENED  # the type next to it is dropped (probe "anyOf-next-to-type")
    return Support.EXACT


def beside_branches(keyword: str, node: dict[str, Any]) -> bool:
    """Whether ``keyword`` asserts something beside ``node``'s ``anyOf`` / ``oneOf`` (``type``
    aside: kept where the branches lie within it). xgrammar and outlines-core compile such a
    node as its branches alone; ``logic.distributed_branches`` moves these keywords into the
    branches where it can, and what stays beside them is reported here."""
    if not any(isinstance(node.get(k), list) for k in ("anyOf", "oneOf")):
        return False
    return keyword in VOCABULARY and keyword not in NOT_ASSERTING | {"anyOf", "oneOf", "type"}


def _beside_all_of(node: dict[str, Any]) -> bool:
    """Whether ``node`` asserts something beside its ``allOf``."""
    return any(k != "allOf" and k in VOCABULARY and k not in NOT_ASSERTING for k in node)


def _type_dropped_beside_branches(node: dict[str, Any], types: set[str]) -> bool:
    """Whether xgrammar drops ``node``'s ``type`` for the branches beside it: an ``anyOf`` with
    a branch not within the type, or an ``allOf`` of several (``{"type": "integer", "allOf":
    [{"minimum": 1}, {"maximum": 5}]}`` wrote strings). Then the type is weakened too."""
    if not types:
        return False
    if "anyOf" in node and not _branches_within(node["anyOf"], types):
        return True
    return isinstance(node.get("allOf"), list) and len(node["allOf"]) != 1


def _branches_within(branches: Any, types: set[str]) -> bool:
    """Whether each branch has a ``type`` naming only types of ``types``."""
    allowed = types | {"integer"} if "number" in types else types
    return isinstance(branches, list) and all(
        isinstance(b, dict) and (_types(b) or {"?"}) <= allowed for b in branches
    )


def required_outside_properties(node: dict[str, Any]) -> bool:
    """Whether ``required`` names a property that ``properties`` of the same object lacks:
    xgrammar and outlines-core only require the properties they emit."""
    names = node.get("required")
    listed = node.get("properties")
    known = set(listed) if isinstance(listed, dict) else set()
    return isinstance(names, list) and any(name not in known for name in names)


def optional_group_repeats(pattern: str) -> bool:
    """Whether a group made optional by ``?`` holds a repetition (``+``, ``*``, ``{m,n}``):
    xgrammar's regex conversion lets such a group's repeated part match without the rest."""
    starts: list[int] = []
    for i, char in _syntax(pattern):
        if char == "(":
            starts.append(i)
        elif char == ")" and starts:
            start = starts.pop()
            body = pattern[start + 1 : i]
            if pattern[i + 1 : i + 2] == "?" and any(c in "+*{" for _, c in _syntax(body)):
                return True
    return False


_ESCAPED_BY_JSON = '[\\u0000-\\u001f"\\\\]'  # the characters a JSON string writes escaped
_NAMES_ESCAPED = re.compile(
    r'\\\\|\\u00[01][0-9a-fA-F]|\\u005[cC]|\\u0022|\\x[01]|\\x22|\\x5[cC]|"'
)


def may_match_escaped(pattern: str) -> bool:
    """Whether ``pattern`` may match a string holding a character JSON writes escaped (``"``,
    ``\\``, U+0000-U+001F) as the backends read it: exact by :mod:`regular`, True when it
    cannot read the pattern."""
    if not (pattern.startswith("^") and pattern.endswith("$")) or pattern.endswith("\\$"):
        return True  # open at an end: any character may come there (no automaton needed)
    from espalier.constrained.schema.regular import patterns_meet

    return patterns_meet((pattern, _ESCAPED_BY_JSON), final_newline=False) is not False


def _names_escaped_char(pattern: str) -> bool:
    """Whether ``pattern`` spells out such a character (xgrammar then matches it against the
    escape's text), alone or in a class, and may match it."""
    spelled = bool(_NAMES_ESCAPED.search(pattern)) or _class_holds_escaped(pattern)
    return spelled and may_match_escaped(pattern)


_CLASS_ITEM = re.compile(
    r"\\u([0-9a-fA-F]{4})|\\U([0-9a-fA-F]{8})|\\x\{([0-9a-fA-F]{1,6})\}|\\x([0-9a-fA-F]{2})"
    r"|\\(.)|(.)",
    re.DOTALL,
)
_ESCAPE_POINTS = {"\\": 0x5C, '"': 0x22, "n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B}


def _class_holds_escaped(pattern: str) -> bool:
    """Whether a ``[...]`` class of ``pattern`` that is not negated holds a character JSON writes
    escaped (alone, in a range: ``[ -/]`` holds ``"``, or in ``\\s \\S \\W \\D``) beside a
    non-ASCII character written as itself. xgrammar then takes the escaped one raw: ``[ -/é]``
    took ``","``, while ``[ -/]`` and ``[ -/\\u00e9]`` did not; the algebra prints classes so
    (``\\W{1,3}``, respelled for the backends' reading of ``\\W``, wrote ``","-"``)."""
    from espalier.constrained.schema.respell import class_end

    at = 0
    while at < len(pattern):
        if pattern[at] == "\\":
            at += 2
            continue
        if pattern[at] != "[":
            at += 1
            continue
        end = class_end(pattern, at)
        body, at = pattern[at + 1 : end - 1], end
        if body.startswith("^"):
            continue
        points: list[int | str] = []  # code points, "-" for a range's dash
        escaped_class = non_ascii = False
        for item in _CLASS_ITEM.finditer(body):
            hex_digits = item.group(1) or item.group(2) or item.group(3) or item.group(4)
            escape, plain = item.group(5), item.group(6)
            if hex_digits is not None:
                points.append(int(hex_digits, 16))
            elif escape is not None:
                escaped_class |= escape in "sSWD"
                points.append(_ESCAPE_POINTS.get(escape, ord(escape)))
            else:
                non_ascii |= ord(plain) > 0x7F
                points.append("-" if plain == "-" else ord(plain))
        for k, point in enumerate(points):
            if point == "-":
                continue
            low = high = point
            if k + 2 < len(points) and points[k + 1] == "-" and points[k + 2] != "-":
                high = points[k + 2]
            assert isinstance(low, int) and isinstance(high, int)
            escaped_class |= low <= 0x1F or low <= 0x22 <= high or low <= 0x5C <= high
        if escaped_class and non_ascii:
            return True
    return False


def _syntax(pattern: str) -> list[tuple[int, str]]:
    """``(index, char)`` of the regex characters outside escapes and ``[...]`` classes."""
    out = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if char == "[":  # skip the class; a "]" first inside it is literal
            i = pattern.find("]", i + 2 if pattern[i + 1 : i + 2] in ("]", "^") else i + 1)
            if i < 0:
                break
        else:
            out.append((i, char))
        i += 1
    return out


_FLOAT64_EXACT_INT = 2**53


def _classes(pattern: str) -> list[str]:
    """The ``[...]`` classes of ``pattern`` as written (outside escapes; a first ``]`` is
    literal)."""
    from espalier.constrained.schema.respell import class_end

    out = []
    at, end = 0, len(pattern)
    while at < end:
        char = pattern[at]
        if char == "[":
            stop = class_end(pattern, at)
            out.append(pattern[at:stop])
            at = stop
        else:
            at += 2 if char == "\\" else 1
    return out


def class_set_syntax(pattern: str) -> bool:
    """Whether a ``[...]`` class of ``pattern`` holds an unescaped ``[``, ``&&``, ``--`` or
    ``~~``: literal characters in ECMA-262, a nested class or a set operation in Rust's regex
    syntax (llguidance's): ``^[a[bc]]$`` took ``"b"``, ``^[[:alpha:]]+$`` took ``"abc"``."""
    for text in _classes(pattern):
        body = re.sub(r"\\.", "", text[1:-1])
        if "[" in body or any(op in body for op in ("&&", "--", "~~")):
            return True
    return False


def escape_class_misread(pattern: str) -> bool:
    """Whether a class of ``pattern`` holds U+0000 and U+001F but not both ``"`` and ``\\``.
    llguidance matches such a class against the JSON text with escapes it should not take:
    ``[^"]`` took ``\\"``, ``[\\x00-\\x1f]`` took ``\\"`` and ``\\\\`` (probes
    "pattern-negated-quote", "pattern-control-range"); classes without one of the two ends
    (``[\\x00-\\x1e]``, ``[^"\\x00]``) and classes with both characters were read right. A
    class Python cannot read counts as misread."""
    for text in _classes(pattern):
        try:
            with warnings.catch_warnings():  # "possible nested set": class_set_syntax's case
                warnings.simplefilter("ignore", FutureWarning)
                compiled = re.compile(text)
        except (re.error, OverflowError, RecursionError):
            return True
        ends = compiled.fullmatch("\x00") and compiled.fullmatch("\x1f")
        if ends and not (compiled.fullmatch('"') and compiled.fullmatch("\\")):
            return True
    return False


def _llguidance_misreads(pattern: str) -> bool:
    return escape_class_misread(pattern) or class_set_syntax(pattern)


XGRAMMAR_MULTIPLE_LIMIT = 1024
"""The largest integer ``multipleOf`` xgrammar enforces; past it the keyword is dropped without
a word (1024 takes 683 out, 1025 lets it in). Near the limit its compile takes ~30 s."""

LLGUIDANCE_MULTIPLE_LIMIT = 5_000
"""The largest :func:`llguidance_multiple` llguidance is given: its lexer's automaton for a
``multipleOf`` grows with that number, trailing zeros included. On the Gemma vocabulary its
masks failed mid-generation ("lexer error: too many expressions constructed") for 20000,
12345, 11003, 10007 and 1000000, and for 9973 on 2 of 6 walks; 1009-7001 passed every walk
(6 each). Past about 10**7 (``99999999``, ``2**31``) the compile itself ran past 200 s and
9.7 GB, in process, and aborted the process where memory ran out."""


def llguidance_multiple(value: Any) -> int:
    """The integer llguidance reads a ``multipleOf`` as: an integral value itself, any other
    multiplied by 10 in floating point until it is whole (``0.25`` -> 25, ``0.07`` ->
    7000000000000001: ``0.07 * 10`` is ``0.7000000000000001``, and llguidance refuses it,
    "too many digits"). 0 for what is not a finite positive number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return 0
    if isinstance(value, int):
        return value  # past float range too: never converted
    if not math.isfinite(value):
        return 0
    scaled, steps = value, 0
    while scaled != math.floor(scaled) and steps < 400:
        scaled, steps = scaled * 10, steps + 1
    return int(scaled) if math.isfinite(scaled) else 10**400


def llguidance_multiple_too_costly(value: Any) -> bool:
    """Whether llguidance must not be given ``multipleOf: value`` (see
    :data:`LLGUIDANCE_MULTIPLE_LIMIT`)."""
    return llguidance_multiple(value) > LLGUIDANCE_MULTIPLE_LIMIT


def _llguidance_uncompilable(node: dict[str, Any]) -> frozenset[str]:
    """``BackendProfile.uncompilable`` of llguidance: a ``multipleOf`` past its limit, a number
    it cannot read, ``patternProperties`` whose patterns may match one name together (it
    refuses them: "patternProperty regexes /^a/ and /b$/ are not disjoint"), and with them an
    ``additionalProperties`` other than ``true``: kept alone it would also take the names the
    patterns matched, a narrower language, which broke :func:`compile._refuse_if_empty`'s
    premise (``required: [a]`` beside ``^[ab]$`` was called unsatisfiable on every backend)."""
    costly = llguidance_multiple_too_costly(node.get("multipleOf"))
    unread = {k for k in NUMERIC & node.keys() if _past_float64(node[k])}
    if "patternProperties" in node and patterns_may_overlap(node["patternProperties"]):
        unread.add("patternProperties")
        if node.get("additionalProperties", True) is not True:
            unread.add("additionalProperties")
    if _optional_listed(node):  # "min/maxProperties only supported when all keys listed in
        # "properties" are required": the nodes property_counts could not rewrite (too many)
        unread |= {"minProperties", "maxProperties"} & node.keys()
    return frozenset(unread | ({"multipleOf"} if costly else set())) | _uncompilable_pattern(node)


def _optional_listed(node: dict[str, Any]) -> bool:
    """Whether ``node`` lists a property (not as ``false``) that it does not require."""
    listed, required = node.get("properties"), node.get("required", [])
    if not isinstance(listed, dict) or not isinstance(required, list):
        return False
    return any(name not in required and sub is not False for name, sub in listed.items())


def patterns_may_overlap(named: Any) -> bool:
    """Whether two names of a ``patternProperties`` object may match one property name (not
    proven apart, ``regular.patterns_meet``)."""
    return isinstance(named, dict) and _names_overlap(tuple(str(name) for name in named))


@functools.lru_cache(maxsize=512)
def _names_overlap(names: tuple[str, ...]) -> bool:
    """:func:`patterns_may_overlap` per tuple of names: asked once per keyword of the node
    (``BackendProfile.uncompilable``), and each pair is an automaton product."""
    from espalier.constrained.schema.regular import patterns_meet

    return any(
        patterns_meet((a, b)) is not False for i, a in enumerate(names) for b in names[i + 1 :]
    )


def _llguidance_rule(keyword: str, node: dict[str, Any]) -> Support:
    if keyword == "pattern" and _llguidance_misreads(str(node["pattern"])):
        return Support.WEAKENED
    names = node[keyword] if keyword == "patternProperties" else None
    if isinstance(names, dict) and any(_llguidance_misreads(str(name)) for name in names):
        return Support.WEAKENED  # the same reading of a property name
    if keyword in ("const", "enum") and _integer_outside(node[keyword], _float64_exact):
        return Support.WEAKENED  # read as float64: 2**53 + 1 written 2**53 ("const-past-2**53")
    if keyword in NUMERIC and keyword != "multipleOf":
        value = node[keyword]
        if isinstance(value, (int, float)) and abs(value) > _FLOAT64_EXACT_INT:
            return Support.WEAKENED  # compared as float64: neighbours of the bound collapse
        if exclusive_whole_bound_within_one(node):
            return Support.WEAKENED  # (0, 0.5] took 0 (probe "exclusiveMinimum-whole-within-one")
    return Support.EXACT


def _float64_exact(n: int) -> bool:
    """Whether a float64 holds ``n`` exactly (``2**53 + 1`` it does not)."""
    return float(n) == n


def _integer_outside(value: Any, exact: Callable[[int], bool]) -> bool:
    """Whether ``value`` (a JSON value) holds, at any depth, an integer ``exact`` is False for
    (every integer from 2**1024 on: no float64 holds it)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) >= 2**1024 or not exact(value)
    if isinstance(value, list):
        return any(_integer_outside(item, exact) for item in value)
    if isinstance(value, dict):
        return any(_integer_outside(item, exact) for item in value.values())
    return False


_INT64 = (-(2**63), 2**63 - 1)
"""xgrammar writes a ``const`` / ``enum`` integer exactly within int64, past it as a float
(``2**64 + 1`` as ``1.8446744073709552e+19``: probe "const-past-int64")."""
_OUTLINES_EXACT = (-(2**63), 2**64 - 1)
"""outlines-core's range of exact ``const`` / ``enum`` integers (probe "const-past-uint64")."""


def _within(bounds: tuple[int, int]) -> Callable[[int], bool]:
    return lambda n: bounds[0] <= n <= bounds[1]


def exclusive_whole_bound_within_one(node: dict[str, Any]) -> bool:
    """Whether a number's exclusive bound is a whole number ``k`` and the bound on the other
    side lies within 1 of it: llguidance's range then also takes the text ``k`` itself
    (``(0, 0.5]`` took ``0``, ``[-0.5, 0)`` took ``-0``, ``(3, 3.001]`` took ``3``)."""
    types = _types(node)
    if types and "number" not in types:
        return False
    for exclusive, others in (
        ("exclusiveMinimum", ("maximum", "exclusiveMaximum")),
        ("exclusiveMaximum", ("minimum", "exclusiveMinimum")),
    ):
        k = node.get(exclusive)
        if not is_number(k) or not float(k).is_integer():
            continue
        if any(is_number(node.get(o)) and abs(node[o] - k) < 1 for o in others):
            return True
    return False


TINY_BOUND = 1e-6
"""The smallest magnitude of a number's bound xgrammar reads: from about 1e-8 its range took the
empty text (``[1e-9, 1e-8]``: ``{"v": }``, ``[,]``)."""


def tiny_bound(node: dict[str, Any]) -> bool:
    """Whether a numeric bound of ``node`` is non-zero and smaller in magnitude than
    :data:`TINY_BOUND`."""
    return any(is_number(node.get(k)) and 0 < abs(node[k]) < TINY_BOUND for k in _BOUNDS)


_OUTLINES_COUNTS = frozenset({"minLength", "maxLength", "minItems", "maxItems"})
_OUTLINES_COUNT_LIMIT = 2**32
"""Counts from here on are not enforced by outlines-core: 2**31 to 2**63 fail its DFA build or
its memory limit, and from 2**64 it wraps the number and compiles (``"minItems": 2**64``
generates ``[]``)."""


def _outlines_rule(keyword: str, node: dict[str, Any]) -> Support:
    if keyword in ("const", "enum") and _integer_outside(node[keyword], _within(_OUTLINES_EXACT)):
        return Support.WEAKENED  # written as a float (probe "const-past-uint64")
    if beside_branches(keyword, node):
        return Support.IGNORED  # compiled as its branches alone (probe "pattern-beside-anyOf")
    if keyword in _OUTLINES_COUNTS:
        value = node[keyword]
        if isinstance(value, (int, float)) and value >= _OUTLINES_COUNT_LIMIT:
            return Support.IGNORED
    kind = TYPE_OF.get(keyword)
    types = _types(node)
    if kind is not None and (len(types) != 1 or kind not in types):
        return Support.IGNORED
    if kind == "string" and _string_groups(node) > 1:
        return Support.WEAKENED  # the sub-regexes are not intersected
    if keyword == "pattern" and may_match_escaped(str(node["pattern"])):
        return Support.WEAKENED  # read over the JSON text: "\\n" is two characters (probe)
    if keyword == "allOf" and len(node["allOf"]) != 1:
        return Support.WEAKENED
    if keyword == "allOf" and _beside_all_of(node):
        return Support.IGNORED  # the keywords beside it are compiled alone (probe
        # "allOf-beside-siblings": {"a": 1} passed a required "b" of the allOf)
    if keyword == "required" and required_outside_properties(node):
        return Support.WEAKENED  # probe "required-not-in-properties"
    if keyword in ("anyOf", "type") and _type_dropped_beside_branches(node, types):
        return Support.WEAKENED  # probes "anyOf-next-to-type", "type-beside-allOf"
    return Support.EXACT


# Keywords both llguidance and xgrammar enforce exactly (each claim has a probe test).
_EXACT_IN_JSON_BACKENDS = frozenset(
    {
        "type",
        "enum",
        "const",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "properties",
        "required",
        "additionalProperties",
        "minProperties",
        "maxProperties",
        "anyOf",
        "allOf",
        "$ref",
    }
)

LLGUIDANCE = BackendProfile(
    name="llguidance",
    exact=_EXACT_IN_JSON_BACKENDS | {"patternProperties"},
    # date / time / date-time / hostname: calendar and leap-second rules are not checked
    formats=frozenset({"email", "ipv4", "ipv6", "uri", "uuid", "duration"}),
    rule=_llguidance_rule,
    uncompilable=_llguidance_uncompilable,
    # "Unimplemented keys: [...]" (lenient=False), "Unknown format: ...", "oneOf constraints are
    # not supported" (overlapping branches; coerce_one_of off): probe test_weaken.py
    refused=frozenset(
        {
            "not",
            "if",
            "then",
            "else",
            "uniqueItems",
            "contains",
            "minContains",
            "maxContains",
            "propertyNames",
            "dependentRequired",
            "dependentSchemas",
            "dependencies",
            "unevaluatedProperties",
            "unevaluatedItems",
            "$dynamicRef",
            "$dynamicAnchor",
            "$recursiveRef",
            "$recursiveAnchor",
        }
    ),
    compiled_formats=frozenset(
        {
            "email",
            "ipv4",
            "ipv6",
            "uri",
            "uuid",
            "duration",
            "date-time",
            "date",
            "time",
            "hostname",
        }
    ),
    one_of_refused=True,
)
XGRAMMAR = BackendProfile(
    name="xgrammar",
    exact=_EXACT_IN_JSON_BACKENDS | {"propertyNames"},
    # not ipv4: its grammar takes leading zeros ("81.023.84.8"; probe format-ipv4)
    formats=frozenset(
        {
            "email",
            "uri",
            "uri-reference",
            "uri-template",
            "uuid",
            "duration",
            "json-pointer",
            "relative-json-pointer",
        }
    ),
    rule=_xgrammar_rule,
    uncompilable=_xgrammar_uncompilable,
    false_schema=False,  # refused at compile ("Schema 'false' cannot accept any value") ...
    # ... except as these keywords' values, where it means "nothing more" (probe tests)
    false_schema_under=frozenset({"additionalProperties", "items"}),
)
OUTLINES_CORE = BackendProfile(
    name="outlines_core",
    exact=frozenset(
        {
            "type",
            "enum",
            "const",
            "minLength",
            "maxLength",
            "pattern",
            "format",
            "items",
            "minItems",
            "maxItems",
            "properties",
            "required",
            "additionalProperties",
            "anyOf",
            "allOf",
        }
    ),
    formats=frozenset({"uuid"}),  # its email writes raw '"' (probe "format-email")
    # the formats it compiles into JSON strings (ipv4, hostname, ...: "not supported by
    # Outlines"; email and time wrote broken JSON: '"12:03:12\\y56Z"')
    compiled_formats=frozenset({"uuid", "date-time", "date"}),
    rule=_outlines_rule,
    uncompilable=_outlines_uncompilable,
    false_schema=False,
    # its objects hold the declared keys alone: "nothing more" is what it writes (probe test)
    false_schema_under=frozenset({"additionalProperties"}),
    false_schema_where=lambda keyword, node: isinstance(node.get("properties"), dict),
)
PROFILES: dict[str, BackendProfile] = {p.name: p for p in (LLGUIDANCE, XGRAMMAR, OUTLINES_CORE)}
