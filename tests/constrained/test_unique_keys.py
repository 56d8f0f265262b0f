"""No JSON object repeats a key (``constrained/keys/``).

Oracles: the filtered row is the backend's row minus exactly the tokens whose bytes complete a
key already in its object (checked by replaying each allowed token on the lexer); random
outputs of the wrapped matcher never hold a duplicate (``json.loads`` with a pairs hook); a
draft tree's rows equal replaying each root-to-node path on a fork of the wrapped matcher.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest

from espalier.constrained import bitmask as bm
from espalier.constrained.backends import BACKENDS
from espalier.constrained.compile import compile_grammar
from espalier.constrained.errors import SchemaNotEnforceableError, UnsupportedGrammarError
from espalier.constrained.keys import UniqueKeysMatcher, may_repeat_keys, with_unique_keys
from espalier.constrained.keys.native import KeyTables, KeyTracker
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.tree.masks import fill_tree_bitmask
from tests.fixtures.keys_twin import START, parse_export, step
from tests.fixtures.tree_random import tree_from_paths

FREE = {"type": "object", "additionalProperties": {"type": "integer"}}
NESTED = {
    "type": "object",
    "properties": {"mn": {"type": "string"}, "nm": {"type": "string"}},
    "additionalProperties": {"type": "object", "additionalProperties": {"type": "boolean"}},
}
PATTERN = {
    "type": "object",
    "patternProperties": {"^a": {"type": "integer"}},
    "additionalProperties": False,
}
ANY: dict[str, Any] = {}
CASES = [("free", FREE), ("nested", NESTED), ("pattern", PATTERN), ("any", ANY)]
# per case: a text after which the key "a" would be a duplicate
PREFIXES = {
    "free": '{"a": 1, "a',
    "nested": '{"mn": "", "nm": "", "x": {"a": true, "a',
    "pattern": '{"a": 1, "a',
    "any": '{"b": [{"a": 1, "a',
}


def _state(matcher: Any) -> Any:
    """The native tracker's state as the twin's ``KeyState``."""
    return parse_export(matcher.keys.export())


def _lex(text: str) -> Any:
    state: Any = START
    for i, byte in enumerate(text.encode()):
        state = step(state, bytes((byte,)))
        if state is None:
            return i
    return state


def test_lexer_finds_the_byte_that_completes_a_duplicate() -> None:
    text = '{"a": 1, "b": {"a": [{"a": 2}], "b": "a\\"x"}, "c": "}", "b"'
    assert _lex(text) == len(text) - 1  # the outer object's second "b"
    assert _lex('{"ab": 1, "a": 2, "abc": 3}') != 0  # prefixes of a key are other keys
    # a needed escape spells the same key: its duplicate is found at the closing quote
    assert _lex('{"\\u0001": 1, "\\u0001"') == len('{"\\u0001": 1, "\\u0001"') - 1
    # an escape a key does not need is refused where it becomes one (the backends would read
    # another key than the name it decodes to)
    assert _lex('{"a": 1, "\\u0061"') == len('{"a": 1, "\\u00')
    assert _lex('{"\U0001f600": 1, "\\ud83d"') == len('{"\U0001f600": 1, "\\u'.encode())
    assert _lex('{"a\\/b"') == len('{"a\\')
    assert _lex('{"\\u000a"') == len('{"\\u000')  # "\n" is its spelling
    assert _lex('{"\\u001F"') == len('{"\\u001')  # lowercase, as JSON writers spell it
    assert not isinstance(_lex('{"\\"\\\\\\n\\u001f": 1}'), int)  # needed escapes
    assert _lex('[{"a": 1}, {"a": 1}]') != 0  # every object has its own keys
    assert not isinstance(_lex('{"a": "a", "b": 1, "ab": {"a": 1}}'), int)


def test_only_grammars_with_free_keys_are_wrapped() -> None:
    closed = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
        "additionalProperties": False,
    }
    assert not may_repeat_keys(GrammarSpec.json_schema(closed))
    assert not may_repeat_keys(GrammarSpec.regex("[a-z]+"))
    for _, schema in CASES:
        assert may_repeat_keys(GrammarSpec.json_schema(schema))
    assert may_repeat_keys(GrammarSpec.json_schema({"type": "array", "items": {"type": "object"}}))


def _compiled(tokenizer: Any, backend: str, schema: Any) -> Any:
    if backend == "outlines_core" and not schema:
        pytest.skip("outlines-core builds an index for any JSON value slowly (minutes)")
    try:
        compiled, _ = compile_grammar(GrammarSpec.json_schema(schema), tokenizer, backend)
    except Exception as exc:  # a keyword this backend does not enforce (outlines: patterns)
        pytest.skip(f"{backend}: {exc}")
    return compiled


def _accepted_prefix(compiled: Any, tokenizer: Any, text: str) -> list[int]:  # type: ignore[return]
    """``text``'s tokens, or those of its compact form (no spaces) where the backend's
    whitespace rules refuse the spaced one."""
    for form in (text, text.replace(" ", "")):
        tokens = tokenizer.encode(form)
        if compiled.matcher().accept_tokens(tokens) == len(tokens):
            return tokens
    # outlines-core writes only the declared properties of an object that declares some
    pytest.skip(f"{compiled.backend} has no free keys here: it refuses {text!r}")


def _allowed(matcher: Any, vocab: int) -> list[int]:
    row = bm.allocate(1, vocab, fill=0)
    matcher.fill_bitmask(row, 0)
    return np.flatnonzero(bm.unpack_allowed(row[0], vocab)).tolist()


def _walk(tokenizer: Any, matcher: Any, rng: random.Random, limit: int) -> list[int]:
    """Random allowed tokens (quotes and commas favoured: keys come often) to the end or limit."""
    stops = set(tokenizer.stop_token_ids)
    out: list[int] = []
    while len(out) < limit and not matcher.is_terminated():
        allowed = _allowed(matcher, tokenizer.vocab_size)
        assert allowed, "the filter never empties a row"
        keyish = [t for t in allowed if t not in stops and tokenizer.token_bytes[t][:1] in b'",a']
        choices = keyish if keyish and rng.random() < 0.8 else allowed
        token = rng.choice(choices)
        assert matcher.accept(token)
        out.append(token)
    return out


def _finish(tokenizer: Any, matcher: Any, limit: int) -> list[int]:
    """Greedy closers and short values, then the stop token, until the grammar ends."""
    preferred = [tokenizer.encode(t)[0] for t in ('"', "}", "]", "0", ":", "x")]
    preferred = list(tokenizer.stop_token_ids) + preferred
    out: list[int] = []
    while len(out) < limit and not matcher.is_terminated():
        allowed = _allowed(matcher, tokenizer.vocab_size)
        token = next((t for t in preferred if t in allowed), allowed[0])
        assert matcher.accept(token)
        out.append(token)
    return out


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), keys
    return dict(pairs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("name", "schema"), CASES)
def test_rows_lose_exactly_the_duplicate_completions(
    backend: str, name: str, schema: Any, toy_tokenizer: Any
) -> None:
    tokenizer = toy_tokenizer
    compiled = _compiled(tokenizer, backend, schema)
    rng = random.Random(7)
    prefix = _accepted_prefix(compiled, tokenizer, PREFIXES[name])
    quote = tokenizer.encode('"')[0]
    for walk in range(6):
        matcher = with_unique_keys(compiled.spec, compiled.matcher(), tokenizer)
        assert isinstance(matcher, UniqueKeysMatcher)
        assert matcher.accept_tokens(prefix) == len(prefix)
        if walk == 0:  # the closing quote would repeat "a": gone from the row, rejected
            assert quote in _allowed(matcher.inner, tokenizer.vocab_size)
            assert quote not in _allowed(matcher, tokenizer.vocab_size)
            assert not matcher.fork().accept(quote)
            assert matcher.fork().accept_tokens(tokenizer.encode('b"')) == 2
        for _ in range(rng.randrange(4, 30)):
            if matcher.is_terminated():
                break
            inner = set(_allowed(matcher.inner, tokenizer.vocab_size))
            mine = set(_allowed(matcher, tokenizer.vocab_size))
            state = _state(matcher)
            dup = {t for t in inner if step(state, tokenizer.token_bytes[t]) is None}
            assert mine == inner - dup or (mine == inner and dup == inner), name
            for token in list(dup)[:3]:
                assert not matcher.fork().accept(token)
            _walk(tokenizer, matcher, rng, 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("name", "schema"), CASES)
def test_random_outputs_never_repeat_a_key(
    backend: str, name: str, schema: Any, toy_tokenizer: Any
) -> None:
    tokenizer = toy_tokenizer
    compiled = _compiled(tokenizer, backend, schema)
    rng = random.Random(11)
    finished = 0
    for _ in range(10):
        matcher = with_unique_keys(compiled.spec, compiled.matcher(), tokenizer)
        tokens = _walk(tokenizer, matcher, rng, rng.randrange(5, 40))
        tokens += _finish(tokenizer, matcher, 120)
        if matcher.is_terminated():
            text = b"".join(tokenizer.token_bytes[t] for t in tokens[:-1]).decode()
            json.loads(text, object_pairs_hook=_pairs)
            finished += 1
        # rollback restores the lexer with the grammar: the same tokens are accepted again
        matcher.rollback(len(tokens))
        assert matcher.keys.accepted == 0 and _state(matcher) == START
        assert matcher.accept_tokens(tokens) == len(tokens)
    assert finished > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_rows_equal_replaying_each_path(backend: str, toy_tokenizer: Any) -> None:
    tokenizer = toy_tokenizer
    compiled = _compiled(tokenizer, backend, FREE)
    matcher = with_unique_keys(compiled.spec, compiled.matcher(), tokenizer)
    prefix = tokenizer.encode('{"a": 1, "ab": 2, "')
    assert matcher.accept_tokens(prefix) == len(prefix)
    texts = ["a", 'a"', "ab", 'ab"', "b", 'b"', '"', 'a":']
    tree = tree_from_paths(prefix[-1], [tokenizer.encode(t) for t in texts])
    out = bm.allocate(tree.num_nodes, tokenizer.vocab_size, fill=0)
    masks = fill_tree_bitmask(matcher, tree, out, None)
    for node in range(tree.num_nodes):
        path = tree.path(node)
        probe = matcher.fork()
        ok = all(probe.accept(t) for t in path)
        assert bool(masks.valid[node]) == ok, (node, path)
        if ok:
            assert masks.filled[node]
            assert _allowed_row(out, node, tokenizer) == _allowed(probe, tokenizer.vocab_size)
    assert not all(masks.valid)  # the duplicate "a" and "ab" completions are cut


def _allowed_row(out: Any, node: int, tokenizer: Any) -> list[int]:
    return np.flatnonzero(bm.unpack_allowed(out[node], tokenizer.vocab_size)).tolist()


GEMMA_TEXTS = [
    '{"a": 1, "',
    '{"mn": "x", "nm": {"a": 1, "type": 2, "',
    '{"mn": "x", "m',
    '{"mn": "x", "nm": "va',
    '{"mn": 1',
    '{"a\\\\": {"a\\\\"',
    '[{"mn": {}, "',
]


@pytest.mark.parametrize("text", GEMMA_TEXTS)
def test_gemma_tables_match_the_lexer_on_every_quote_token(text: str, gemma_tokenizer: Any) -> None:
    """The native fast path (prefix index, quoted-run index) against running every token that
    holds a quote (and in a key, a backslash) through the twin's lexer, on Gemma's 262k
    vocabulary (others cannot complete a key or write an escape)."""
    tracker = KeyTracker(KeyTables(gemma_tokenizer.token_bytes))
    state = START
    for byte in text.encode():
        state = step(state, bytes((byte,)))
    assert state is not None
    tokens = gemma_tokenizer.encode(text)
    assert tracker.accept_tokens(tokens) == len(tokens) and parse_export(tracker.export()) == state
    full = bm.allocate(1, gemma_tokenizer.vocab_size)[0].numpy()
    row = full.copy()
    assert tracker.filter_row(row)
    in_key = state.key is not None
    candidates = [
        t for t, b in enumerate(gemma_tokenizer.token_bytes) if b'"' in b or (in_key and b"\\" in b)
    ]
    expected = [t for t in candidates if step(state, gemma_tokenizer.token_bytes[t]) is None]
    removed = np.flatnonzero(bm.unpack_allowed(full ^ row, gemma_tokenizer.vocab_size)).tolist()
    assert removed == expected
    if text.endswith(', "'):
        assert expected  # a key start: a seen key and its closing quote in one token


def test_an_exhausted_key_language_is_a_dead_end_never_a_duplicate(toy_tokenizer: Any) -> None:
    """Keys of one character and a comma taken: after ``"a`` every way on repeats ``a``. The
    row is not emptied (the backend's row stays), but the duplicate is refused and the
    refusal says why. (A key language of few names, such as ``^a$``, is listed as declared
    properties instead, which the backend never repeats: ``test_few_names_are_declared``.)"""
    schema = {
        "type": "object",
        "propertyNames": {"maxLength": 1},
        "additionalProperties": {"type": "integer"},
    }
    compiled = _compiled(toy_tokenizer, "llguidance", schema)
    matcher = with_unique_keys(compiled.spec, compiled.matcher(), toy_tokenizer)
    prefix = _accepted_prefix(compiled, toy_tokenizer, '{"a": 1, "a')
    assert matcher.accept_tokens(prefix) == len(prefix)
    inner = _allowed(matcher.inner, toy_tokenizer.vocab_size)
    assert inner and _allowed(matcher, toy_tokenizer.vocab_size) == inner
    assert matcher.refusal() is None
    assert not matcher.accept(toy_tokenizer.encode('"')[0])
    refusal = matcher.refusal()
    assert refusal is not None and refusal.startswith("duplicate key: every token"), refusal


@pytest.mark.parametrize(
    ("schema", "text"),
    [
        (
            {
                "type": "object",
                "patternProperties": {"^[A-Z]{2}$": {"type": "integer"}},
                "additionalProperties": False,
            },
            '{"US": 1, "US": 2}',
        ),
        ({"type": "object", "propertyNames": {"maxLength": 3}}, '{"abc": 1, "abc": 2}'),
        (
            {"type": "object", "propertyNames": {"format": "date"}},
            '{"2024-01-01": 1, "2024-01-01": 2}',
        ),
        ({"type": "object", "propertyNames": {"enum": ["x", "y"]}}, '{"x": 1, "x": 2}'),
    ],
)
@pytest.mark.parametrize("backend", ["auto", "llguidance", "xgrammar"])
def test_a_key_the_grammar_must_close_is_never_repeated(
    backend: str, schema: dict[str, Any], text: str, toy_tokenizer: Any
) -> None:
    """Where the key so far can only be closed (its language is exhausted), the closing quote
    that repeats a key is still refused: such a text is never complete, and every
    unrepeated-key prefix of it still is accepted."""
    try:
        compiled = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer, backend)[0]
    except (UnsupportedGrammarError, SchemaNotEnforceableError):
        pytest.skip(f"{backend} refuses the schema")
    matcher = with_unique_keys(compiled.spec, compiled.matcher(), toy_tokenizer)
    tokens = toy_tokenizer.encode(text)
    assert not matcher.completes(tokens)
    assert matcher.fork().accept_tokens(tokens) < len(tokens)
    first = text.replace(text[text.index(",") : text.rindex("}")], "")
    assert matcher.completes(toy_tokenizer.encode(first)), first


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_batch_fills_of_wrapped_matchers_equal_their_own_fills(
    backend: str, gemma_tokenizer: Any
) -> None:
    """The batch grammar call fills the inner matchers natively, then each wrapper filters."""
    import torch

    from espalier.constrained.batch import BatchFiller

    compiled = _compiled(gemma_tokenizer, backend, FREE)
    text = '{"a": 1, "b": 2, "c": 3}'
    tokens = gemma_tokenizer.encode(text)
    matchers: list[Any] = []
    prefixes = [tokens[:cut] for cut in range(len(tokens) + 1)]
    prefixes.append(gemma_tokenizer.encode('{"name": 1, "value": 2, "name'))
    for prefix in prefixes:
        matcher = with_unique_keys(compiled.spec, compiled.matcher(), gemma_tokenizer)
        assert matcher.accept_tokens(prefix) == len(prefix)
        matchers += [matcher, matcher.inner.fork()]  # a plain matcher in the same batch too
    n = len(matchers)
    expected = bm.allocate(n, gemma_tokenizer.vocab_size, fill=0)
    for j, matcher in enumerate(matchers):
        matcher.fill_bitmask(expected, j)
    got = bm.allocate(n, gemma_tokenizer.vocab_size, fill=0x5EA)
    assert BatchFiller(2).fill_next_rows(matchers, got, list(range(n))) == {}
    assert torch.equal(got, expected)
    assert not torch.equal(expected[0::2], expected[1::2])  # some wrapped rows lost tokens


ESCAPED_SPELLINGS = [
    ('{"\\u0041": "x"}', False),  # "A" written with an escape: the backends took it as another key
    ('{"A": 1}', True),
    ('{"\\u00e9": "x"}', False),
    ('{"é": 2}', True),
    ('{"a\\/b": "x"}', False),
    ('{"a/b": "x"}', True),
    ('{"q\\"r\\\\s": "x"}', True),  # escapes a key needs
    ('{"t\\tu": "x"}', True),
    ('{"t\\u0009u": "x"}', False),  # "\t" is its spelling
    ('{"c\\u0001d": "x"}', True),
    ('{"c\\u001Fd": "x"}', False),
]


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_a_key_takes_no_escape_it_does_not_need(backend: str, toy_tokenizer: Any) -> None:
    """The backends match a key's text against their property names: ``{"\\u0041": "x"}`` was
    an unknown key to them, so the value skipped property A's schema. The key tracker refuses
    such escapes (each spelling's validity: JSON-decoded, the schema then says)."""
    schema = {"type": "object", "properties": {"A": {"type": "integer"}, "é": {"type": "integer"}}}
    compiled, _ = compile_grammar(GrammarSpec.json_schema(schema), toy_tokenizer, backend)
    for text, accepted in ESCAPED_SPELLINGS:
        matcher = with_unique_keys(compiled.spec, compiled.matcher(), toy_tokenizer)
        assert isinstance(matcher, UniqueKeysMatcher)
        assert matcher.completes(toy_tokenizer.encode(text)) is accepted, text


def test_few_names_are_declared(toy_tokenizer: Any) -> None:
    """``patternProperties`` matching few names in all, with ``additionalProperties: false``
    (``propertyNames: {pattern: ...}`` becomes one): the names are declared properties, no
    tracker wraps the matcher, and the backend itself refuses a repeated name (it writes
    declared properties in their order, as it does every object's)."""
    schema = {
        "type": "object",
        "patternProperties": {"^a$": {"type": "integer"}, "^x_[0-2]$": {"type": "string"}},
        "additionalProperties": False,
    }
    compiled = _compiled(toy_tokenizer, "llguidance", schema)
    assert not may_repeat_keys(compiled.spec)
    for text, whole in (
        ('{"a": 1, "x_0": "s"}', True),
        ('{"x_2": "s"}', True),  # in declared order (a, then x_0..x_2), as for any properties
        ('{"a": 1, "a": 2}', False),
        ('{"x_3": "s"}', False),
        ('{"a": "s"}', False),
    ):
        tokens = toy_tokenizer.encode(text)
        assert compiled.matcher().completes(tokens) is whole, text


def test_few_names_that_need_escapes_are_declared_too(toy_tokenizer: Any) -> None:
    """A held-out sweep: names ``a``, ``b``, ``"`` and ``\\`` with ``minProperties: 4`` stayed
    free keys (names that need escapes were not listed) and ended INTERNAL "duplicate key" at
    temperature 0 in 6 of 24 requests."""
    schema = {
        "type": "object",
        "patternProperties": {'^(?:a|b|"|\\\\|\u0001)$': {"type": "integer"}},
        "additionalProperties": False,
        "minProperties": 4,
    }
    compiled = _compiled(toy_tokenizer, "llguidance", schema)
    repeat = toy_tokenizer.encode('{"\\"": 1, "\\"')
    assert compiled.matcher().accept_tokens(repeat) < len(repeat)  # the backend refuses it
    whole = '{"\\u0001": 5, "\\"": 3, "\\\\": 4, "a": 1, "b": 2}'  # names in code point order
    assert compiled.matcher().completes(toy_tokenizer.encode(whole))
    assert not compiled.matcher().completes(toy_tokenizer.encode('{"\\"": 3, "a": 1, "b": 2}'))
