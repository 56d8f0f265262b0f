"""Structural tags and reasoning in the grammar layer: the spec, each backend against xgrammar's
own reading of the format (acceptance and masks), exactness inside tags, freedom outside,
refusals where a backend has no exact form.
"""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import numpy as np
import pytest

from espalier.constrained.backends import get_backend
from espalier.constrained.backends.common import BackendOptions
from espalier.constrained.compile import compile_grammar
from espalier.constrained.conformance import grammar_accepts
from espalier.constrained.errors import (
    InvalidGrammarError,
    SchemaNotEnforceableError,
    UnsupportedGrammarError,
)
from espalier.constrained.spec import GrammarKind, GrammarSpec
from espalier.constrained.structural_tag import (
    admit_structural_tag,
    after_reasoning,
    reasoning_end,
    root_format,
    structural_tag_spec,
)
from tests.fixtures.structural_tags import (
    CASES,
    POINT,
    is_text,
    mask_of,
    probe_texts,
    tool_tags,
    verdict,
)

OPTIONS = BackendOptions(xgrammar_memory_limit=0)  # in-process compiles: no child start-up
OTHERS = ("llguidance",)  # backends that claim structural tags besides xgrammar


def test_legacy_form_is_triggered_tags() -> None:
    spec = structural_tag_spec(
        {
            "type": "structural_tag",
            "structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}],
            "triggers": ["<f"],
        }
    )
    assert spec.kind is GrammarKind.STRUCTURAL_TAG
    fmt = root_format(spec)
    assert fmt["type"] == "triggered_tags" and fmt["triggers"] == ["<f"]
    assert fmt["tags"][0]["content"] == {"type": "json_schema", "json_schema": {"type": "integer"}}
    assert structural_tag_spec(spec.source) == spec  # canonical text is a fixed point


@pytest.mark.parametrize(
    ("tag", "needle"),
    [
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
        ({"type": "structural_tag", "format": {"type": "nope"}}, "/format"),
        ({"type": "structural_tag", "format": {"type": "tag", "begin": "<a>"}}, "/format"),
        ({"type": "structural_tag", "structures": [{"begin": "<a>"}], "triggers": []}, "begin"),
    ],
)
def test_bad_tags_are_invalid(tag: Any, needle: str) -> None:
    with pytest.raises(InvalidGrammarError, match="structural_tag") as info:
        structural_tag_spec(tag)
    assert needle in str(info.value)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", OTHERS)
def test_backend_agrees_with_xgrammar(case: str, backend: str, toy_tokenizer: Any) -> None:
    """Same verdict on every probe text, same mask after every prefix both accept (over the
    tokens that are whole UTF-8 text: xgrammar's free text also takes bytes that never form
    UTF-8, llguidance's is text)."""
    text_tokens = np.array([is_text(piece) for piece in toy_tokenizer.token_bytes])
    spec = CASES[case]()
    reference = get_backend("xgrammar", toy_tokenizer, OPTIONS).compile(spec)
    other = get_backend(backend, toy_tokenizer, OPTIONS).compile(spec)
    checked_masks = 0
    for text in probe_texts(seed=len(case), count=60):
        ids = toy_tokenizer.encode(text)
        assert verdict(other, ids) == verdict(reference, ids), (case, text)
        ref_matcher, other_matcher = reference.matcher(), other.matcher()
        for token in ids[:8]:
            ours, theirs = mask_of(other_matcher), mask_of(ref_matcher)
            assert np.array_equal(ours[text_tokens], theirs[text_tokens]), (case, text)
            assert not (ours & ~theirs).any(), (case, text)  # never more than the reference
            checked_masks += 1
            if not ref_matcher.accept(token):
                break
            assert other_matcher.accept(token)
    assert checked_masks > 50


def sample(compiled: Any, rng: random.Random, max_tokens: int, stop: int) -> list[int]:
    """Random tokens among those the mask allows, until a stop token or ``max_tokens``."""
    matcher = compiled.matcher()
    out: list[int] = []
    while len(out) < max_tokens and not matcher.is_terminated():
        allowed = np.flatnonzero(mask_of(matcher))
        token = int(rng.choice(list(allowed)))
        if token == stop and len(out) < 4 and len(allowed) > 1:
            continue  # keep going a little: stop as soon as allowed says too little
        assert matcher.accept(token)
        out.append(token)
    return out


@pytest.mark.parametrize("backend", ["xgrammar", *OTHERS])
def test_exact_inside_tags_free_outside(backend: str, toy_tokenizer: Any) -> None:
    compiled = get_backend(backend, toy_tokenizer, OPTIONS).compile(tool_tags())
    stop = toy_tokenizer.stop_token_ids[0]
    start = mask_of(compiled.matcher())
    pieces = toy_tokenizer.token_bytes
    # free outside: every text token without a trigger's first byte is allowed at the start
    plain = [t for t, b in enumerate(pieces) if b and is_text(b) and not set(b"<[") & set(b)]
    assert len(plain) > 100
    assert start[plain].all() and start[stop]
    # exact inside: a tag opened forces its schema
    inside = compiled.matcher()
    for token in toy_tokenizer.encode("ok <tool=a>"):
        assert inside.accept(token)
    allowed = {pieces[t] for t in np.flatnonzero(mask_of(inside))}
    assert allowed and all(b"{".startswith(p) or p.startswith(b"{") for p in allowed), allowed
    rng = random.Random(7)
    for _ in range(12):
        ids = sample(compiled, rng, 120, stop)
        text = toy_tokenizer.decode([t for t in ids if t != stop])
        for body in _bodies(text, "<tool=a>", "</tool>"):
            jsonschema.validate(json.loads(body), POINT)
        for body in _bodies(text, "[[", "]]"):
            assert body.isdigit() and len(body) <= 3, text


def _bodies(text: str, begin: str, end: str) -> list[str]:
    out = []
    for chunk in text.split(begin)[1:]:
        if end in chunk:
            out.append(chunk.split(end)[0])
    return out


@pytest.mark.parametrize("backend", ["xgrammar", *OTHERS])
def test_reasoning_free_then_exact(backend: str, toy_tokenizer: Any) -> None:
    spec = after_reasoning(GrammarSpec.regex("(yes|no)"), "</think>")
    compiled = get_backend(backend, toy_tokenizer, OPTIONS).compile(spec)
    matcher = compiled.matcher()
    stop = toy_tokenizer.stop_token_ids[0]
    assert not mask_of(matcher)[stop]  # the marker must come first
    for token in toy_tokenizer.encode("I think {not json} <think> maybe"):
        assert matcher.accept(token)
    assert mask_of(matcher).sum() > toy_tokenizer.vocab_size // 2
    for token in toy_tokenizer.encode("</think>"):
        assert matcher.accept(token)
    allowed = {toy_tokenizer.token_bytes[t] for t in np.flatnonzero(mask_of(matcher))}
    assert allowed and all(b"yes".startswith(p) or b"no".startswith(p) for p in allowed)


@pytest.mark.parametrize(
    ("backend", "inner"),
    [
        (backend, inner)
        for backend in ("auto", "llguidance", "xgrammar")
        # the Lark grammar is built past the request check, which refuses it on its own
        for inner in (GrammarSpec(GrammarKind.LARK, "start: start"), GrammarSpec.regex(r"[^\s\S]"))
        if (backend, inner.kind) != ("xgrammar", GrammarKind.REGEX)  # it refuses its \s
    ],
)
def test_an_empty_grammar_after_reasoning_is_refused(
    backend: str, inner: GrammarSpec, toy_tokenizer: Any
) -> None:
    """The free text before the marker always admits output; the grammar after it is checked
    on its own state (it used to run the whole budget as free text, then end unclosed)."""
    assert reasoning_end(after_reasoning(inner, "</think>")) == "</think>"
    with pytest.raises(InvalidGrammarError, match="after the reasoning end marker"):
        compile_grammar(after_reasoning(inner, "</think>"), toy_tokenizer, backend)
    assert reasoning_end(inner) is None
    compile_grammar(after_reasoning(GrammarSpec.regex("a|b"), "</think>"), toy_tokenizer, backend)


def test_auto_picks_an_exact_backend_and_strict_mode_refuses(toy_tokenizer: Any) -> None:
    at_least_one = json.loads(tool_tags().source)
    at_least_one["format"]["at_least_one"] = True
    # xgrammar writes raw control characters into a string with a length bound (not exact)
    del at_least_one["format"]["tags"][0]["content"]["json_schema"]["properties"]["y"]["maxLength"]
    spec = structural_tag_spec(at_least_one)
    with pytest.raises(UnsupportedGrammarError, match="no exact llguidance form"):
        compile_grammar(spec, toy_tokenizer, "llguidance", options=OPTIONS)
    with pytest.raises(UnsupportedGrammarError, match="outlines_core"):
        compile_grammar(tool_tags(), toy_tokenizer, "outlines_core", options=OPTIONS)
    _, report = compile_grammar(spec, toy_tokenizer, options=OPTIONS)
    assert report.backend == "xgrammar"
    _, report = compile_grammar(tool_tags(), toy_tokenizer, options=OPTIONS)
    assert report.backend == "llguidance"


def test_schemas_inside_tags_are_checked_like_any_schema(toy_tokenizer: Any) -> None:
    # a keyword no backend enforces, deep inside a tag: refused naming where it is
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "no-such"}}}
    unenforced = {"type": "string", "contentSchema": {"type": "integer"}}
    for inner in (schema, unenforced):
        spec = after_reasoning(GrammarSpec.json_schema(inner), "</think>")
        try:
            _, report = compile_grammar(spec, toy_tokenizer, options=OPTIONS)
        except SchemaNotEnforceableError as exc:
            assert "/format/elements/1/json_schema" in str(exc)
        else:
            assert report.weakened == ()
    bad_ref = after_reasoning(GrammarSpec.json_schema({"$ref": "#/$defs/missing"}), "</think>")
    with pytest.raises(InvalidGrammarError):
        compile_grammar(bad_ref, toy_tokenizer, options=OPTIONS)


def _regex_tag(pattern: str) -> str:
    return json.dumps({"type": "structural_tag", "format": {"type": "regex", "pattern": pattern}})


@pytest.mark.parametrize("pattern", ["[\\p{Greek}]{2}", "\\s\\d"])
def test_a_regex_element_xgrammar_reads_otherwise_is_refused_there(
    pattern: str, toy_tokenizer: Any
) -> None:
    """A regex element is read as a regex constraint is: xgrammar wrote ``Ge`` for
    ``[\\p{Greek}]{2}`` and U+FEFF for ``\\s`` (finishing STOP). llguidance reads both as Python
    does, so auto stays there."""
    spec = admit_structural_tag(_regex_tag(pattern), 64)
    with pytest.raises(UnsupportedGrammarError, match=r"xgrammar reads .* at /format"):
        compile_grammar(spec, toy_tokenizer, "xgrammar")
    assert compile_grammar(spec, toy_tokenizer)[1].backend == "llguidance"


def test_a_regex_element_pythons_module_refuses_is_invalid_with_its_pointer() -> None:
    with pytest.raises(InvalidGrammarError, match="'/format': multiple repeat"):
        admit_structural_tag(_regex_tag("a{1,3}{2}"), 64)


@pytest.mark.parametrize("backend", ["auto", "llguidance", "xgrammar"])
def test_a_regex_element_is_spelled_for_the_backends_as_a_regex_constraint_is(
    backend: str, toy_tokenizer: Any
) -> None:
    """``a{,3}`` and outer ``\\A`` / ``\\Z``: Python reads them, the backends refused them
    ("repetition quantifier expects a valid decimal") inside a structural tag while the same
    regex as a constraint was respelled and served."""
    for pattern, good, bad in (("x{,3}", "xxx", "xxxx"), ("\\Axy\\Z", "xy", "Axy")):
        spec = admit_structural_tag(_regex_tag(pattern), 64)
        compiled, _ = compile_grammar(spec, toy_tokenizer, backend, options=OPTIONS)
        assert compiled.matcher().completes(toy_tokenizer.encode(good)), pattern
        assert not compiled.matcher().completes(toy_tokenizer.encode(bad)), pattern


def _repeat(content: dict[str, Any], low: int, high: int) -> dict[str, Any]:
    return {"type": "repeat", "min": low, "max": high, "content": content}


A = {"type": "const_string", "value": "a"}


@pytest.mark.parametrize(
    "fmt",
    [
        _repeat(_repeat(_repeat(_repeat(A, 100, 100), 100, 100), 100, 100), 100, 100),
        _repeat(A, 2147483647, -1),
        _repeat(A, 5_000_000, -1),
        {"type": "sequence", "elements": [_repeat(A, 99_999, -1)] * 5},
        _repeat({"type": "regex", "pattern": "b{1000}"}, 1000, 1000),
    ],
)
def test_repeats_asking_for_too_much_text_are_refused(fmt: dict[str, Any]) -> None:
    """A held-out sweep: four nested repeats of 100, or one of min 5,000,000, were written out
    by the backend until the engine was killed for memory (every request in flight failed);
    GBNF, Lark and regex counts had the limits already."""
    tag = json.dumps({"type": "structural_tag", "format": fmt})
    with pytest.raises(InvalidGrammarError, match="nested repeats multiply") as caught:
        admit_structural_tag(tag, 64)
    assert caught.value.pointer == "/format"


def test_ordinary_repeats_stay(toy_tokenizer: Any) -> None:
    fmt = {"type": "tag", "begin": "<a>", "content": _repeat(A, 1, 100), "end": "</a>"}
    spec = admit_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}), 64)
    compiled, _ = compile_grammar(spec, toy_tokenizer, "auto", options=OPTIONS)
    assert compiled.matcher().completes(toy_tokenizer.encode("<a>aaa</a>"))


def test_xgrammars_dot_in_a_regex_element_takes_no_newline(toy_tokenizer: Any) -> None:
    spec = admit_structural_tag(_regex_tag("a.c"), 64)
    compiled, _ = compile_grammar(spec, toy_tokenizer, "xgrammar")
    assert not compiled.matcher().completes(toy_tokenizer.encode("a\nc"))
    assert compiled.matcher().completes(toy_tokenizer.encode("abc"))


@pytest.mark.parametrize(
    ("schema", "texts"),
    [
        ({"type": "object", "properties": {"x": {"type": "integer"}}},
         {'{"x": 1, "y": 2}': True, '{"y": [2]}': True, '[1]': False}),
        ({"type": "array", "prefixItems": [{"type": "integer"}]},
         {"[1, 2]": True, '[1, "a"]': True, "[1]": True, '["a"]': False}),
        ({"type": "object", "properties": {"x": {"type": "integer"}},
          "additionalProperties": False},
         {'{"x": 1}': True, '{"x": 1, "y": 2}': False}),
    ],
)  # fmt: skip
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_tags_schemas_keep_json_schema_defaults(
    schema: dict[str, Any], texts: dict[str, bool], backend: str, toy_tokenizer: Any
) -> None:
    """xgrammar reads a structural tag's schemas in its strict mode: ``{"x": 1, "y": 2}`` was
    refused under an object schema that allows more properties (llguidance took it)."""
    spec = structural_tag_spec(
        {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": schema}}
    )
    compiled, _ = compile_grammar(spec, toy_tokenizer, backend)
    for text, expected in texts.items():
        assert grammar_accepts(compiled, toy_tokenizer, text) is expected, text


def test_an_empty_regex_element_matches_the_empty_text(toy_tokenizer: Any) -> None:
    """Held-out sweep: llguidance read ``//`` as a comment (a Lark syntax error) and xgrammar
    failed a check ("Check failed: ..."); xgrammar now refuses it by name, auto compiles it."""
    fmt = {"type": "sequence", "elements": [{"type": "const_string", "value": "a"},
                                             {"type": "regex", "pattern": ""}]}  # fmt: skip
    spec = structural_tag_spec({"type": "structural_tag", "format": fmt})
    with pytest.raises(UnsupportedGrammarError, match="an empty regex at /format/elements/1"):
        compile_grammar(spec, toy_tokenizer, "xgrammar")
    compiled, _ = compile_grammar(spec, toy_tokenizer)
    assert grammar_accepts(compiled, toy_tokenizer, "a")
    assert not grammar_accepts(compiled, toy_tokenizer, "ab")


def test_xgrammars_failed_check_reads_as_its_message(toy_tokenizer: Any) -> None:
    """An empty trigger got ``Check failed: (std::holds_alternative<Grammar>(result)) is
    false: Invalid structural tag error: ...`` as its message and field detail."""
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": [""],
            "tags": [{"begin": "", "content": {"type": "any_text"}, "end": ""}],
        },
    }
    with pytest.raises(InvalidGrammarError) as info:
        compile_grammar(structural_tag_spec(tag), toy_tokenizer, "xgrammar")
    assert "Check failed" not in str(info.value) and "non-empty" in str(info.value)
