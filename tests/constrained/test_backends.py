"""Every grammar backend against the matcher contract, on a ~300-id byte-level BPE toy vocabulary.

The mask oracle replays every token id through ``fork().accept`` (brute force) and compares.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.backends import (
    BACKENDS,
    BackendOptions,
    BackendUnavailableError,
    get_backend,
)
from espalier.constrained.base import CompiledGrammar, GrammarBackend, GrammarMatcher
from espalier.constrained.compile import compile_grammar
from espalier.constrained.errors import (
    InvalidGrammarError,
    UnknownBackendError,
    UnsupportedGrammarError,
)
from espalier.constrained.spec import GrammarKind, GrammarSpec


@dataclass(frozen=True)
class Case:
    name: str
    spec: GrammarSpec
    valid: tuple[str, ...]
    invalid_prefix: str  # a text that no valid output starts with


SCHEMA = {
    "type": "object",
    "properties": {  # declared in sorted order: xgrammar and outlines-core keep the order
        "age": {"type": "integer"},
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["age", "name"],
    "additionalProperties": False,
}

CASES = [
    Case("regex", GrammarSpec.regex(r"(ab)+c?"), ("ab", "ababab", "ababc"), "b"),
    Case("number", GrammarSpec.regex(r"-?[0-9]{1,3}(\.[0-9]+)?"), ("-12.5", "7", "123"), "+"),
    Case(
        "schema",
        GrammarSpec.json_schema(SCHEMA),
        ('{"age": 36, "name": "Ada"}', '{"age":-1,"name":"x","tags":["a", "b"]}'),
        '{"age": 1}',
    ),
    Case("any_json", GrammarSpec.any_json(), ('{"a": [1, 2, {"b": null}]}', "true", '"x"'), "}"),
    Case("choice", GrammarSpec.choice(["yes", "no", 'a"b\\c', "ab"]), ("yes", 'a"b\\c', "ab"), "x"),
    Case(
        "ebnf",
        GrammarSpec.ebnf('root ::= "[" item ("," item)* "]"\nitem ::= [0-9]+\n'),
        ("[1]", "[12,345,6]"),
        "[,",
    ),
    Case(
        "lark",
        GrammarSpec.lark('start: "[" item ("," item)* "]"\nitem: /[0-9]+/\n'),
        ("[1]", "[12,345,6]"),
        "[]",
    ),
]
CASE_IDS = [case.name for case in CASES]


def backend_for(name: str, tokenizer: Any, **options: Any) -> GrammarBackend:
    return get_backend(name, tokenizer, BackendOptions(**options) if options else None)


def compile_or_skip(backend: GrammarBackend, spec: GrammarSpec) -> CompiledGrammar:
    if spec.kind not in backend.kinds:
        with pytest.raises(UnsupportedGrammarError, match=spec.kind.value):
            backend.compile(spec)
        pytest.skip(f"{backend.name} does not support {spec.kind.value} (checked the error)")
    return backend.compile(spec)


def mask_of(matcher: GrammarMatcher) -> np.ndarray:
    """bool[V] of the tokens the matcher's mask allows."""
    row = bm.allocate(2, matcher.vocab_size, fill=-1)
    matcher.fill_bitmask(row, 1)
    assert torch.all(row[0] == -1), "fill_bitmask wrote outside its row"
    return bm.unpack_allowed(row[1], matcher.vocab_size)


def accepted_by_forks(matcher: GrammarMatcher) -> np.ndarray:
    """bool[V]: brute force, which single tokens ``accept`` takes from here (on forks)."""
    return np.array([matcher.fork().accept(t) for t in range(matcher.vocab_size)], dtype=bool)


def forced_bytes_pending(matcher: Any) -> bool:
    """llguidance narrows its mask to a canonical token when bytes are forced (asked of its
    Python API, which has ``compute_ff_bytes``, at the matcher's state)."""
    if matcher.compiled.backend != "llguidance":
        return False
    probe = matcher.compiled.native.deep_copy()
    assert probe.try_consume_tokens(matcher.history) == len(matcher.history)
    return bool(probe.compute_ff_bytes())


def feed(matcher: GrammarMatcher, tokens: list[int]) -> None:
    for token in tokens:
        assert matcher.accept(token), f"token {token} rejected"


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_valid_strings_accepted_to_termination(backend_name: str, case: Case, toy_tokenizer: Any):
    compiled = compile_or_skip(backend_for(backend_name, toy_tokenizer), case.spec)
    assert compiled.backend == backend_name and compiled.spec == case.spec
    assert compiled.memory_bytes > 0
    eos = toy_tokenizer.stop_token_ids[0]
    for text in case.valid:
        matcher = compiled.matcher()
        assert isinstance(matcher, GrammarMatcher)
        assert matcher.native is not None and compiled.native is not None
        assert matcher.tokenizer is toy_tokenizer
        feed(matcher, toy_tokenizer.encode(text))
        assert matcher.can_terminate(), text
        assert not matcher.is_terminated()
        assert matcher.accept(eos)
        assert matcher.is_terminated()


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_mask_equals_brute_force_accept(backend_name: str, case: Case, toy_tokenizer: Any):
    compiled = compile_or_skip(backend_for(backend_name, toy_tokenizer), case.spec)
    matcher = compiled.matcher()
    tokens = toy_tokenizer.encode(case.valid[-1]) + [toy_tokenizer.stop_token_ids[0]]
    for step, token in enumerate([*tokens, None]):
        mask = mask_of(matcher)
        oracle = accepted_by_forks(matcher)
        if backend_name == "llguidance" and forced_bytes_pending(matcher):
            assert not np.any(mask & ~oracle), f"step {step}: mask allows a rejected token"
            assert mask.any()
        else:
            diff = np.flatnonzero(mask != oracle).tolist()
            assert diff == [], f"step {step}: mask and accept disagree on {diff}"
        if token is not None:
            assert matcher.accept(token)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_rejected_token_leaves_matcher_usable(backend_name: str, case: Case, toy_tokenizer: Any):
    compiled = compile_or_skip(backend_for(backend_name, toy_tokenizer), case.spec)
    matcher = compiled.matcher()
    valid = toy_tokenizer.encode(case.valid[0])
    feed(matcher, valid[:1])
    before = mask_of(matcher)
    rejected = np.flatnonzero(~accepted_by_forks(matcher)).tolist()
    assert rejected, "every token allowed: the case tests nothing"
    for token in rejected[:: max(len(rejected) // 25, 1)]:
        assert not matcher.accept(token)
    if backend_name == "llguidance":
        assert not matcher.native.is_error()
    assert np.array_equal(mask_of(matcher), before)
    feed(matcher, valid[1:])
    assert matcher.can_terminate()
    fresh = compiled.matcher()
    bad = toy_tokenizer.encode(case.invalid_prefix)
    assert not _accepts_all(fresh, bad)


def _accepts_all(matcher: GrammarMatcher, tokens: list[int]) -> bool:
    probe = matcher.fork()
    return all(probe.accept(t) for t in tokens)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_rollback_and_reset(backend_name: str, case: Case, toy_tokenizer: Any):
    compiled = compile_or_skip(backend_for(backend_name, toy_tokenizer), case.spec)
    tokens = toy_tokenizer.encode(case.valid[-1])
    matcher = compiled.matcher()
    feed(matcher, tokens)
    eos = toy_tokenizer.stop_token_ids[0]
    assert matcher.accept(eos) and matcher.accept(eos)  # the second stop is a no-op
    for back in range(1, len(tokens) + 3):
        probe = matcher.fork()
        probe.rollback(back)
        replay = compiled.matcher()
        kept = [*tokens, eos, eos][: len(tokens) + 2 - back]
        feed(replay, kept)
        assert probe.is_terminated() == replay.is_terminated()
        assert np.array_equal(mask_of(probe), mask_of(replay)), f"rollback {back}"
        feed(probe, [*tokens, eos][len(kept) :])
        assert probe.is_terminated()
    matcher.reset()
    assert not matcher.is_terminated()
    assert np.array_equal(mask_of(matcher), mask_of(compiled.matcher()))
    feed(matcher, tokens)
    assert matcher.can_terminate()


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_fork_is_independent(backend_name: str, toy_tokenizer: Any):
    compiled = backend_for(backend_name, toy_tokenizer).compile(CASES[2].spec)
    matcher = compiled.matcher()
    feed(matcher, toy_tokenizer.encode('{"age": 1, "name": "A'))
    before = mask_of(matcher)
    child = matcher.fork()
    assert child is not matcher and child.native is not matcher.native
    feed(child, toy_tokenizer.encode('da", "tags": []}'))
    assert child.can_terminate() and not matcher.can_terminate()
    assert np.array_equal(mask_of(matcher), before)
    feed(matcher, toy_tokenizer.encode('"}'))
    assert matcher.can_terminate()
    child.rollback(3)
    assert matcher.can_terminate() and not child.can_terminate()


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_padding_ids_never_allowed(backend_name: str, toy_tokenizer_padded: Any):
    tok = toy_tokenizer_padded
    assert tok.vocab_size > tok.tokenizer_vocab_size
    compiled = backend_for(backend_name, tok).compile(CASES[2].spec)
    matcher = compiled.matcher()
    tokens = tok.encode(CASES[2].valid[1])
    for token in [*tokens, tok.stop_token_ids[0], None]:
        row = bm.allocate(1, tok.vocab_size, fill=-1)
        matcher.fill_bitmask(row, 0)
        allowed = bm.unpack_allowed(row[0], tok.vocab_size)
        assert not allowed[tok.tokenizer_vocab_size :].any()
        last_bits = bm.unpack_allowed(row[0], bm.words_per_row(tok.vocab_size) * 32)
        assert not last_bits[tok.vocab_size :].any(), "bits past V must be 0"
        for pad in range(tok.tokenizer_vocab_size, tok.vocab_size):
            assert not matcher.accept(pad)
        if token is not None:
            assert matcher.accept(token)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_termination_allows_only_stop_tokens(backend_name: str, toy_tokenizer_padded: Any):
    tok = toy_tokenizer_padded
    eos, eot = tok.stop_token_ids
    compiled = backend_for(backend_name, tok).compile(GrammarSpec.regex(r"ab(ab)?"))
    matcher = compiled.matcher()
    assert not matcher.accept(eos), "a stop token before the match is complete"
    feed(matcher, tok.encode("ab"))
    assert matcher.can_terminate()
    assert mask_of(matcher)[[eos, eot]].all(), "every stop token is allowed at a complete match"
    for stop in (eos, eot):
        probe = matcher.fork()
        assert probe.accept(stop) and probe.is_terminated()
        assert np.flatnonzero(mask_of(probe)).tolist() == [eos, eot]
        assert not probe.accept(tok.encode("ab")[0])
        assert probe.accept(eot if stop == eos else eos)  # further stops: no-ops
        probe.rollback(2)
        assert not probe.is_terminated() and probe.can_terminate()
        feed(probe, tok.encode("ab"))
        assert mask_of(probe)[[eos, eot]].all()


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_special_tokens_never_text(backend_name: str, toy_tokenizer: Any):
    pad = toy_tokenizer.hf.convert_tokens_to_ids("<pad>")
    compiled = backend_for(backend_name, toy_tokenizer).compile(GrammarSpec.regex(r"[^\n]*"))
    matcher = compiled.matcher()
    assert not mask_of(matcher)[pad]
    assert not matcher.accept(pad)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize(
    ("spec", "text"),
    [
        (GrammarSpec.regex("abababc"), "abababc"),
        (GrammarSpec.choice(["the quick brown fox"]), "the quick brown fox"),
        (GrammarSpec.json_schema({**SCHEMA, "required": ["age"]}), '{"age":12}'),
        # longer than the prefix that is tokenized for 64 tokens (FORCED_MARGIN)
        (GrammarSpec.choice(["the quick brown fox " * 100]), "the quick brown fox " * 100),
    ],
    ids=["regex", "choice", "schema", "long"],
)
def test_forced_tokens_are_canonical(
    backend_name: str, spec: GrammarSpec, text: str, toy_tokenizer
):
    compiled = backend_for(backend_name, toy_tokenizer, json_max_whitespace=0).compile(spec)
    matcher = compiled.matcher()
    canonical = toy_tokenizer.encode(text)
    row = bm.allocate(1, matcher.vocab_size, fill=0)
    matcher.fill_bitmask(row, 0)
    before = row.clone()
    forced = matcher.forced_tokens(64)
    assert forced, "this grammar forces a prefix"
    matcher.fill_bitmask(row, 0)  # the chain is probed without moving the matcher
    assert torch.equal(row, before) and not matcher.can_terminate()
    assert forced == canonical[: len(forced)]
    assert matcher.forced_tokens(1) == forced[:1]
    feed(matcher, forced)
    feed(matcher, canonical[len(forced) :])
    assert matcher.can_terminate()
    assert matcher.forced_tokens(8) == [] or matcher.can_terminate()


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_forced_tokens_absent_when_free(backend_name: str, toy_tokenizer: Any):
    compiled = backend_for(backend_name, toy_tokenizer).compile(GrammarSpec.regex("(a|b)+"))
    assert compiled.matcher().forced_tokens(8) == []


@pytest.mark.parametrize("kind", [GrammarKind.EBNF, GrammarKind.LARK, GrammarKind.ANY_JSON])
def test_outlines_core_refuses_non_regular_kinds(kind: GrammarKind, toy_tokenizer: Any):
    backend = get_backend("outlines_core", toy_tokenizer)
    spec = CASES[CASE_IDS.index(kind.value)].spec
    with pytest.raises(UnsupportedGrammarError, match=kind.value) as info:
        backend.compile(spec)
    assert info.value.backend == "outlines_core" and info.value.kind == kind.value


INVALID = [
    # built past GrammarSpec.regex, which refuses them first: each backend's own error
    ("regex", GrammarSpec(GrammarKind.REGEX, "(ab")),
    ("regex-class", GrammarSpec(GrammarKind.REGEX, "[a-")),
    ("schema-type", GrammarSpec.json_schema({"type": "foo"})),
    ("schema-properties", GrammarSpec.json_schema({"type": "object", "properties": 3})),
    ("ebnf-undefined", GrammarSpec.ebnf('root ::= "a" foo\n')),
    ("ebnf-syntax", GrammarSpec.ebnf('root ::= "a"\nitem ::= [a-\n')),
    ("lark-undefined", GrammarSpec.lark('start: "a" foo\n')),
    ("lark-syntax", GrammarSpec.lark('start: "a"\nitem: (\n')),
]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize(("label", "spec"), INVALID, ids=[label for label, _ in INVALID])
def test_invalid_grammar_raises_typed_error(backend_name, label, spec, toy_tokenizer):
    backend = backend_for(backend_name, toy_tokenizer)
    if spec.kind not in backend.kinds:
        with pytest.raises(UnsupportedGrammarError):
            backend.compile(spec)
        return
    with pytest.raises(InvalidGrammarError) as info:
        backend.compile(spec)
    assert info.value.kind == spec.kind.value
    assert info.value.detail
    if label == "ebnf-syntax" and backend_name == "xgrammar":
        assert info.value.line == 2


def test_choice_options_are_escaped(toy_tokenizer: Any):
    # a control character before hex digits: xgrammar read "\\x01abc" as U+1ABC
    options = ['a"b', "c\\d", "(x)|y*", "[z]", "new\nline", "é.", "\x01abc", "y\x1bE"]
    for name in BACKENDS:
        compiled = get_backend(name, toy_tokenizer).compile(GrammarSpec.choice(options))
        for option in options:
            matcher = compiled.matcher()
            feed(matcher, toy_tokenizer.encode(option))
            assert matcher.can_terminate(), (name, option)
        assert not _accepts_all(compiled.matcher(), toy_tokenizer.encode("x"))


def test_xgrammar_refuses_a_choice_option_holding_a_nul(toy_tokenizer: Any) -> None:
    """xgrammar ends a literal at a NUL (``"a\\u0000b"`` compiled to ``"a"``)."""
    with pytest.raises(UnsupportedGrammarError, match="NUL"):
        get_backend("xgrammar", toy_tokenizer).compile(GrammarSpec.choice(["\x00", "a\x00b"]))


def test_registry(toy_tokenizer: Any, monkeypatch: pytest.MonkeyPatch):
    from espalier.constrained import backends

    assert get_backend("xgrammar", toy_tokenizer) is get_backend("xgrammar", toy_tokenizer)
    other = get_backend("xgrammar", toy_tokenizer, BackendOptions(json_max_whitespace=0))
    assert other is not get_backend("xgrammar", toy_tokenizer)
    with pytest.raises(UnknownBackendError, match="xgrammar"):
        get_backend("nope", toy_tokenizer)
    # the set of backends is closed (BackendName); one whose library is missing fails with the
    # pip package to install (fresh options: not a backend already built)
    monkeypatch.setitem(sys.modules, "espalier.constrained.backends.outlines_core", None)
    with pytest.raises(BackendUnavailableError, match="pip install outlines-core"):
        fresh = BackendOptions(compile_slots=7)
        get_backend(backends.BackendName.OUTLINES_CORE, toy_tokenizer, fresh)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_accept_tokens_equals_accepting_one_by_one(
    backend_name: str, case: Case, toy_tokenizer_padded: Any
) -> None:
    """``accept_tokens`` (one native call on llguidance) stops where ``accept`` would, through
    text, stop, special and padding ids, and leaves the same state (mask, termination)."""
    tok = toy_tokenizer_padded
    compiled = compile_or_skip(backend_for(backend_name, tok), case.spec)
    stop = tok.stop_token_ids[0]
    special = tok.hf.convert_tokens_to_ids("<pad>")
    valid = tok.encode(case.valid[0])
    bad = tok.encode(case.invalid_prefix)
    sequences = [
        valid,
        valid + [stop, stop],
        valid + [stop, valid[0]],
        valid[:2] + bad + valid,
        valid[:1] + [special] + valid[1:],
        valid[:1] + [tok.vocab_size - 1] + valid[1:],
        [],
    ]
    for tokens in sequences:
        one_by_one = compiled.matcher()
        expected = 0
        for token in tokens:
            if not one_by_one.accept(token):
                break
            expected += 1
        batched = compiled.matcher()
        assert batched.accept_tokens(tokens) == expected, tokens
        assert np.array_equal(mask_of(batched), mask_of(one_by_one)), tokens
        assert batched.is_terminated() == one_by_one.is_terminated()
        batched.rollback(expected)  # and it rolls back like the tokens accepted one by one
        assert np.array_equal(mask_of(batched), mask_of(compiled.matcher()))


def test_a_choice_option_holding_del_compiles_on_llguidance(toy_tokenizer: Any) -> None:
    compiled, _ = compile_grammar(GrammarSpec.choice(["a\x7fb", "zz"]), toy_tokenizer, "llguidance")
    assert compiled.matcher().completes(toy_tokenizer.encode("a\x7fb"))
    assert not compiled.matcher().completes(toy_tokenizer.encode("a"))


@pytest.mark.parametrize("name", ['a"b', "a\\b", "a\nb", "a\u0001b", "é/ü"])
def test_outlines_core_writes_property_names_as_json_spells_them(
    name: str, toy_tokenizer: Any
) -> None:
    """outlines-core put a name into its regex with regex escapes only: ``a"b`` came out as
    ``{"a"b": 1}`` (not JSON), ``a\\b`` as ``{"a\\b": 1}`` (another name)."""
    from espalier.constrained.conformance import grammar_accepts

    schema = {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}
    compiled = get_backend("outlines_core", toy_tokenizer).compile(GrammarSpec.json_schema(schema))
    spelled = json.dumps({name: 1}, ensure_ascii=False, separators=(",", ":"))
    raw = '{"' + name + '":1}'
    assert grammar_accepts(compiled, toy_tokenizer, spelled)
    assert raw == spelled or not grammar_accepts(compiled, toy_tokenizer, raw)
