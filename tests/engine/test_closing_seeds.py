"""The window's first check searches the state before its token first
(``BudgetCloser.first_seed``), and a closing worker makes that search ahead for the token after a
draft tree (``_Mirrors.prepare``, while the forward runs): the bonus query then needs no search,
and every decision is the inline one.

Real grammars (llguidance), the toy tokenizer, the worker's mirrors in process (the pipe is
covered by ``test_closing_remote``)."""

from __future__ import annotations

import random

import pytest
from engine_fixtures import CLOSING_SCHEMA, toy_tokenizer
from test_closing_ahead import _stream

from espalier.constrained.compile import compile_grammar
from espalier.constrained.spec import GrammarSpec
from espalier.engine.closing import CLOSING_WINDOW, NO_MEMO, BudgetCloser, first_check_due
from espalier.engine.closing_remote import Entry, _Mirrors

SPEC = GrammarSpec.json_schema(CLOSING_SCHEMA)
HERE = 4  # output length when the step starts: the first draft token is checked there


def _setup(seed: int) -> tuple[object, list[int]]:
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(SPEC, tokenizer, "llguidance")
    return compiled, _stream(tokenizer, compiled, random.Random(seed), 14)


def _entry(stream: list[int], tokens: list[int], parents: list[int], max_tokens: int) -> Entry:
    """Request "r" at output length HERE (the stream's first tokens), opening its mirror, with
    the draft tree ``tokens``/``parents`` (node 0: the last output token)."""
    stops = frozenset(toy_tokenizer().stop_token_ids)
    opening, limits = ("llguidance", SPEC), (max_tokens, 10_000)
    return Entry("r", opening, stream[:HERE], HERE, NO_MEMO, tokens, parents, HERE, limits, stops)


@pytest.mark.parametrize("seed", [2, 5, 11])
@pytest.mark.parametrize("depth", [3, 1])
def test_the_bonus_first_check_is_searched_ahead(seed: int, depth: int) -> None:
    # The window's first check falls on the token after the deepest node (the bonus token);
    # every node of the chain before it is let through without a check.
    compiled, stream = _setup(seed)
    tokenizer = toy_tokenizer()
    max_tokens = HERE + depth + CLOSING_WINDOW
    tokens, parents = stream[HERE - 1 : HERE + depth], list(range(-1, depth))
    entry = _entry(stream, tokens, parents, max_tokens)
    mirrors = _Mirrors(tokenizer)
    outcomes = mirrors.decide(entry)
    assert outcomes is not None and all(o == (None, NO_MEMO) for o in outcomes[1:])
    mirrors.prepare("r")
    bonus_at = HERE + depth
    budget = max_tokens - bonus_at
    leaf = compiled.matcher()
    assert leaf.accept_tokens(stream[:bonus_at]) == bonus_at
    inline = BudgetCloser(tokenizer)
    # only the deepest node's next token is a first check; the seed is the inline search's
    assert first_check_due(NO_MEMO, bonus_at, budget)
    assert mirrors._seeds["r"] == {depth: inline.first_seed(leaf, budget)}
    assert mirrors._seeds["r"][depth]  # a path: the seed the decision starts from
    bonus = stream[bonus_at]
    want = inline.decide(NO_MEMO, leaf, bonus, bonus_at, budget, False)
    # the answer needs no search of the state before the bonus token any more
    mirrors.closer.first_seed = _forbidden  # type: ignore[method-assign]
    assert mirrors.answer(("r", stream[HERE:bonus_at], bonus)) == want
    assert want[1].known is not None  # the check found a path after the token


def _forbidden(*_: object) -> None:
    raise AssertionError("searched at query time")


def test_only_the_node_before_the_window_gets_a_seed() -> None:
    # The window starts at the tree's second node (output length HERE + 1). The path may stop
    # at the first node, so the token after it may be the window's first check: it gets a
    # seed. The nodes inside the window have been checked (their memos know a path) and the
    # root's next token is outside the window: no seed for them.
    compiled, stream = _setup(2)
    tokenizer = toy_tokenizer()
    max_tokens = HERE + 1 + CLOSING_WINDOW
    tokens, parents = stream[HERE - 1 : HERE + 3], [-1, 0, 1, 2]
    entry = _entry(stream, tokens, parents, max_tokens)
    mirrors = _Mirrors(tokenizer)
    outcomes = mirrors.decide(entry)
    assert outcomes is not None
    assert all(o is not None and o[1].known is not None for o in outcomes[2:])
    mirrors.prepare("r")
    first = compiled.matcher()
    assert first.accept_tokens(stream[: HERE + 1]) == HERE + 1
    inline = BudgetCloser(tokenizer)
    assert mirrors._seeds["r"] == {1: inline.first_seed(first, CLOSING_WINDOW)}


def test_a_first_check_with_the_seed_given_decides_alike() -> None:
    # ``before`` is only the result of the search the decision would make itself.
    compiled, stream = _setup(5)
    closer = BudgetCloser(toy_tokenizer())
    for at in range(2, 10):
        matcher = compiled.matcher()
        assert matcher.accept_tokens(stream[:at]) == at
        for budget in (3, 6, 12, CLOSING_WINDOW):
            want = closer.decide(NO_MEMO, matcher, stream[at], at, budget, False)
            seed = closer.first_seed(matcher, budget)
            got = closer.decide(NO_MEMO, matcher, stream[at], at, budget, False, before=seed)
            assert got == want, (at, budget)
