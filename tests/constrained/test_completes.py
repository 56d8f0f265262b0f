"""``GrammarMatcher.completes`` and ``accepted_prefix`` (closing-path checks without consuming)
against their definitions.

From random grammar-valid prefixes, runs that complete the grammar (closing paths), valid runs
that do not, runs with a random token inside (mostly rejected) and runs through a stop token, for
every backend and with the duplicate-key tracker: ``completes`` equals a fork accepting the run
then ``can_terminate``, ``accepted_prefix`` the count a fork's ``accept_tokens`` returns, and the
matcher's own next row and ``can_terminate`` stay as they were.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.backends import BACKENDS
from espalier.constrained.compile import compile_grammar
from espalier.constrained.keys.matcher import with_unique_keys
from espalier.constrained.spec import GrammarSpec
from espalier.engine.closing import ClosingPaths
from tests.fixtures.engine_fixtures import toy_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "integer"}},
        "meta": {"type": "object"},
    },
    "required": ["name"],
}


def _allowed(matcher: Any, row: torch.Tensor, vocab: int) -> list[int]:
    matcher.fill_bitmask(row, 0)
    return np.flatnonzero(bm.unpack_allowed(row[0], vocab)).tolist()


def _expected(matcher: Any, run: list[int]) -> bool:
    probe = matcher.fork()
    return probe.accept_tokens(run) == len(run) and probe.can_terminate()


def _state(matcher: Any) -> tuple[list[int], bool]:
    """What a check must leave as it was: the next row and ``can_terminate``."""
    row = bm.allocate(1, matcher.vocab_size, fill=0)
    return _allowed(matcher, row, matcher.vocab_size), matcher.can_terminate()


def _cases(
    backend: str, unique_keys: bool, seed: int, count: int
) -> Iterator[tuple[Any, list[int], list[int], random.Random, Any]]:
    """``count`` matchers at random grammar-valid states, each with a closing path from there
    (``[]``: none within 40), a short valid walk, the generator and the tokenizer."""
    tokenizer = toy_tokenizer()
    spec = GrammarSpec.json_schema(SCHEMA)
    # the matchers' mechanics are under test, not strictness: xgrammar does not enforce the
    # name's maxLength exactly (raw control characters), which strict mode would refuse
    compiled, _ = compile_grammar(spec, tokenizer, backend, allow_weakening=True)
    vocab = tokenizer.vocab_size
    stop = tokenizer.stop_token_ids[0]
    paths = ClosingPaths(tokenizer)
    row = bm.allocate(1, vocab, fill=0)
    rng = random.Random(seed)
    for _ in range(count):
        matcher = compiled.matcher()
        if unique_keys:
            matcher = with_unique_keys(spec, matcher, tokenizer)
        for _ in range(rng.randrange(0, 14)):
            choices = [t for t in _allowed(matcher, row, vocab) if t != stop]
            if not choices:
                break
            assert matcher.accept(rng.choice(choices))
        closing = paths.find(matcher, 40) or []
        walk, probe = [], matcher.fork()
        for _ in range(rng.randrange(1, 6)):
            choices = [t for t in _allowed(probe, row, vocab) if t != stop]
            if not choices:
                break
            walk.append(rng.choice(choices))
            assert probe.accept(walk[-1])
        yield matcher, closing, walk, rng, tokenizer


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("unique_keys", [False, True])
def test_completes_equals_accepting_on_a_fork(backend: str, unique_keys: bool) -> None:
    outcomes: list[bool] = []
    for matcher, closing, walk, rng, tokenizer in _cases(backend, unique_keys, 7, 12):
        stop = tokenizer.stop_token_ids[0]
        runs = [closing, closing[:-1], walk, [*walk, stop], [*closing, stop]]
        runs.append([*walk[:1], rng.randrange(tokenizer.vocab_size), *walk[1:]])
        before = _state(matcher)
        for run in runs:
            got = matcher.completes(run)
            assert got == _expected(matcher, run), run
            outcomes.append(got)
        assert _state(matcher) == before
    assert True in outcomes and False in outcomes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("unique_keys", [False, True])
def test_accepted_prefix_equals_accepting_on_a_fork(backend: str, unique_keys: bool) -> None:
    counts: set[int] = set()
    cases = list(_cases(backend, unique_keys, 11, 12))
    tokenizer = cases[0][4]
    stop, vocab = tokenizer.stop_token_ids[0], tokenizer.vocab_size
    checks: list[tuple[Any, list[list[int]]]] = []
    for matcher, closing, walk, rng, _ in cases:
        runs = [closing, closing[:1], walk, walk[:1], [*walk, stop], [*closing, stop, stop], []]
        runs.append([*walk[:1], rng.randrange(vocab), *walk[1:]])
        runs.append([*walk[:2], stop, *walk[2:]])
        runs.append([rng.randrange(vocab) for _ in range(2)])
        checks.append((matcher, runs))
    # inside an object that holds "name" already: a duplicate key ahead (the tracker refuses it)
    matcher = cases[0][0].fork()
    matcher.reset()
    assert matcher.accept_tokens(tokenizer.encode('{"name":"ab","')) > 0
    duplicate = tokenizer.encode('name":"c"}')
    checks.append((matcher, [duplicate, [*duplicate, stop], tokenizer.encode("nam"), [stop]]))
    for matcher, runs in checks:
        before = _state(matcher)
        for run in runs:
            got = matcher.accepted_prefix(run)
            assert got == matcher.fork().accept_tokens(run), run
            assert matcher.completes(run) == _expected(matcher, run), run
            counts.add(min(got, 2))
        assert _state(matcher) == before
    assert counts == {0, 1, 2}


@pytest.mark.parametrize("backend", BACKENDS)
def test_takes_all_natively_is_each_token_a_library_token(
    backend: str, toy_tokenizer_padded: Any
) -> None:
    """``takes_all_natively`` (the check before a native ``completes`` / ``accepted_prefix``)
    equals asking each token alone: in the tokenizer's vocabulary (not negative, not padding),
    not a special id, not a stop id; and False once terminated."""
    tokenizer = toy_tokenizer_padded
    compiled, _ = compile_grammar(
        GrammarSpec.json_schema(SCHEMA), tokenizer, backend, allow_weakening=True
    )
    matcher = compiled.matcher()
    stops, text = set(tokenizer.stop_token_ids), tokenizer.tokenizer_vocab_size
    special = {0}  # <pad>
    odd = [-1, 0, text - 1, text, tokenizer.vocab_size - 1, *stops]
    rng = random.Random(3)
    for _ in range(300):
        tokens = [
            rng.choice(odd) if rng.random() < 0.2 else rng.randrange(3, text)
            for _ in range(rng.randrange(0, 6))
        ]
        expected = all(0 <= t < text and t not in special and t not in stops for t in tokens)
        assert matcher.takes_all_natively(tokens) == expected, tokens
    path = ClosingPaths(tokenizer).find(matcher, 64)
    assert path is not None and matcher.accept_tokens(path) == len(path)
    assert matcher.accept(next(iter(stops)))
    assert not matcher.takes_all_natively([3]) and not matcher.takes_all_natively([])
