"""The native closing-path search (llguidance, ``llg_close.c``) against ``ClosingPaths.search``.

``ClosingPaths.search`` (Python, on a fork) is the definition; ``ClosingPaths.search_after``
runs the same search natively where the matcher's backend can (llguidance, with or without the
duplicate-key tracker). At states along valid instances of JSONSchemaBench schemas (Gemma
tokenizer) and along random allowed tokens (toy tokenizer, free-key objects, so the tracker's
duplicate and dead-end rules come up), for the next token, a random allowed one and a random
one (mostly rejected), at several limits, both must give the same acceptance and the same path
token for token. A change to the Python choices that the C search does not follow fails here.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

import numpy as np
import pytest

from espalier.constrained import bitmask as bm
from espalier.constrained.base import FALLBACK
from espalier.constrained.compile import compile_grammar
from espalier.constrained.errors import GrammarError
from espalier.constrained.keys import with_unique_keys
from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import SamplingParams
from espalier.engine.closing import SEARCH_LIMIT, BudgetCloser, ClosingPaths, Memo
from espalier.engine.closing.ahead import _outcomes as ahead_outcomes
from espalier.engine.closing.ahead import native_tree, tree_decisions
from espalier.engine.request import Request
from tests.fixtures.jsonschemabench import schema_cases

SLOW = os.environ.get("ESPALIER_SLOW") == "1"
LIMITS = (0, 3, 12, SEARCH_LIMIT)
FREE_KEYS = [
    {"type": "object"},
    {"type": "object", "additionalProperties": {"type": "integer"}},
    {"type": "array", "items": {"type": "object", "additionalProperties": {"type": "boolean"}}},
    {
        "type": "object",
        "properties": {"a": {"type": "string"}},
        "patternProperties": {"^b+$": {"type": "integer"}},
        "additionalProperties": False,
    },
]


def _python(paths: ClosingPaths, matcher: Any, token: int, limit: int) -> tuple[bool, Any]:
    probe = matcher.fork()
    if not probe.accept(token):
        return False, None
    return True, paths.search(probe, limit)


def _compare(
    paths: ClosingPaths, matcher: Any, tokens: list[int], rng: random.Random, problems: list[str]
) -> int:
    """Compare both searches for each of ``tokens`` at a random limit; how many ran natively."""
    native = 0
    for token in tokens:
        limit = rng.choice(LIMITS)
        search = matcher.native_closing(token, limit)
        assert search is not None, "the native search serves llguidance matchers"
        outcome = search.kind(paths.rules, [search], 1)[0]
        assert outcome is not FALLBACK
        got = (outcome is not False, outcome if isinstance(outcome, list) else None)
        expected = _python(paths, matcher, token, limit)
        if got != expected:
            problems.append(f"token {token} limit {limit}: native {got}, python {expected}")
        # the entry point: the same greedy answer, then the fallback where it found no path
        assert paths.search_after(matcher, token, limit) == paths.or_fallback(
            matcher, token, limit, expected
        )
        native += 1
    return native


def _allowed(matcher: Any, row: Any, vocab: int) -> list[int]:
    matcher.fill_bitmask(row, 0)
    return np.flatnonzero(bm.unpack_allowed(row[0], vocab)).tolist()


def _matcher(spec: GrammarSpec, tokenizer: Any) -> tuple[Any, Any]:
    compiled, _ = compile_grammar(spec, tokenizer, "llguidance")
    assert compiled.native_slot is not None and compiled.native_slot.wait(60) is not None
    return compiled, with_unique_keys(spec, compiled.matcher(), tokenizer)


# whitespace next to other ids (the fallback tries whitespace last; in the toy vocabulary " " is
# 223 and "\x7f" 224), repeats (REPEAT_LIMIT's escape) and regexes without JSON candidates
REGEXES = ["[ \x7f]*\x7f", "( |\t)*[a-c]{2}", "x( y)*;", "(ab|a)*c"]


def _specs(kind: str) -> list[GrammarSpec]:
    """The random walks' grammars: free-key schemas (the tracker's rules) or regexes."""
    if kind == "schemas":
        return [GrammarSpec.json_schema(schema) for schema in FREE_KEYS]
    return [GrammarSpec.regex(pattern) for pattern in REGEXES]


@pytest.mark.parametrize("kind", ["schemas", "regexes"])
def test_native_search_equals_python_on_random_walks(kind: str, toy_tokenizer: Any) -> None:
    paths = ClosingPaths(toy_tokenizer)
    vocab = toy_tokenizer.vocab_size
    stops = set(toy_tokenizer.stop_token_ids)
    row = bm.allocate(1, vocab, fill=0)
    rng = random.Random(7)
    problems: list[str] = []
    checked = 0
    for spec in _specs(kind):
        for _ in range(40 if SLOW else 12):
            _, matcher = _matcher(spec, toy_tokenizer)
            for _ in range(rng.randrange(1, 40)):
                allowed = [t for t in _allowed(matcher, row, vocab) if t not in stops]
                if not allowed:
                    break
                tries = [rng.choice(allowed), rng.randrange(vocab)]
                checked += _compare(paths, matcher, tries, rng, problems)
                assert matcher.accept(tries[0])
    assert checked > 200
    assert problems == []


DEAD_ENDS = [  # (schema, a text into the tracker's dead end: every way on repeats an item or key)
    (  # "a" can only end (maxLength 1 would refuse the second a itself: at its longest)
        {"type": "array", "items": {"type": "string", "pattern": "^(a|b+)$"}, "uniqueItems": True},
        '["a","a',
    ),
    ({"type": "object", "propertyNames": {"maxLength": 1}}, '{"a":1,"a'),
    (  # 676 names: not listed as properties (``pattern_properties.finite_names``)
        {
            "type": "object",
            "patternProperties": {"^[a-z]{2}$": {"type": "integer"}},
            "additionalProperties": False,
        },
        '{"ab":1,"cd":2,"cd',
    ),
]


@pytest.mark.parametrize(("schema", "text"), DEAD_ENDS)
def test_native_search_equals_python_at_dead_ends(
    schema: dict[str, Any], text: str, toy_tokenizer: Any
) -> None:
    """Along a text into the tracker's dead end (where the row keeps tokens that complete a
    duplicate, and ``accept`` refuses them), both searches refuse the same tokens and find the
    same paths, at every state of the text, for every allowed token."""
    paths = ClosingPaths(toy_tokenizer)
    vocab = toy_tokenizer.vocab_size
    row = bm.allocate(1, vocab, fill=0)
    rng = random.Random(11)
    problems: list[str] = []
    compiled, _ = _matcher(GrammarSpec.json_schema(schema), toy_tokenizer)
    # the compiled spec: its source marks the unique arrays (a tracked place)
    matcher = with_unique_keys(compiled.spec, compiled.matcher(), toy_tokenizer)
    tokens = toy_tokenizer.encode(text)
    for token in tokens:
        _compare(paths, matcher, _allowed(matcher, row, vocab), rng, problems)
        assert matcher.accept(token)
    stuck = [t for t in _allowed(matcher, row, vocab) if not matcher.fork().accept(t)]
    assert stuck, "the text ends in a dead end: the row keeps tokens accept refuses"
    _compare(paths, matcher, _allowed(matcher, row, vocab), rng, problems)
    assert problems == []


@pytest.mark.model
def test_native_search_equals_python_on_jsonschemabench(gemma_tokenizer: Any) -> None:
    paths = ClosingPaths(gemma_tokenizer)
    vocab = gemma_tokenizer.vocab_size
    stops = set(gemma_tokenizer.stop_token_ids)
    row = bm.allocate(1, vocab, fill=0)
    rng = random.Random(11)
    problems: list[str] = []
    checked = schemas = 0
    for name, schema, data in schema_cases(6 if SLOW else 2):
        spec = GrammarSpec.json_schema(schema)
        try:
            _, matcher = _matcher(spec, gemma_tokenizer)
        except GrammarError:
            continue
        instance = gemma_tokenizer.encode(json.dumps(data))
        found: list[str] = []
        for token in instance:
            tries = [token]
            if rng.random() < 0.3:
                allowed = [t for t in _allowed(matcher, row, vocab) if t not in stops]
                tries += [rng.choice(allowed), rng.randrange(vocab)] if allowed else []
            checked += _compare(paths, matcher, tries, rng, found)
            if not matcher.accept(token):
                break
        problems += [f"{name}: {p}" for p in found]
        schemas += 1
    assert schemas >= 5 and checked > 100
    assert problems == []


def test_prepared_decisions_equal_inline_ones(toy_tokenizer: Any) -> None:
    """``BudgetCloser.prepare`` (a batch's decisions, searches in one native call per wave)
    leaves ``instead`` with the same paths and memos as deciding each one inline."""
    stops = set(toy_tokenizer.stop_token_ids)
    vocab = toy_tokenizer.vocab_size
    row = bm.allocate(1, vocab, fill=0)
    rng = random.Random(3)
    batched, inline = BudgetCloser(toy_tokenizer, threads=2), BudgetCloser(toy_tokenizer)
    pairs = []
    for k in range(8):
        spec = GrammarSpec.json_schema(FREE_KEYS[k % len(FREE_KEYS)])
        compiled, matcher = _matcher(spec, toy_tokenizer)
        sides = []
        params = SamplingParams(max_tokens=rng.randrange(4, 30))
        for side in ("b", "i"):
            request = Request(f"r{k}", [1], params, 0)
            request.compiled = compiled
            request.matcher = matcher if side == "b" else matcher.fork()
            sides.append(request)
        pairs.append(sides)
    decided = prepared = 0
    while pairs:
        tokens = []
        for ours, _ in pairs:
            allowed = [t for t in _allowed(ours.matcher, row, vocab) if t not in stops]
            tokens.append(rng.choice(allowed) if allowed else next(iter(stops)))
        items = [
            (ours, token, len(ours.output_ids), stops) for (ours, _), token in zip(pairs, tokens)
        ]
        batched.prepare(items, 1 << 20)
        prepared += len(batched._ready)
        left = []
        for (ours, theirs), token in zip(pairs, tokens):
            path = batched.instead(ours, token, stops, 1 << 20)
            assert path == inline.instead(theirs, token, stops, 1 << 20)
            assert batched.known(ours.request_id) == inline.known(theirs.request_id)
            decided += 1
            done = path is not None or token in stops
            done = done or len(ours.output_ids) + 1 >= ours.sampling.max_tokens
            if not done:
                for request in (ours, theirs):
                    request.output_ids.append(token)
                    assert request.matcher.accept(token)
                left.append((ours, theirs))
        pairs = left
    assert decided > 40 and prepared > 10


def test_prepared_decisions_count_a_pending_run_in_the_context_budget(toy_tokenizer: Any) -> None:
    """A speculative step prepares its first decision past the accepted run before the run is
    appended (``Engine._prepare_closing``: ``here`` counts the run). Where the context limit
    binds the budget, the prepared decision must be the one ``instead`` makes once the run is
    in the output: the budget counts the run's tokens too."""
    stops = set(toy_tokenizer.stop_token_ids)
    vocab = toy_tokenizer.vocab_size
    row = bm.allocate(1, vocab, fill=0)
    rng = random.Random(5)
    taken = closed = 0
    for _ in range(24 if SLOW else 10):
        batched, inline = BudgetCloser(toy_tokenizer, threads=2), BudgetCloser(toy_tokenizer)
        cases = []
        for k in range(6):
            spec = GrammarSpec.json_schema(FREE_KEYS[k % len(FREE_KEYS)])
            compiled, matcher = _matcher(spec, toy_tokenizer)
            prefix: list[int] = []
            for _ in range(rng.randrange(2, 12)):
                allowed = [t for t in _allowed(matcher, row, vocab) if t not in stops]
                if not allowed:
                    break
                prefix.append(rng.choice(allowed))
                assert matcher.accept(prefix[-1])
            allowed = [t for t in _allowed(matcher, row, vocab) if t not in stops]
            if len(prefix) < 2 or not allowed:
                continue
            run = rng.randrange(1, len(prefix))  # accepted, not yet in the output
            params = SamplingParams(max_tokens=1000)
            ours = Request(f"r{k}", [1], params, 0)
            theirs = Request(f"r{k}", [1], params, 0)
            ours.output_ids, theirs.output_ids = list(prefix[:-run]), list(prefix)
            ours.matcher, theirs.matcher = matcher, matcher.fork()
            ours.compiled = theirs.compiled = compiled
            cases.append((ours, theirs, prefix, rng.choice(allowed)))
        # the context binds every budget: a few tokens of room past the longest prefix
        limit = 1 + max(len(prefix) for _, _, prefix, _ in cases) + rng.randrange(2, 8)
        batched.prepare([(ours, t, len(prefix), stops) for ours, _, prefix, t in cases], limit)
        taken += len(batched._ready)
        for ours, theirs, prefix, token in cases:
            ours.output_ids = list(prefix)  # the run appended, as ``_take_run`` does
            got = batched.instead(ours, token, stops, limit)
            assert got == inline.instead(theirs, token, stops, limit)
            assert batched.known(ours.request_id) == inline.known(theirs.request_id)
            closed += got is not None
    assert taken > 10 and closed > 0


def _random_tree(
    matcher: Any, row: Any, vocab: int, stops: set[int], rng: random.Random
) -> tuple[list[int], list[int]]:
    """A draft tree below ``matcher``'s state: chains of allowed tokens (each node's children
    drawn from its own state), a few random ids (mostly rejected) and now and then a stop."""
    tokens, parents = [0], [-1]
    frontier = [(0, matcher.fork())]
    while frontier and len(tokens) < 12:
        node, at = frontier.pop(0)
        allowed = [t for t in _allowed(at, row, vocab) if t not in stops]
        kids = rng.sample(allowed, min(len(allowed), rng.choice((1, 1, 2, 3))))
        kids += [rng.randrange(vocab)] if rng.random() < 0.3 else []
        kids += [next(iter(stops))] if rng.random() < 0.1 else []
        for token in kids:
            tokens.append(token)
            parents.append(node)
            below = at.fork()
            if token not in stops and below.accept(token) and not below.is_terminated():
                frontier.append((len(tokens) - 1, below))
    return tokens, parents


def _memo(paths: ClosingPaths, matcher: Any, here: int, rng: random.Random) -> Memo:
    """A memo as a request may hold one: none yet, the state's own path, a stale one (kept from
    an earlier state), spaced checks, unclosable."""
    kind = rng.randrange(5)
    path = paths.find(matcher, 40) if kind in (1, 2) else None
    if kind == 1 and path is not None:
        return Memo((here, path), here)
    if kind == 2 and path is not None:
        return Memo((max(0, here - 2), [*path[1:], *path[:1]]), here - rng.randrange(3))
    if kind == 3:
        return Memo(None, here + rng.randrange(-2, 3))
    return Memo(None, 0, kind == 4 and rng.random() < 0.3)


def _compare_trees(
    closer: BudgetCloser,
    matcher: Any,
    tokenizer: Any,
    rng: random.Random,
    problems: list[str],
) -> tuple[int, int]:
    """One random tree at ``matcher``'s state, decided by ``tree_decisions`` in Python and as
    one native job: (nodes compared, 1 when the native job fell back)."""
    assert closer.paths is not None
    vocab = tokenizer.vocab_size
    stops = set(tokenizer.stop_token_ids)
    row = bm.allocate(1, vocab, fill=0)
    tokens, parents = _random_tree(matcher, row, vocab, stops, rng)
    here = rng.randrange(0, 50)
    limits = (here + rng.randrange(1, 45), here + rng.choice((3, 30, 10_000)))
    memo = _memo(closer.paths, matcher, here, rng)
    filled = None if rng.random() < 0.5 else [rng.random() < 0.8 for _ in tokens]
    inputs = (memo, matcher.fork(), tokens, parents, here, limits, frozenset(stops), filled)
    native = native_tree(*inputs)
    assert native is not None, "llguidance matchers decide trees natively"
    outcome = native[0].trees(closer.paths.rules, [native], 1)[0]
    try:
        expected = closer.paths.answer(tree_decisions(closer, *inputs))
    except GrammarError:
        return 0, 0
    if outcome is FALLBACK:
        return 0, 1
    assert isinstance(outcome, list)
    got = ahead_outcomes(outcome)
    if got != expected:
        problems.append(f"tree {tokens} {parents} memo {memo} limits {limits}: {got} != {expected}")
    return sum(o is not None for o in expected), 0


@pytest.mark.parametrize("kind", ["schemas", "regexes"])
def test_native_trees_equal_python_trees_on_random_walks(kind: str, toy_tokenizer: Any) -> None:
    """Every node's decision and memo of a draft tree decided as one native job
    (``NativeClosing.trees``, ``llg_close.c``) equal ``ahead.tree_decisions``' in Python, with
    and without the duplicate-key tracker, on random trees, memos and budgets."""
    closer = BudgetCloser(toy_tokenizer)
    vocab = toy_tokenizer.vocab_size
    stops = set(toy_tokenizer.stop_token_ids)
    row = bm.allocate(1, vocab, fill=0)
    rng = random.Random(17)
    problems: list[str] = []
    nodes = fallbacks = trees = 0
    for spec in _specs(kind):
        for _ in range(12 if SLOW else 4):
            _, matcher = _matcher(spec, toy_tokenizer)
            for _ in range(rng.randrange(1, 30)):
                compared, fell = _compare_trees(closer, matcher, toy_tokenizer, rng, problems)
                nodes, fallbacks, trees = nodes + compared, fallbacks + fell, trees + 1
                allowed = [t for t in _allowed(matcher, row, vocab) if t not in stops]
                if not allowed:
                    break
                assert matcher.accept(rng.choice(allowed))
    assert problems == []
    # a tree falls back where a node's state has no greedy path (Python's backtracking search)
    assert nodes > 300 and fallbacks < trees // 3


@pytest.mark.model
def test_native_trees_equal_python_trees_on_jsonschemabench(gemma_tokenizer: Any) -> None:
    """As above along valid JSONSchemaBench instances (Gemma tokenizer)."""
    closer = BudgetCloser(gemma_tokenizer)
    rng = random.Random(19)
    problems: list[str] = []
    nodes = fallbacks = trees = schemas = 0
    for name, schema, data in schema_cases(6 if SLOW else 2):
        spec = GrammarSpec.json_schema(schema)
        try:
            _, matcher = _matcher(spec, gemma_tokenizer)
        except GrammarError:
            continue
        found: list[str] = []
        for token in gemma_tokenizer.encode(json.dumps(data)):
            if rng.random() < 0.3:
                compared, fell = _compare_trees(closer, matcher, gemma_tokenizer, rng, found)
                nodes, fallbacks, trees = nodes + compared, fallbacks + fell, trees + 1
            if not matcher.accept(token):
                break
        problems += [f"{name}: {p}" for p in found]
        schemas += 1
    assert problems == []
    assert schemas >= 5 and nodes > 100 and fallbacks < trees // 3
