"""Every backend keyword claim in ``schema_features.PROFILES``, checked on the real backend.

A probe (``schema_probes.py``) compiles one schema directly on a backend (no rewrites) with a toy
byte-level tokenizer and pushes ``json.dumps`` of each instance through a matcher.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from espalier.constrained.backends import BACKENDS, BackendUnavailableError, get_backend
from espalier.constrained.base import CompileReport
from espalier.constrained.cache import CacheKey, CompileCache
from espalier.constrained.compile import compile_grammar
from espalier.constrained.conformance import grammar_accepts
from espalier.constrained.errors import CompileTimeoutError, GrammarError
from espalier.constrained.schema.features import (
    PROFILES,
    Support,
    backend_issues,
    class_set_syntax,
    escape_class_misread,
    keyword_support,
    llguidance_multiple,
    llguidance_multiple_too_costly,
)
from espalier.constrained.spec import GrammarSpec
from tests.constrained.schema_probes import OBJ_A, PROBES, Probe, as_text

CASES = [(b, p) for b in PROFILES for p in PROBES]


def claimed(backend: str, probe: Probe) -> Support:
    """The table's claim for the probe's keyword in the probe's root schema object."""
    return keyword_support(PROFILES[backend], probe.keyword, probe.schema)


PROBE_COMPILE_S = 60.0
"""A probe's compile limit. Past it the backend does not enforce the schema in service either
(its compiles end at ``CompileCache``'s limit, 10 s by default), so a compile that has not ended
counts as a refusal, as it would in service. (outlines-core built the Index of
"anyOf-next-to-type", whose ``{}`` branch is any JSON value, for 514 s on the 2-core machine.)"""


def compile_or_none(backend: str, schema: dict[str, Any], tokenizer: Any) -> Any:
    """The schema compiled on ``backend`` directly (no rewrites); None: refused, or not
    compiled within :data:`PROBE_COMPILE_S` (the backend's child is killed at that deadline)."""
    try:
        engine = get_backend(backend, tokenizer)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    spec = GrammarSpec.json_schema(schema)
    cache = CompileCache(workers=1, timeout_s=PROBE_COMPILE_S)
    key = CacheKey(spec.cache_key, backend, tokenizer.fingerprint)
    try:
        return cache.get(key, lambda: (engine.compile(spec), CompileReport(backend)))[0]
    except GrammarError:
        return None
    finally:
        cache.close()


@pytest.mark.parametrize(("backend", "probe"), CASES, ids=[f"{b}-{p.name}" for b, p in CASES])
def test_claim_holds(backend: str, probe: Probe, toy_tokenizer: Any) -> None:
    support = claimed(backend, probe)
    if support is not Support.EXACT and probe.cautious:
        return  # not claimed exact, no known counterexample: nothing to check
    compiled = compile_or_none(backend, probe.schema, toy_tokenizer)
    if support is Support.EXACT:
        assert compiled is not None, f"{backend} refuses a schema claimed exact"
        for value in probe.valid:
            text = as_text(value)
            assert grammar_accepts(compiled, toy_tokenizer, text), f"valid {text} rejected"
        for value in probe.invalid:
            text = as_text(value)
            assert not grammar_accepts(compiled, toy_tokenizer, text), f"invalid {text} accepted"
    elif not probe.cautious:
        leaks = compiled is None or any(
            grammar_accepts(compiled, toy_tokenizer, as_text(v)) for v in probe.invalid
        )
        if not leaks:  # conservative is allowed (never a false accept); make it visible
            pytest.skip(f"{backend} enforces '{probe.keyword}' here: the table is cautious")


@pytest.mark.parametrize("backend", list(PROFILES))
def test_every_exact_keyword_has_a_probe(backend: str) -> None:
    probed = {p.keyword for p in PROBES if claimed(backend, p) is Support.EXACT}
    assert PROFILES[backend].exact <= probed, PROFILES[backend].exact - probed


def test_profiles_cover_the_registered_backends() -> None:
    assert set(PROFILES) == set(BACKENDS)


def test_issues_name_keyword_pointer_and_support() -> None:
    schema = {"type": "array", "items": {"type": "string", "format": "email", "maxLength": 5}}
    issues = backend_issues("xgrammar", schema)
    assert {(i.keyword, i.pointer, i.support) for i in issues} == {
        ("format", "/items", "weakened"),
        ("maxLength", "/items", "weakened"),
    }
    assert backend_issues("llguidance", schema) == []


def test_untyped_keywords_are_not_exact_on_xgrammar_but_are_on_llguidance() -> None:
    schema = {"minimum": 2}
    assert [i.keyword for i in backend_issues("xgrammar", schema)] == ["minimum"]
    assert backend_issues("llguidance", schema) == []


def test_annotations_and_unknown_keywords_constrain_nothing() -> None:
    schema = {"type": "string", "title": "t", "x-vendor": {"anything": 1}, "default": "a"}
    for backend in PROFILES:
        assert backend_issues(backend, schema) == []


def test_unknown_dialect_is_not_exact() -> None:
    schema = {"$schema": "http://example.com/custom-metaschema", "type": "string"}
    for backend in PROFILES:
        assert [i.keyword for i in backend_issues(backend, schema)] == ["$schema"]


def test_false_subschema_support() -> None:
    schema = {"type": "object", "properties": {"a": False}}
    assert backend_issues("llguidance", schema) == []
    assert [i.keyword for i in backend_issues("xgrammar", schema)] == ["false"]


@pytest.mark.parametrize(
    ("pattern", "flagged"),
    [
        ("^a(?:x[0-9]+)?Z$", True),
        ("^(?:x(?:[0-9])+)?$", True),
        ("^a(x{2,})?$", True),
        ("^(?:[^]]*)?$", True),
        ("^a(?:x[0-9])?Z$", False),
        ("^a(?:[+*]x)?$", False),
        ("^a(?:x\\+)?$", False),
        ("^a(?:x[0-9]+|)Z$", False),
        ("^a(?:x[0-9]+){0,1}$", False),
        ("^(a+)$", False),
    ],
)
def test_optional_groups_holding_a_repetition_are_found(pattern: str, flagged: bool) -> None:
    from espalier.constrained.schema.features import optional_group_repeats

    assert optional_group_repeats(pattern) is flagged


XGRAMMAR_FALSE_PROBES = [
    (
        {**OBJ_A, "additionalProperties": False},
        [{"a": 1}, {}],
        ['{"b": 1}', '{"a": 1, "b": 2}', '{"a": 1, "a": 2}'],
    ),
    ({"type": "object", "additionalProperties": False}, [{}], ['{"a": 1}']),
    ({"type": "array", "items": False}, [[]], ["[1]", "[[]]"]),
    (
        {"type": "array", "prefixItems": [{"type": "integer"}], "items": False},
        [[1], []],
        ["[1, 2]", '[1, "a"]'],
    ),
]


def assert_exact_false(
    backend: str, schema: dict[str, Any], valid: list[Any], invalid: list[str], tokenizer: Any
) -> None:
    """``backend`` claims the schema's ``false`` exact, compiles it, and its grammar takes
    ``valid`` (values) and refuses ``invalid`` (texts)."""
    assert backend_issues(backend, schema) == []
    compiled = compile_or_none(backend, schema, tokenizer)
    assert compiled is not None
    for value in valid:
        assert grammar_accepts(compiled, tokenizer, json.dumps(value)), value
    for text in invalid:
        assert not grammar_accepts(compiled, tokenizer, text), text


@pytest.mark.parametrize(("schema", "valid", "invalid"), XGRAMMAR_FALSE_PROBES)
def test_xgrammar_enforces_false_as_additional_properties_or_items(
    schema: dict[str, Any], valid: list[Any], invalid: list[str], toy_tokenizer: Any
) -> None:
    assert_exact_false("xgrammar", schema, valid, invalid, toy_tokenizer)


OUTLINES_FALSE_PROBES = [
    (
        {**OBJ_A, "required": ["a"], "additionalProperties": False},
        [{"a": 1}],
        ['{"b": 1}', '{"a": 1, "b": 2}', "{}"],
    ),
    ({"type": "object", "properties": {}, "additionalProperties": False}, [{}], ['{"a": 1}']),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), OUTLINES_FALSE_PROBES)
def test_outlines_core_enforces_false_additional_properties_beside_properties(
    schema: dict[str, Any], valid: list[Any], invalid: list[str], toy_tokenizer: Any
) -> None:
    """A held-out sweep: 120 of outlines-core's refusals named only ``additionalProperties:
    false`` (every BFCL tool schema), though its objects hold the declared keys alone. Beside
    ``properties`` it is exact; without them outlines-core fails the compile (still an issue)."""
    assert_exact_false("outlines_core", schema, valid, invalid, toy_tokenizer)
    bare = {"type": "object", "additionalProperties": False}
    assert [i.keyword for i in backend_issues("outlines_core", bare)] == ["false"]
    assert compile_or_none("outlines_core", bare, toy_tokenizer) is None


def test_xgrammar_false_elsewhere_is_still_an_issue(toy_tokenizer: Any) -> None:
    # xgrammar refuses these ("Schema 'false' cannot accept any value")
    for schema, pointer in [
        ({"anyOf": [False, {"type": "integer"}]}, "/anyOf/0"),
        ({"type": "object", "properties": {"additionalProperties": False}}, None),
    ]:
        issues = backend_issues("xgrammar", schema)
        assert [i.keyword for i in issues] == ["false"], schema
        assert pointer is None or issues[0].pointer == pointer
        assert compile_or_none("xgrammar", schema, toy_tokenizer) is None


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "array", "minItems": 2**64}, "minItems"),  # wrapped to 0: took "[]"
        ({"type": "array", "maxItems": 2**64 + 3}, "maxItems"),
        ({"type": "string", "minLength": 2**40}, "minLength"),
    ],
)
def test_outlines_core_does_not_claim_counts_past_its_limit(
    schema: dict[str, Any], keyword: str, toy_tokenizer: Any
) -> None:
    assert [(i.keyword, i.support) for i in backend_issues("outlines_core", schema)] == [
        (keyword, "ignored")
    ]
    small = {**schema, keyword: 3}
    assert backend_issues("outlines_core", small) == []
    # the rewrite reads such counts before any profile does (no output reaches them): a
    # minimum leaves no array or string, a maximum constrains nothing; never compiled wrapped
    spec = GrammarSpec.json_schema(schema)
    if keyword.startswith("min"):
        with pytest.raises(GrammarError) as caught:
            compile_grammar(spec, toy_tokenizer, "outlines_core")
        assert not isinstance(caught.value, CompileTimeoutError)
    else:
        compiled, _ = compile_grammar(spec, toy_tokenizer, "outlines_core")
        assert grammar_accepts(compiled, toy_tokenizer, "[1, 2, 3, 4]")


@pytest.mark.parametrize(
    ("pattern", "misread"),
    [
        ('^[^"]$', True),  # took "\"" on llguidance
        ("^[\\x00-\\x1f]$", True),  # took "\\" and "\""
        ('^[^"\\n]$', True),
        ('^(?:[^"\\\\]|\\\\.)*$', True),  # took "a\"b"
        ("^[\\x00-\\x08]$", False),  # read right: not both ends of the control block
        ('^[^"\\x00]$', False),
        ('^[\\x00-\\x1f"\\\\]$', False),  # read right: both characters in the class
        ('^[^"\\\\\\x00-\\x1f]$', False),
        ("^\\n$", False),
        ("^[a-z]+$", False),
    ],
)
def test_llguidance_escape_class_rule(pattern: str, misread: bool) -> None:
    assert escape_class_misread(pattern) is misread
    issues = backend_issues("llguidance", {"type": "string", "pattern": pattern})
    assert [i.keyword for i in issues] == (["pattern"] if misread else [])


@pytest.mark.parametrize(
    ("pattern", "rust"),
    [
        ("^[a[bc]]$", True),
        ("^[[:alpha:]]+$", True),
        ("^[a-z&&[^c]]$", True),
        ("^[+--]$", True),
        ("^[\\[]$", False),
        ("^\\[a\\]$", False),
        ("^[a-z]+$", False),
    ],
)
def test_llguidance_class_set_syntax_rule(pattern: str, rust: bool) -> None:
    assert class_set_syntax(pattern) is rust
    schema = {"type": "object", "patternProperties": {pattern: {"type": "integer"}}}
    issues = backend_issues("llguidance", schema)
    assert [i.keyword for i in issues] == (["patternProperties"] if rust else [])


@pytest.mark.parametrize("value", [99_999_999, 2**31, 1234567.5, 0.0001234567])
def test_a_multiple_llguidance_cannot_compile_is_never_given_to_it(
    value: float, toy_tokenizer: Any
) -> None:
    """llguidance's ``multipleOf: 99999999`` ran past 200 s and 9.7 GB in process: such a
    value is not exact on any backend (strict mode refuses it at once), and under
    ``allow_weakening`` llguidance compiles the schema without it and reports it."""
    from espalier.constrained.errors import SchemaNotEnforceableError

    schema = {"type": "integer" if float(value).is_integer() else "number", "multipleOf": value}
    assert llguidance_multiple_too_costly(value)
    assert [(i.keyword, i.support) for i in backend_issues("llguidance", schema)] == [
        ("multipleOf", "ignored")
    ]
    with pytest.raises(SchemaNotEnforceableError):
        compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)
    compiled, report = compile_grammar(
        GrammarSpec.json_schema(schema), toy_tokenizer, "llguidance", allow_weakening=True
    )
    assert [issue.keyword for issue in report.weakened] == ["multipleOf"]
    assert grammar_accepts(compiled, toy_tokenizer, "7")


@pytest.mark.parametrize(
    ("value", "read"),
    [
        (3, 3),
        (12300, 12300),  # its automaton grows with the value, trailing zeros included
        (0.25, 25),
        (1e-3, 1),
        (1.5e-7, 15),
        (0.07, 7000000000000001),  # 0.07 * 10 is 0.7000000000000001 in floating point
        (10**6, 10**6),
        (10**400, 10**400),  # past float range: never converted
    ],
)
def test_llguidance_reads_a_multiple_as_an_integer(value: float, read: int) -> None:
    assert llguidance_multiple(value) == read
    assert llguidance_multiple(True) == llguidance_multiple("3") == llguidance_multiple(-2) == 0


@pytest.mark.parametrize("value", [0.07, 0.14, 20000, 10**6])
def test_a_multiple_llguidance_fails_on_is_refused_with_the_keyword_named(
    value: float, toy_tokenizer: Any
) -> None:
    """A held-out sweep: ``multipleOf: 0.07`` was INVALID_GRAMMAR ("too many digits:
    7000000000000001") though the schema is valid, and ``10**6`` ended requests mid-stream
    ("lexer error: too many expressions constructed"); no backend enforces them exactly, so
    strict mode names the keyword."""
    from espalier.constrained.errors import SchemaNotEnforceableError

    schema = {"type": "integer" if float(value).is_integer() else "number", "multipleOf": value}
    with pytest.raises(SchemaNotEnforceableError, match="'multipleOf' at /"):
        compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer)


def test_xgrammar_takes_a_raw_quote_from_a_class_beside_a_literal_non_ascii_character(
    toy_tokenizer: Any,
) -> None:
    """The probe: ``[ -/é]`` (a literal ``é``) took a raw ``"`` into the string on xgrammar,
    ``[ -/\\u00e9]`` did not. The algebra prints classes so: ``^\\W{1,3}$``, respelled for the
    backends' reading of ``\\W``, wrote ``","-"`` (a held-out sweep). Such a pattern is not
    exact there; auto keeps llguidance, which writes no raw quote."""
    raw = "xgrammar"
    backend = get_backend(raw, toy_tokenizer)
    literal = GrammarSpec.json_schema({"type": "string", "pattern": "^[ -/é]{1,3}$"})
    escaped = GrammarSpec.json_schema({"type": "string", "pattern": "^[ -/\\u00e9]{1,3}$"})
    broken = '","-"'
    assert backend.compile(literal).matcher().completes(toy_tokenizer.encode(broken))
    assert not backend.compile(escaped).matcher().completes(toy_tokenizer.encode(broken))
    for pattern in ("^[ -/é]{1,3}$", "^\\W{1,3}$", "^[^\\d]{2,6}$"):
        spec = GrammarSpec.json_schema({"type": "string", "pattern": pattern})
        with pytest.raises(GrammarError, match="pattern"):
            compile_grammar(spec, toy_tokenizer, raw)
        compiled, report = compile_grammar(spec, toy_tokenizer)
        assert report.backend == "llguidance"
        assert not grammar_accepts(compiled, toy_tokenizer, broken)
    for pattern in ("^[ -/]{1,3}$", "^[ -~]+$", "^[^a-z]{1,3}$"):  # exact there
        spec = GrammarSpec.json_schema({"type": "string", "pattern": pattern})
        assert compile_grammar(spec, toy_tokenizer, raw)[1].backend == raw
