"""fill_tree_bitmask on ASCII-drawn trees over a toy vocabulary, for every backend.

Semantics checked node by node (valid / filled / terminated / rows), against the replay oracle
(``tests/fixtures/tree_oracle.py``), plus: state restored, budget cut, root row reuse,
forced tokens, and the generic walker on a matcher no fast path knows.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from espalier.constrained import bitmask as bm
from espalier.constrained.backends import BACKENDS, get_backend
from espalier.constrained.base import GrammarMatcher
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.tree import DraftTree
from espalier.constrained.tree.masks import fill_tree_bitmask, fill_with
from espalier.constrained.tree.walk import stop_row, walk_generic
from tests.fixtures.tree_oracle import compare, replay_tree
from tests.fixtures.tree_random import tree_from_paths

REGEX = "xy+z"  # characters without BPE merges in the toy vocabulary


def ids(tokenizer: Any, text: str) -> list[int]:
    return [tokenizer.hf.convert_tokens_to_ids(char) for char in text]


def drawn_tree(tokenizer: Any) -> tuple[DraftTree, dict[str, list[bool]]]:
    """The tree below and the expected flags per node (regex ``xy+z``, stop = <eos>)."""
    a, b, c, x = ids(tokenizer, "xyzq")
    eos = tokenizer.stop_token_ids[0]
    tree = DraftTree.from_parents(
        [0, a, b, b, x, c, b, b, eos, eos, a, tokenizer.vocab_size - 1],
        [-1, 0, 0, 1, 1, 3, 3, 4, 5, 8, 8, 1],
    )
    drawing = "\n".join(
        [
            "0:<root>",
            "├─1:x",  # valid
            "│ ├─3:y",  # valid
            "│ │ ├─5:z",  # valid, complete
            "│ │ │ └─8:<eos>",  # valid, terminated
            "│ │ │   ├─9:<eos>",  # valid: a repeated stop token is a no-op
            "│ │ │   └─10:x",  # invalid: nothing after termination
            "│ │ └─6:y",  # valid
            "│ ├─4:q",  # invalid
            "│ │ └─7:y",  # invalid: subtree of an invalid node
            "│ └─11:<pad>",  # invalid: the last id, special (or padding)
            "└─2:y",  # invalid
        ]
    )
    names = {t: tokenizer.hf.convert_ids_to_tokens(t) for t in tree.tokens.tolist()}
    assert tree.draw(lambda t: "<pad>" if t >= 297 else names[t]) == drawing
    valid = [True, True, False, True, False, True, True, False, True, True, False, False]
    term = [False] * 8 + [True, True, False, False]
    return tree, {"valid": valid, "terminated": term}


def compiled(name: str, tokenizer: Any, spec: GrammarSpec) -> Any:
    return get_backend(name, tokenizer).compile(spec)


def state_snapshot(matcher: GrammarMatcher) -> tuple[bytes, bool, bool]:
    row = bm.allocate(1, matcher.vocab_size, fill=0)
    matcher.fill_bitmask(row, 0)
    return row.numpy().tobytes(), matcher.is_terminated(), matcher.can_terminate()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("padded", [False, True])
def test_drawn_tree_semantics(
    backend: str, padded: bool, toy_tokenizer: Any, toy_tokenizer_padded: Any
) -> None:
    tokenizer = toy_tokenizer_padded if padded else toy_tokenizer
    grammar = compiled(backend, tokenizer, GrammarSpec.regex(REGEX))
    tree, expected = drawn_tree(tokenizer)
    matcher = grammar.matcher()
    before = state_snapshot(matcher)
    out = bm.allocate(tree.num_nodes + 2, tokenizer.vocab_size, fill=0)
    masks = fill_tree_bitmask(matcher, tree, out, budget=None)
    assert masks.valid.tolist() == expected["valid"]
    assert masks.filled.tolist() == expected["valid"]
    assert masks.terminated.tolist() == expected["terminated"]
    assert not masks.budget_hit
    assert compare(masks, out, tree, replay_tree(grammar.matcher, [], tree)) == []
    rows = out.numpy()
    words = rows.shape[1]
    stops = tuple(tokenizer.stop_token_ids)
    for node in (8, 9):
        assert np.array_equal(rows[node], stop_row(words, stops))
    assert bm.allowed_tokens(rows[5], tokenizer.vocab_size) == list(stops)
    assert bm.allowed_tokens(rows[3], tokenizer.vocab_size) == ids(tokenizer, "yz")
    for node in np.flatnonzero(~masks.filled):
        assert set(stops) <= set(bm.allowed_tokens(rows[node], tokenizer.vocab_size))
    assert not rows[tree.num_nodes :].any()  # rows past the tree are untouched
    assert state_snapshot(matcher) == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_restored_mid_generation_and_when_terminated(
    backend: str, toy_tokenizer: Any
) -> None:
    grammar = compiled(backend, toy_tokenizer, GrammarSpec.regex(REGEX))
    a, b, c = ids(toy_tokenizer, "xyz")
    eos = toy_tokenizer.stop_token_ids[0]
    matcher = grammar.matcher()
    for token in (a, b):
        assert matcher.accept(token)
    tree = tree_from_paths(b, [[b, b, c, eos], [c, eos, eos], [c, a]])
    out = bm.allocate(tree.num_nodes, toy_tokenizer.vocab_size)
    before = state_snapshot(matcher)
    masks = fill_tree_bitmask(matcher, tree, out, budget=None)
    assert compare(masks, out, tree, replay_tree(grammar.matcher, [a, b], tree)) == []
    assert state_snapshot(matcher) == before
    for token in (c, eos):
        assert matcher.accept(token)
    tree = tree_from_paths(eos, [[eos, eos], [a]])
    masks = fill_tree_bitmask(matcher, tree, out, budget=None)
    assert masks.valid.tolist() == [True, True, True, False]
    assert masks.terminated.tolist() == [True, True, True, False]
    assert compare(masks, out, tree, replay_tree(grammar.matcher, [a, b, c, eos], tree)) == []
    assert matcher.is_terminated()


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_budget_fills_only_the_root(backend: str, toy_tokenizer: Any) -> None:
    grammar = compiled(backend, toy_tokenizer, GrammarSpec.regex(REGEX))
    tree, _ = drawn_tree(toy_tokenizer)
    matcher = grammar.matcher()
    before = state_snapshot(matcher)
    out = bm.allocate(tree.num_nodes, toy_tokenizer.vocab_size, fill=0)
    masks = fill_tree_bitmask(matcher, tree, out, budget=0.0)
    assert masks.budget_hit
    assert masks.filled.tolist() == [True] + [False] * (tree.num_nodes - 1)
    assert compare(masks, out, tree, replay_tree(grammar.matcher, [], tree)) == []
    assert state_snapshot(matcher) == before


@pytest.mark.parametrize("backend", ["outlines_core"])  # llguidance's walk reads the C clock:
@pytest.mark.parametrize("ticks", [2, 4, 6, 8])  # its budget cuts: test_llguidance_native.py
def test_budget_cut_mid_walk_is_never_wrong(
    backend: str, ticks: int, toy_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clock that advances one second per reading cuts the walk after ``ticks`` readings (the
    drawn tree takes 9 readings or more to walk whole, on every backend)."""
    grammar = compiled(backend, toy_tokenizer, GrammarSpec.regex(REGEX))
    tree, expected = drawn_tree(toy_tokenizer)
    matcher = grammar.matcher()
    before = state_snapshot(matcher)
    out = bm.allocate(tree.num_nodes, toy_tokenizer.vocab_size, fill=0)
    clock = iter(range(10_000))
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    masks = fill_tree_bitmask(matcher, tree, out, budget=ticks - 0.5)
    monkeypatch.undo()
    assert masks.budget_hit
    assert 1 <= masks.filled.sum() <= sum(expected["valid"])
    assert compare(masks, out, tree, replay_tree(grammar.matcher, [], tree)) == []
    assert state_snapshot(matcher) == before


class Opaque:
    """A GrammarMatcher seen only through its protocol (delegates everything)."""

    compiled = None  # hides the backend's compiled grammar from the generic walk

    def __init__(self, inner: GrammarMatcher) -> None:
        self.inner = inner
        self.tokenizer = inner.tokenizer  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size


@pytest.mark.parametrize("backend", BACKENDS)
def test_generic_walker_matches_fast_path(backend: str, toy_tokenizer_padded: Any) -> None:
    grammar = compiled(backend, toy_tokenizer_padded, GrammarSpec.regex(REGEX))
    tree, _ = drawn_tree(toy_tokenizer_padded)
    fast = bm.allocate(tree.num_nodes, toy_tokenizer_padded.vocab_size, fill=0)
    slow = bm.allocate(tree.num_nodes, toy_tokenizer_padded.vocab_size, fill=0)
    opaque = Opaque(grammar.matcher())
    a = fill_tree_bitmask(grammar.matcher(), tree, fast, budget=None)
    b = fill_with(
        opaque, tree, slow, budget=None, root_row=None, walk=walk_generic, bounded_walk=None
    )
    assert a.valid.tolist() == b.valid.tolist() and a.filled.tolist() == b.filled.tolist()
    assert np.array_equal(fast.numpy()[a.filled], slow.numpy()[b.filled])


@pytest.mark.parametrize("backend", BACKENDS)
def test_root_row_reuse(backend: str, toy_tokenizer: Any) -> None:
    """The row of the node verification ended on, passed as ``root_row``, gives the same masks
    as asking the grammar for the root again."""
    grammar = compiled(backend, toy_tokenizer, GrammarSpec.regex(REGEX))
    a, b, c = ids(toy_tokenizer, "xyz")
    tree = tree_from_paths(0, [[a, b, b], [a, c]])  # nodes: 1:a 2:b 3:c 4:b
    out = bm.allocate(tree.num_nodes, toy_tokenizer.vocab_size)
    matcher = grammar.matcher()
    masks = fill_tree_bitmask(matcher, tree, out, budget=None)
    assert masks.filled.tolist()[:3] == [True, True, True]
    assert matcher.accept_tokens([a, b]) == 2  # verification accepted nodes 1 and 2
    root_row = out.numpy()[2].copy()
    nxt = tree_from_paths(b, [[b], [c]])
    reused = bm.allocate(nxt.num_nodes, toy_tokenizer.vocab_size)
    fresh = bm.allocate(nxt.num_nodes, toy_tokenizer.vocab_size)
    m1 = fill_tree_bitmask(matcher, nxt, reused, budget=None, root_row=root_row)
    m2 = fill_tree_bitmask(matcher, nxt, fresh, budget=None)
    assert m1.valid.tolist() == m2.valid.tolist() == [True, True, True]
    assert np.array_equal(reused.numpy(), fresh.numpy())


@pytest.mark.parametrize("backend", BACKENDS)
def test_forced_tokens_are_accepted_and_state_kept(backend: str, toy_tokenizer: Any) -> None:
    grammar = compiled(backend, toy_tokenizer, GrammarSpec.regex("ababqq(c|d)"))
    matcher = grammar.matcher()
    before = state_snapshot(matcher)
    chain = matcher.forced_tokens(8)
    assert state_snapshot(matcher) == before
    assert chain, "the grammar forces 'ababqq'"
    assert "ababqq".startswith(toy_tokenizer.decode(chain))
    fresh = grammar.matcher()
    assert all(fresh.accept(t) for t in chain)
    assert matcher.forced_tokens(0) == []


def test_llguidance_tokenizer_callback_is_memoised(toy_tokenizer: Any) -> None:
    """llguidance tokenizes forced lexemes through a Python callback from inside its mask
    fills; the callback remembers its answers (same ids, a fresh list each time)."""
    from espalier.constrained.backends.common import vocab_facts
    from espalier.constrained.backends.llguidance import _TokenizerSource

    source = _TokenizerSource(toy_tokenizer, vocab_facts(toy_tokenizer))
    first = source('name"')
    assert first == toy_tokenizer.encode('name"')
    first.append(-1)  # the caller may keep and change what it got
    assert source('name"') == toy_tokenizer.encode('name"')
    assert 'name"' in source._encoded
