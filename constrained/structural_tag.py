"""Structural tags and reasoning: free text where the caller allows it, a constraint exactly inside.

The format is xgrammar's structural tag (``{"type": "structural_tag", "format": {...}}``, a tree
of formats: ``const_string``, ``json_schema``, ``regex``, ``grammar``, ``sequence``, ``or``,
``tag``, ``any_text``, ``triggered_tags``, ...). The legacy form that vLLM and SGLang accept
(``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}``)
is the ``triggered_tags`` format with JSON-schema contents, and is rewritten into it.

Reasoning is a structural tag too: free text up to the model's reasoning end marker, then the
request's constraint (:func:`after_reasoning`), so masks, tree walks and forced chains need no
special case at the switch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from espalier.constrained import json_text
from espalier.constrained.errors import InvalidGrammarError
from espalier.constrained.spec import (
    DEFAULT_MAX_GRAMMAR_BYTES,
    MAX_SHORTEST_TEXT,
    GrammarKind,
    GrammarSpec,
    check_size,
)

KIND = GrammarKind.STRUCTURAL_TAG.value
Format = dict[str, Any]
# format type -> the keys holding child formats (a list of formats or one format)
_CHILDREN: dict[str, tuple[str, ...]] = {
    "sequence": ("elements",),
    "or": ("elements",),
    "tag": ("content",),
    "triggered_tags": ("tags",),
    "token_triggered_tags": ("tags",),
    "tags_with_separator": ("tags",),
    "optional": ("content",),
    "plus": ("content",),
    "star": ("content",),
    "repeat": ("content",),
}


def canonical_source(value: dict[str, Any] | str) -> str:
    """The canonical text of a structural tag given as JSON text or an object (legacy form
    rewritten); raises InvalidGrammarError naming the first problem."""
    if isinstance(value, str):
        try:
            value = json_text.loads(value)
        except json_text.JSONTextError as exc:
            raise InvalidGrammarError(
                KIND,
                f"structural tag is not valid JSON: {exc.msg}",
                line=exc.line,
                column=exc.column,
            ) from exc
    if not isinstance(value, dict):
        raise InvalidGrammarError(KIND, "a structural tag must be a JSON object", pointer="")
    if "structures" in value:
        value = _from_legacy(value)
    from xgrammar.structural_tag import StructuralTag

    try:
        parsed = StructuralTag.model_validate(value)
    except ValueError as exc:  # pydantic's ValidationError (xgrammar's model is pydantic)
        errors = getattr(exc, "errors", None)
        if errors is None:
            raise InvalidGrammarError(KIND, str(exc)) from None
        first = errors()[0]
        where = "/" + "/".join(str(part) for part in first["loc"])
        raise InvalidGrammarError(KIND, f"{where}: {first['msg']}", pointer=where) from None
    dumped = parsed.model_dump(mode="json", by_alias=True, exclude_unset=True)
    dumped["type"] = "structural_tag"
    return json.dumps(dumped, separators=(",", ":"), ensure_ascii=False)


def _from_legacy(value: dict[str, Any]) -> dict[str, Any]:
    structures = value.get("structures")
    triggers = value.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list):
        raise InvalidGrammarError(
            KIND, "legacy structural tag needs 'structures' and 'triggers' lists", pointer=""
        )
    tags = []
    for i, item in enumerate(structures):
        if not isinstance(item, dict) or not {"begin", "schema", "end"} <= item.keys():
            raise InvalidGrammarError(
                KIND, f"structures[{i}] needs 'begin', 'schema' and 'end'", pointer=f"/{i}"
            )
        content = {"type": "json_schema", "json_schema": item["schema"]}
        tags.append({"type": "tag", "begin": item["begin"], "content": content, "end": item["end"]})
    fmt = {"type": "triggered_tags", "triggers": triggers, "tags": tags}
    return {"type": "structural_tag", "format": fmt}


def root_format(spec: GrammarSpec) -> Format:
    """The top format of a STRUCTURAL_TAG spec."""
    assert spec.kind is GrammarKind.STRUCTURAL_TAG
    value: Format = json.loads(spec.source)["format"]
    return value


def with_format(fmt: Format) -> GrammarSpec:
    """A STRUCTURAL_TAG spec whose top format is ``fmt`` (already valid: no re-validation)."""
    text = json.dumps(
        {"type": "structural_tag", "format": fmt}, separators=(",", ":"), ensure_ascii=False
    )
    return GrammarSpec(GrammarKind.STRUCTURAL_TAG, text)


def map_json_schemas(
    fmt: Format, change: Callable[[Format, str], Format], pointer: str = "/format"
) -> Format:
    """A copy of ``fmt`` with each ``json_schema`` format replaced by ``change(node, pointer)``
    (``pointer``: the node's JSON pointer in the structural tag)."""
    return map_formats(fmt, ("json_schema", "qwen_xml_parameter"), change, pointer)


def map_regexes(
    fmt: Format, change: Callable[[Format, str], Format], pointer: str = "/format"
) -> Format:
    """A copy of ``fmt`` with each ``regex`` format replaced by ``change(node, pointer)``."""
    return map_formats(fmt, ("regex",), change, pointer)


def map_formats(
    fmt: Format,
    types: tuple[str, ...],
    change: Callable[[Format, str], Format],
    pointer: str = "/format",
) -> Format:
    """A copy of ``fmt`` with each format of one of ``types`` replaced by ``change(node,
    pointer)`` (``pointer``: the node's JSON pointer in the structural tag)."""
    if fmt.get("type") in types:
        return change(fmt, pointer)
    out = dict(fmt)
    kind = fmt.get("type", "tag" if "content" in fmt else None)  # a tag list's tags: untyped
    for key in _CHILDREN.get(str(kind), ()):
        child = fmt.get(key)
        if isinstance(child, list):
            out[key] = [
                map_formats(c, types, change, f"{pointer}/{key}/{i}") for i, c in enumerate(child)
            ]
        elif isinstance(child, dict):
            out[key] = map_formats(child, types, change, f"{pointer}/{key}")
    if fmt.get("type") == "dispatch":
        out["rules"] = [
            [trigger, map_formats(child, types, change, f"{pointer}/rules/{i}/1")]
            for i, (trigger, child) in enumerate(fmt.get("rules", []))
        ]
    return out


_FREE_TEXT = ("any_text", "triggered_tags", "token_triggered_tags", "dispatch")
"""Format types that let text outside any grammar through (between or before their tags)."""


def has_free_text(spec: GrammarSpec) -> bool:
    """Whether ``spec`` lets some text through unconstrained: a structural tag with
    ``any_text`` (reasoning before its end marker) or tags triggered within free text."""
    if spec.kind is not GrammarKind.STRUCTURAL_TAG:
        return False
    found: list[str] = []

    def note(node: Format, pointer: str) -> Format:
        found.append(pointer)
        return node

    map_formats(root_format(spec), _FREE_TEXT, note)
    return bool(found)


def format_of(spec: GrammarSpec) -> Format:
    """``spec`` as a structural-tag format matching exactly the same text."""
    kind = spec.kind
    if kind is GrammarKind.STRUCTURAL_TAG:
        return root_format(spec)
    if kind is GrammarKind.JSON_SCHEMA:
        return {"type": "json_schema", "json_schema": spec.schema}
    if kind is GrammarKind.ANY_JSON:
        return {"type": "json_schema", "json_schema": {}}
    if kind is GrammarKind.REGEX:
        return {"type": "regex", "pattern": spec.source}
    if kind in (GrammarKind.EBNF, GrammarKind.LARK):
        syntax = "ebnf" if kind is GrammarKind.EBNF else "lark"
        return {"type": "grammar", "grammar": spec.source, "syntax": syntax}
    assert kind is GrammarKind.CHOICE
    options = [{"type": "const_string", "value": option} for option in spec.choices]
    return {"type": "or", "elements": options}


def after_reasoning(spec: GrammarSpec, end_marker: str) -> GrammarSpec:
    """``spec`` preceded by free text up to and including the first ``end_marker``.

    Before the marker any text (tokens unconstrained, except that the marker ends it); right
    after it, exactly ``spec``. The marker is matched as text: a marker that is a special token
    of the vocabulary is never produced by text tokens, so the caller maps it to its spelling.
    """
    if not end_marker:
        raise InvalidGrammarError(KIND, "the reasoning end marker is empty")
    return with_format({"type": "sequence", "elements": [_thought(end_marker), format_of(spec)]})


def _thought(end_marker: str) -> Format:
    """The free text of :func:`after_reasoning`, up to and including ``end_marker``."""
    return {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": end_marker}


def reasoning_end(spec: GrammarSpec) -> str | None:
    """The end marker when ``spec`` is :func:`after_reasoning`'s shape (free text up to the
    marker, then a grammar), else None."""
    if spec.kind is not GrammarKind.STRUCTURAL_TAG:
        return None
    fmt = json.loads(spec.source).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") != "sequence":
        return None
    elements = fmt.get("elements")
    if not isinstance(elements, list) or len(elements) != 2 or not isinstance(elements[0], dict):
        return None
    end = elements[0].get("end")
    return end if isinstance(end, str) and end and elements[0] == _thought(end) else None


@dataclass(frozen=True)
class Framing:
    """Where the JSON values of a structural tag's output start (``keys.c``'s frames).

    gate: text whose first occurrence comes before any value (the reasoning end marker, a
    leading ``const_string``; "" none). begins: after the gate, each value follows the first
    occurrence of one of these (tag begins); none: the value follows the gate at once (both
    empty: the output is the value). rearm: after a value, the next begin is looked for again
    (a tag list); else nothing after the first value is read. schemas: the values' schemas.
    """

    gate: str
    begins: tuple[str, ...]
    rearm: bool
    schemas: tuple[Any, ...]


def json_framing(spec: GrammarSpec) -> Framing | None:
    """The :class:`Framing` of ``spec``'s JSON values when every value's start is found that
    way: a root ``json_schema``; a ``tag`` around one; a ``triggered_tags`` or
    ``tags_with_separator`` list whose tags all hold one, where no text between values can spell
    or start a begin (:func:`_tag_list_framing`); or a two-element ``sequence`` of
    :func:`after_reasoning`'s free text or a ``const_string``, then one of those. None for other
    shapes (where a value may start is the grammar's choice). Why: the duplicate-key tracker
    reads exactly those values (``constrained/keys``)."""
    fmt = root_format(spec)
    inner = _value_framing(fmt)
    if inner is not None:
        return inner
    elements = fmt.get("elements")
    if fmt.get("type") != "sequence" or not isinstance(elements, list) or len(elements) != 2:
        return None
    first, rest = elements
    if not isinstance(rest, dict) or (inner := _value_framing(rest)) is None:
        return None
    gate = reasoning_end(spec)
    if gate is None and isinstance(first, dict) and first.get("type") == "const_string":
        gate = first.get("value")
    if not isinstance(gate, str) or not gate:
        return None
    return Framing(gate, inner.begins, inner.rearm, inner.schemas)


def _value_framing(fmt: Format) -> Framing | None:
    """The framing of a JSON value, a tag around one, or a tag list of them, with no gate."""
    if _json_content(fmt):
        return Framing("", (), False, (fmt.get("json_schema"),))
    if fmt.get("type") == "tag":
        begin = fmt.get("begin")
        if isinstance(begin, str) and begin and _json_content(fmt.get("content")):
            return Framing("", (begin,), False, (fmt["content"].get("json_schema"),))
        return None
    if fmt.get("type") in ("triggered_tags", "tags_with_separator"):
        return _tag_list_framing(fmt)
    return None


def _json_content(fmt: Any) -> bool:
    """A ``json_schema`` format whose text is JSON (style ``json``)."""
    return (
        isinstance(fmt, dict)
        and fmt.get("type") == "json_schema"
        and fmt.get("style", "json") == "json"
    )


def _tag_list_framing(fmt: Format) -> Framing | None:
    """A tag list's framing, when a scan for the begins finds each tag's begin where it ends and
    nowhere else. Between two values there is the first one's ``end``, then free text with no
    trigger (``triggered_tags``) or the ``separator`` (``tags_with_separator``). So: no begin
    holds another; no ``end`` holds a trigger or ends with the start of one (a trigger written
    across it and the free text after it is not one to the grammar); no begin starting in free
    text and running into the next begin ends before that begin does; and ``end + separator +
    begin`` shows a begin first where it ends."""
    tags = fmt.get("tags")
    if not isinstance(tags, list) or not tags:
        return None
    begins: list[str] = []
    ends: list[str] = []
    schemas: list[Any] = []
    for tag in tags:
        if not isinstance(tag, dict) or not _json_content(tag.get("content")):
            return None
        begin, end = tag.get("begin"), tag.get("end")
        if not isinstance(begin, str) or not begin or not isinstance(end, str):
            return None
        begins.append(begin)
        ends.append(end)
        schemas.append(tag["content"].get("json_schema"))
    unique = tuple(dict.fromkeys(begins))
    if any(a != b and a in b for a in unique for b in unique):
        return None
    if fmt.get("type") == "triggered_tags":
        triggers = fmt.get("triggers")
        if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
            return None
        for end in ends:
            for trigger in triggers:
                if trigger in end or any(trigger.startswith(end[k:]) for k in range(len(end))):
                    return None
        for fake in unique:  # starts in free text, runs into ``real``'s first characters
            for real in unique:
                if any(
                    len(fake) - k < len(real) and real.startswith(fake[k:])
                    for k in range(1, len(fake))
                ):
                    return None
        between = [end + begin for end in ends for begin in unique]
    else:
        separator = fmt.get("separator")
        if not isinstance(separator, str):
            return None
        between = [end + separator + begin for end in ends for begin in unique]
    for text in between:
        first = min((text.find(b) + len(b) for b in unique if b in text), default=-1)
        if first != len(text):
            return None
    return Framing("", unique, True, tuple(schemas))


def structural_tag_spec(
    tag: dict[str, Any] | str, max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
) -> GrammarSpec:
    """A STRUCTURAL_TAG spec from xgrammar's structural-tag JSON (text or object), in its
    canonical text; raises InvalidGrammarError on bad JSON, a format that is not a valid
    structural tag, or a text over ``max_bytes``."""
    if isinstance(tag, str):
        check_size(GrammarKind.STRUCTURAL_TAG, tag, max_bytes)
    text = canonical_source(tag)
    check_size(GrammarKind.STRUCTURAL_TAG, text, max_bytes)
    return GrammarSpec(GrammarKind.STRUCTURAL_TAG, text)


def json_whitespace(node: Format, default: int) -> int:
    """Whitespace characters a ``json_schema`` node allows between JSON tokens: its own
    ``max_whitespace_cnt``, else ``default`` (xgrammar needs at least 1 inside a structural tag,
    so compact-only is not expressible there and 1 is the floor for every backend)."""
    given = node.get("max_whitespace_cnt")
    return max(1, int(given) if given is not None else default)


def repeat_and_length(fmt: Format) -> tuple[int, int]:
    """The most copies of one leaf the ``repeat`` counts around it ask for (the product of the
    larger bounds, as ``regex_dialect.repeat_size``; ``regex`` leaves count their own), and a
    lower bound on the characters of the shortest text of ``fmt`` (its literals: ``begin`` /
    ``end`` and ``const_string`` values, a ``repeat``'s ``min`` copies; any other leaf counts as
    empty). Why: four nested repeats of 100 (10**8 copies) or one of ``min`` 5,000,000 were
    written out by the backend until the engine was killed for memory."""
    from espalier.constrained.regex_dialect import repeat_size

    kind = fmt.get("type", "tag" if "content" in fmt else None)
    children: list[Format] = []
    for key in _CHILDREN.get(str(kind), ()):
        value = fmt.get(key)
        listed = value if isinstance(value, list) else [value]
        children += [c for c in listed if isinstance(c, dict)]
    if kind == "dispatch":
        children += [rule[1] for rule in fmt.get("rules", []) if isinstance(rule[1], dict)]
    sizes = [repeat_and_length(child) for child in children]
    copies = max((c for c, _ in sizes), default=1)
    lengths = [n for _, n in sizes]
    if kind == "const_string":
        return 1, len(str(fmt.get("value", "")))
    if kind == "regex":
        return repeat_size(str(fmt.get("pattern", ""))), 0
    if kind == "repeat":
        low, high = int(fmt.get("min", 0)), int(fmt.get("max", -1))
        return max(low, high, 1) * copies, low * sum(lengths)
    if kind == "tag":
        return copies, len(str(fmt.get("begin", ""))) + sum(lengths) + len(str(fmt.get("end", "")))
    if kind in ("sequence", "plus"):
        return copies, sum(lengths)
    if kind == "or":
        return copies, min(lengths, default=0)
    return copies, 0  # optional, star, free text, tag lists, schemas, grammars


def admit_structural_tag(
    text: str, max_depth: int, max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
) -> GrammarSpec:
    """A caller's structural-tag text checked as a caller's schema is (nesting depth before
    parsing, then each inner schema against its meta-schema, local ``$ref`` only), its inner
    grammars and regexes as grammar and regex constraints are (regexes respelled for the
    backends: ``GrammarSpec.regex``); raises InvalidGrammarError."""
    from espalier.constrained.regex_dialect import MAX_REPEAT
    from espalier.constrained.schema.guard import check_schema, json_depth

    depth = json_depth(text)
    if depth > max_depth:
        raise InvalidGrammarError(
            KIND, f"the structural tag is nested {depth} levels deep, over the limit of {max_depth}"
        )
    try:
        spec = structural_tag_spec(text, max_bytes)
    except RecursionError as exc:  # brackets inside strings can fool json_depth
        raise InvalidGrammarError(KIND, "the structural tag is nested too deeply") from exc

    def check(node: Format, pointer: str) -> Format:
        schema = node.get("json_schema")
        if isinstance(schema, (dict, bool)):
            check_schema(schema)
        return node

    def check_regex(node: Format, pointer: str) -> Format:
        try:  # read, and spelled for the backends, as a regex constraint is
            pattern = GrammarSpec.regex(str(node.get("pattern", "")), max_bytes).source
        except InvalidGrammarError as exc:
            where = f" (column {exc.column})" if exc.column is not None else ""
            raise InvalidGrammarError(KIND, exc.detail + where, pointer=pointer) from None
        return {**node, "pattern": pattern}

    def check_grammar(node: Format, pointer: str) -> Format:
        text = str(node.get("grammar", ""))
        lark = node.get("syntax", "ebnf") == "lark"
        try:  # checked as a grammar constraint is (repeats, emptiness, shortest text)
            GrammarSpec.lark(text, max_bytes) if lark else GrammarSpec.ebnf(text, max_bytes)
        except InvalidGrammarError as exc:
            raise InvalidGrammarError(KIND, exc.detail, pointer=pointer) from None
        return node

    fmt = root_format(spec)  # read once: the checks below copy, never change it
    copies, shortest = repeat_and_length(fmt)
    if copies > MAX_REPEAT or shortest > MAX_SHORTEST_TEXT:
        raise InvalidGrammarError(
            KIND,
            f"its repeats ask for {copies} copies of one item and a shortest text of at least "
            f"{shortest} characters (limits: {MAX_REPEAT} copies, {MAX_SHORTEST_TEXT} "
            "characters; nested repeats multiply)",
            pointer="/format",
        )
    map_json_schemas(fmt, check)
    map_formats(fmt, ("grammar",), check_grammar)
    respelled = map_regexes(fmt, check_regex)
    return spec if respelled == fmt else with_format(respelled)
