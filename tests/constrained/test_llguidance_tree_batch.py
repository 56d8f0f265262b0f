"""llguidance's tree batch (``backends/llguidance/tree_batch.py``): a step's trees in one native
call, the duplicate-key filter applied inside it.

Oracles: each request's rows and flags equal its own ``fill_tree`` (the native walk of one tree,
then the key tracker's filter called from Python), bit for bit, and the filled rows equal
replaying every path from scratch; requests at different states, on several native threads,
over several steps (the requests advance between them). A malformed tree or a budget spent is
that tree's alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from espalier.constrained import bitmask as bm
from espalier.constrained.backends import get_backend
from espalier.constrained.backends.common import BackendOptions
from espalier.constrained.backends.llguidance.errors import MatcherStateError
from espalier.constrained.backends.llguidance.tree_batch import NativeTreeBatch
from espalier.constrained.base import BatchTree
from espalier.constrained.keys import UniqueKeysMatcher, with_unique_keys
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.tree import DraftTree
from tests.fixtures.tree_oracle import compare, replay_tree
from tests.fixtures.tree_random import grow_tree, sample_instance

FREE = GrammarSpec.json_schema(
    {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "integer"}}}
)
"""Free keys: its matchers carry the duplicate-key tracker."""
CLOSED = GrammarSpec.json_schema(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name"],
        "additionalProperties": False,
    }
)
"""Declared keys only: its matchers are llguidance's own."""


class Request:
    """Two matchers kept at the same state: one filled by the batch, one by ``fill_tree``."""

    def __init__(self, tokenizer: Any, spec: GrammarSpec) -> None:
        backend = get_backend("llguidance", tokenizer, BackendOptions())
        self.compiled = backend.compile(spec)
        assert self.compiled.native_slot.wait(60) is not None, self.compiled.native_slot.error
        self.tokenizer = tokenizer
        self.batched = self.fresh()
        self.alone = self.fresh()
        self.history: list[int] = []

    def fresh(self) -> Any:
        return with_unique_keys(self.compiled.spec, self.compiled.matcher(), self.tokenizer)

    def advance(self, rng: np.random.Generator) -> None:
        """A few tokens more, on both (never a stop: the request goes on)."""
        stops = set(self.tokenizer.stop_token_ids)
        for token in sample_instance(self.alone.fork(), rng, max_tokens=int(rng.integers(1, 6))):
            if token in stops or not self.alone.accept(token):
                break
            assert self.batched.accept(token)
            self.history.append(token)

    def tree(self, rng: np.random.Generator, size: int) -> DraftTree:
        body = sample_instance(self.alone.fork(), rng, max_tokens=12)
        return grow_tree(self.fresh, self.history, body, size, rng)


def batch_tree(index: int, matcher: Any, tree: DraftTree, row: int, node: int) -> BatchTree:
    """The tree's entry, as the mask builder makes it (a key tracker's source walks)."""
    source = matcher.inner if isinstance(matcher, UniqueKeysMatcher) else matcher
    tree_filter = matcher.row_filter if isinstance(matcher, UniqueKeysMatcher) else None
    parents = tree.parents.tolist()
    return BatchTree(index, source, tree_filter, tree.tokens.tolist(), parents, row, node)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_batch_equals_each_tree_filled_alone(toy_tokenizer_padded: Any, threads: int) -> None:
    tokenizer = toy_tokenizer_padded
    rng = np.random.default_rng(3)
    requests = [Request(tokenizer, spec) for spec in (FREE, CLOSED, FREE, FREE, CLOSED)]
    assert isinstance(requests[0].batched, UniqueKeysMatcher)
    assert not isinstance(requests[1].batched, UniqueKeysMatcher)
    batch = NativeTreeBatch(threads)
    words = bm.words_per_row(tokenizer.vocab_size)
    for _ in range(6):  # steps: each request accepts a few tokens between them
        for request in requests:
            request.advance(rng)
        trees = [r.tree(rng, int(rng.choice([1, 5, 12, 30]))) for r in requests]
        items, row = [], 0
        for index, (request, tree) in enumerate(zip(requests, trees)):
            item = batch_tree(index, request.batched, tree, row, row + 7)
            assert batch.takes(item.matcher, item.parents)
            items.append(item)
            row += tree.num_nodes
        rows = np.full((row + 2, words), -1, dtype=np.int32)  # stale data everywhere
        flags = np.zeros((3, row + 7), dtype=np.uint8)
        faults: dict[int, BaseException] = {}
        seconds = batch.fill_trees(items, rows, flags, None, 2, faults)
        assert faults == {} and seconds > 0
        for request, tree, item in zip(requests, trees, items):
            n = tree.num_nodes
            alone = np.full((n, words), -1, dtype=np.int32)
            masks = request.alone.fill_tree(tree, alone, budget=None)
            got = rows[item.row : item.row + n]
            assert np.array_equal(got, alone)
            for plane, expected in enumerate((masks.valid, masks.filled, masks.terminated)):
                assert np.array_equal(flags[plane, item.node : item.node + n], expected)
            assert item.matcher.history == request.history  # the walk never moves it
            oracle = replay_tree(request.fresh, request.history, tree)
            assert compare(masks, got, tree, oracle) == []


def test_a_bad_tree_or_a_spent_budget_is_that_trees_alone(toy_tokenizer_padded: Any) -> None:
    tokenizer = toy_tokenizer_padded
    rng = np.random.default_rng(9)
    good, bad = Request(tokenizer, FREE), Request(tokenizer, CLOSED)
    good.advance(rng)
    tree = good.tree(rng, 20)
    n = tree.num_nodes
    words = bm.words_per_row(tokenizer.vocab_size)
    batch = NativeTreeBatch(2)
    items = [
        BatchTree(0, bad.batched, None, [0, 5, 6], [-1, 0, 7], 0, 0),  # a parent outside
        batch_tree(1, good.batched, tree, 3, 3),
    ]
    rows = np.zeros((n + 3, words), dtype=np.int32)
    flags = np.zeros((3, n + 3), dtype=np.uint8)
    faults: dict[int, BaseException] = {}
    batch.fill_trees(items, rows, flags, None, 1, faults)
    assert list(faults) == [0] and isinstance(faults[0], MatcherStateError)
    assert "malformed" in str(faults[0])
    oracle = replay_tree(good.fresh, good.history, tree)
    alone = good.alone.fill_tree(tree, np.zeros((n, words), dtype=np.int32), budget=None)
    assert compare(alone, rows[3:], tree, oracle) == []
    assert np.array_equal(flags[:, 3:], np.array((alone.valid, alone.filled, alone.terminated)))
    # the failed walk left the request's matcher where it was: the next step takes it again,
    # and every tree, however branchy
    assert bad.batched.history == [] and not bad.batched.native.is_error()
    assert batch.takes(bad.batched, [-1, 0])
    assert batch.takes(bad.batched, [-1, 0, 0, 0, 0, 0, 0, 0])
    # no budget left: every root row is still exact, nothing below it is filled, no row is empty
    good.advance(rng)
    tree = good.tree(rng, 20)
    n = tree.num_nodes
    rows = np.zeros((n, words), dtype=np.int32)
    flags = np.zeros((3, n), dtype=np.uint8)
    batch.fill_trees([batch_tree(0, good.batched, tree, 0, 0)], rows, flags, 0.0, 1, faults)
    assert flags[1, 0] == 1 and not flags[1, 1:].any() and not flags[0, 1:].any()
    root = np.zeros((1, words), dtype=np.int32)
    good.alone.fill_tree(DraftTree([0], [-1], [-1]), root, budget=None)
    assert np.array_equal(rows[0], root[0])
    assert rows.any(axis=1).all()
