"""Probe tests of the rewrites built on the ``pattern`` algebra (:mod:`regular`): ``not`` of a
pattern, ``oneOf`` / ``if`` needing a pattern's complement, ``oneOf`` of patterns with no common
string. ``jsonschema`` (the post-validator) gives every random instance a verdict on the
rewritten schema between its verdicts on the original (:func:`within`: valid where both readings
of ``\\d`` / ``\\w`` / ``\\s``, its own, Unicode, and ECMA-262's, ASCII, take it, invalid where
its own refuses it), the rewrite removed the keyword, and llguidance (the backend ``auto``
picks for them) accepts within the same bounds."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from espalier.constrained.backends import get_backend
from espalier.constrained.compile import compile_grammar
from espalier.constrained.conformance import grammar_accepts
from espalier.constrained.postvalidate import validate_instance
from espalier.constrained.schema.features import backend_issues
from espalier.constrained.schema.refs import resolve_refs
from espalier.constrained.schema.rewrite import normalize_schema
from espalier.constrained.schema.walk import walk
from espalier.constrained.spec import GrammarSpec

STRING_POOL = [*"ab1590+=.$/:-_xZé ", "\n", "\u0660", "😀"]
OTHERS = (None, True, 0, 2.5, [], {"a": "b"})


def random_instance(rng: random.Random, extra: str) -> Any:
    if rng.random() < 0.1:
        return rng.choice(OTHERS)
    pool = STRING_POOL + list(extra)
    return "".join(rng.choice(pool) for _ in range(rng.randrange(7)))


def ascii_read(schema: Any) -> Any:
    """``schema`` with every pattern read with ASCII classes (``(?a)``: ECMA-262's ``\\d``,
    ``\\w``)."""
    if isinstance(schema, list):
        return [ascii_read(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: ascii_read(value) for key, value in schema.items()}
    if isinstance(schema.get("pattern"), str):
        out["pattern"] = "(?a)" + schema["pattern"]
    if isinstance(schema.get("patternProperties"), dict):
        out["patternProperties"] = {
            "(?a)" + name: ascii_read(value) for name, value in schema["patternProperties"].items()
        }
    return out


def valid_both(schema: Any, value: Any) -> bool:
    """The post-validator's verdict under both readings of the classes (``regular.BOTH_READINGS``:
    what a printed pattern keeps)."""
    return (
        validate_instance(schema, value).valid
        and validate_instance(ascii_read(schema), value).valid
    )


def within(schema: Any, value: Any, valid: bool) -> bool:
    """Whether ``valid`` (a rewrite's or a backend's verdict on ``value``) lies between the
    original's verdicts: true where both readings of the classes take ``value`` (a pattern
    printed from the algebra keeps what they agree on), false where the post-validator refuses
    it (a pattern left as written keeps the post-validator's reading). A string holding a
    control character may be refused too (``respell.respell_wider`` leaves them out)."""
    if valid:
        return validate_instance(schema, value).valid
    controls = isinstance(value, str) and any(ord(c) < 0x20 for c in value)
    return controls or not valid_both(schema, value)


def rewrite(schema: Any) -> Any:
    return normalize_schema(resolve_refs(schema).schema)


def keywords(schema: Any) -> set[str]:
    return {k for node in walk(schema) if isinstance(node.schema, dict) for k in node.schema}


SCHEMAS = [
    {"not": {"pattern": "^a+$"}},
    {"type": "string", "not": {"pattern": "[0-9]"}},
    {"not": {"pattern": "^x", "maxLength": 3}},
    {"not": {"type": "string", "pattern": r"(\+)\w+"}},
    {"type": "string", "oneOf": [{"pattern": "^a"}, {"pattern": "b$"}]},
    {"oneOf": [{"pattern": r"^[0-9]+$"}, {"pattern": "^[a-z]+$"}], "type": "string"},
    {"oneOf": [{"type": "string", "pattern": "5"}, {"type": "string", "maxLength": 2}]},
    {"if": {"pattern": "^a"}, "then": {"maxLength": 2}, "else": {"minLength": 1}},
    {"type": "string", "not": {"anyOf": [{"pattern": "^a"}, {"pattern": "^b"}]}},
    {"oneOf": [{"pattern": r"^\d{2}$"}, {"pattern": r"^[a-f\d]{2}$"}]},
    {"oneOf": [{"enum": ["a+", "b"]}, {"enum": ["x"]}, {"type": "string", "pattern": r"(\+)\w+"}]},
    {"oneOf": [{"const": "a+b"}, {"type": "string", "pattern": r"(\+)\w+"}]},
    # left alone before the algebra (tests/constrained/test_rewrite_probes.py now uses lookaheads)
    {"type": "object", "oneOf": [{"properties": {"a": {"pattern": "x"}}},
                                 {"properties": {"a": {"pattern": "y"}}}]},
    {"type": "string", "oneOf": [{"pattern": "^ab?c"}, {"pattern": "^a"}]},
    {"type": "string", "oneOf": [{"pattern": "^a|^b"}, {"pattern": "^b"}]},
    {"type": "string", "oneOf": [{"pattern": "a"}, {"pattern": "^b"}]},
    {"oneOf": [{"type": "string"}, {"type": "string", "pattern": "^a"}]},
    # complements said only on strings as long as a sibling minLength asks ("" and "\n")
    {"type": "string", "minLength": 1, "not": {"pattern": r"^[\.\,\*\\\-\s\{\}\(\)]+$"}},
    {"minLength": 2, "not": {"pattern": r"^\s*$"}},
    {"minLength": 1, "if": {"pattern": r"^\s+$"}, "then": {"maxLength": 3},
     "else": {"pattern": "a"}},
    {"type": "string", "minLength": 1,
     "not": {"anyOf": [{"pattern": r"^\s+$"}, {"pattern": "^b"}]}},
]  # fmt: skip


@pytest.mark.parametrize("schema", SCHEMAS, ids=[json.dumps(s)[:60] for s in SCHEMAS])
def test_pattern_complements_keep_the_verdicts(schema: dict[str, Any]) -> None:
    rewritten = rewrite(schema)
    assert not {"not", "oneOf", "if"} & keywords(rewritten), rewritten
    rng = random.Random(5)
    extra = json.dumps(schema)
    bad = []
    for _ in range(500):
        value = random_instance(rng, extra)
        if not within(schema, value, validate_instance(rewritten, value).valid):
            bad.append(value)
    assert bad == []


@pytest.mark.parametrize("schema", SCHEMAS[:6], ids=[json.dumps(s)[:60] for s in SCHEMAS[:6]])
def test_llguidance_accepts_exactly_the_valid_strings(
    schema: dict[str, Any], toy_tokenizer: Any
) -> None:
    rewritten = rewrite(schema)
    assert backend_issues("llguidance", rewritten) == []
    compiled = get_backend("llguidance", toy_tokenizer).compile(GrammarSpec.json_schema(rewritten))
    rng = random.Random(9)
    for _ in range(60):
        value = random_instance(rng, "")
        if not isinstance(value, str):
            continue
        accepted = grammar_accepts(compiled, toy_tokenizer, json.dumps(value, ensure_ascii=False))
        # a string ending in a newline is the only kind the backend may reject though valid
        # (the post-validator's "$" takes one final newline, the backends' does not)
        assert within(schema, value, accepted) or value.endswith("\n"), value


def test_overlapping_patterns_whose_complement_cannot_be_spelled_stay_refused() -> None:
    schema = {"oneOf": [{"pattern": r"^[a-z]{1,200}$"}, {"pattern": "^a"}]}
    assert "oneOf" in keywords(rewrite(schema))
    schema = {"not": {"pattern": r"(?=a)b"}}  # lookahead: not read, never approximated
    assert "not" in keywords(rewrite(schema))


RESPELLED = [
    {"type": "string", "pattern": r"^(\/?((\.{2})|([a-z0-9\-]*))($|\/))*$"},
    {"type": "string", "pattern": r"^.+\<.+@.+\..+\>$"},
    {"type": "string", "pattern": r"^(?!a\.b\.)([a-z_$][a-z\d_$]*\.)*[a-z_$][a-z\d_$]*$"},
    {"type": "string", "pattern": r"((?:[^/]*/)*)(?=\.(yaml|yml|json))"},
    {"type": "string", "pattern": r"^(?![ \t\n]*\(default(.*)\))[\s\S]*"},
    {"pattern": r"^(?![a|A][b|B])"},
    {"pattern": r"a^b"},  # no string: "not a string"
    {"type": "object", "patternProperties": {r"^$[a-z$_]*$": {"type": "integer"},
                                             r"^_[a-z]*$": {"type": "string"}}},
]  # fmt: skip


@pytest.mark.parametrize("schema", RESPELLED, ids=[json.dumps(s)[:60] for s in RESPELLED])
def test_patterns_the_backends_read_otherwise_are_respelled_exactly(
    schema: dict[str, Any], toy_tokenizer: Any
) -> None:
    rewritten = rewrite(schema)
    assert rewritten != schema
    assert backend_issues("llguidance", rewritten) == []
    compiled = get_backend("llguidance", toy_tokenizer).compile(GrammarSpec.json_schema(rewritten))
    rng = random.Random(4)
    extra = json.dumps(schema) + "yaml.json"
    bad = []
    for _ in range(400):
        value = random_instance(rng, extra)
        if "patternProperties" in schema and isinstance(value, str):
            value = {value: rng.choice([1, "x"])}
        if not within(schema, value, validate_instance(rewritten, value).valid):
            bad.append(value)
        accepted = grammar_accepts(compiled, toy_tokenizer, json.dumps(value, ensure_ascii=False))
        if accepted and not validate_instance(schema, value).valid:
            bad.append(value)
    assert bad == []


SEARCHED = ["a+", "^a+", "a+$", "a|^b", "^b$|c", r"\$", r"a\$", "^", "$", "", "[$^]x",
            "(?:a|b)$", r"a\\$", "foo|", "^a|b$|^c$", "ab?c", "x*", "(a)(b|c)"]  # fmt: skip


@pytest.mark.parametrize("pattern", SEARCHED)
def test_open_ends_spell_the_searched_language(pattern: str) -> None:
    import itertools

    import regex

    from espalier.constrained.schema.respell import with_open_ends

    spelled = with_open_ends(pattern)
    assert spelled is not None and spelled.startswith("^") and spelled.endswith("$")
    for n in range(5):
        for chars in itertools.product("ab$^\\cx", repeat=n):
            text = "".join(chars)
            assert (regex.search(pattern, text) is not None) == (
                regex.fullmatch(spelled, text) is not None
            ), text


@pytest.mark.parametrize("pattern", ["^a+$", "^$", "(a|^b)", "a^b", r"\Aa", "(?i)a", "(a$)"])
def test_open_ends_leave_anchored_or_unread_patterns(pattern: str) -> None:
    from espalier.constrained.schema.respell import with_open_ends

    assert with_open_ends(pattern) is None


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "a+"},
        {"type": "string", "pattern": "^x|y$"},
        {"type": "object", "properties": {"k": {"type": "string", "pattern": "b$"}},
         "required": ["k"], "additionalProperties": False},
        {"type": "array", "items": {"type": "string", "pattern": "[0-9]"}},
    ],
)  # fmt: skip
def test_xgrammar_reads_patterns_as_searches(schema: dict[str, Any], toy_tokenizer: Any) -> None:
    # xgrammar reads a pattern as a full match: "a+" refused "xay" before its ends were opened
    compiled = get_backend("xgrammar", toy_tokenizer).compile(GrammarSpec.json_schema(schema))
    rng = random.Random(3)
    pool = "abxy19"
    seen = {True: 0, False: 0}
    for _ in range(300):
        text = "".join(rng.choice(pool) for _ in range(rng.randrange(1, 5)))
        kind = schema.get("type")
        value: Any = {"k": text} if kind == "object" else text
        value = [value] if kind == "array" else value
        valid = validate_instance(schema, value).valid
        accepted = grammar_accepts(compiled, toy_tokenizer, json.dumps(value))
        assert accepted == valid, value
        seen[valid] += 1
    assert seen[True] > 20 and seen[False] > 20, seen


WIDER = [
    {"type": "string", "pattern": r"^\W+$", "maxLength": 10},
    {"type": "string", "pattern": r"^\s+$"},
    {"type": "string", "pattern": r"^[^\w]+$"},
    {"type": "string", "pattern": r"^\S+@\S+$"},
    {"type": "string", "pattern": r"^\D{2}$"},
    {"not": {"pattern": r"^\s*$"}, "minLength": 1},  # complemented as written: not narrowed
]


@pytest.mark.parametrize("schema", WIDER, ids=[json.dumps(s)[:60] for s in WIDER])
def test_shorthands_the_backends_read_wider_are_printed_narrower(
    schema: dict[str, Any], toy_tokenizer: Any
) -> None:
    """A held-out sweep: ``^\\W+$`` wrote Thai and CJK letters (ECMA-262 and the backends'
    Rust regex call them ``\\W``, the post-validator does not) and ``^\\s+$`` wrote U+0085
    (not ECMA-262's ``\\s``). Such a pattern is printed from the algebra (both readings, no
    control characters), and llguidance accepts only what both readings take."""
    rewritten = rewrite(schema)
    assert backend_issues("llguidance", rewritten) == []
    compiled = get_backend("llguidance", toy_tokenizer).compile(GrammarSpec.json_schema(rewritten))
    rng = random.Random(6)
    pool = [*"ab1_@.+ é", "\n", "\t", "\u0085", "\u00a0", "ค", "目", "\u0660", "\u2028"]
    bad = []
    for _ in range(400):
        value = "".join(rng.choice(pool) for _ in range(rng.randrange(1, 5)))
        accepted = grammar_accepts(compiled, toy_tokenizer, json.dumps(value, ensure_ascii=False))
        if not within(schema, value, accepted):
            bad.append(value)
        if accepted and not valid_both(schema, value) and "not" not in schema:
            bad.append(value)
    assert bad == []


ESCAPE_CLASSES = [r'^[^"]+$', r"^[^\\]{1,4}$", r'^[^"\\]*$', r'^(?:[^"\\]|\\.)*$', r'^a[^"]*$']


@pytest.mark.parametrize("pattern", ESCAPE_CLASSES)
def test_classes_llguidance_reads_with_escapes_are_printed_without_controls(
    pattern: str, toy_tokenizer: Any
) -> None:
    """A held-out sweep: ``^[^"]+$`` ("no quotes") was refused on every backend (llguidance's
    reading of a class holding U+0000 and U+001F but not both ``"`` and ``\\`` took ``\\"``).
    It is printed from the algebra without control characters: llguidance takes exactly the
    valid strings that hold none."""
    schema = {"type": "string", "pattern": pattern}
    rewritten = rewrite(schema)
    assert backend_issues("llguidance", rewritten) == []
    compiled, report = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    assert report.backend == "llguidance"
    rng = random.Random(8)
    pool = [*'ab"\\é ', "\x01", "\x1f", "\n", "目"]
    seen = {True: 0, False: 0}
    for _ in range(300):
        value = "".join(rng.choice(pool) for _ in range(rng.randrange(0, 5)))
        accepted = grammar_accepts(compiled, toy_tokenizer, json.dumps(value, ensure_ascii=False))
        controls = any(ord(c) < 0x20 for c in value)
        assert accepted == (validate_instance(schema, value).valid and not controls), value
        seen[accepted] += 1
    assert seen[True] > 5 and seen[False] > 5, seen
