"""Tree masks of many requests at once: one (pinned) buffer, filled on a thread pool.

The grammar libraries drop the GIL inside their mask computations (xgrammar's native tree walk,
llguidance's ``unsafe_compute_mask_ptr``), so trees fill in parallel while the caller (the engine)
keeps launching GPU work; :meth:`TreeMaskBatch.submit` returns a future at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from functools import partial

import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.base import GrammarMatcher
from espalier.constrained.tree import DraftTree
from espalier.constrained.tree.masks import DEFAULT_BUDGET_S, TreeMasks


@dataclass
class TreeMaskBatch:
    """Requests' trees laid out back to back in one bitmask.

    Attributes:
        items: ``(matcher, tree)`` per request; each matcher at most once (it is not thread-safe).
        vocab_size: V of the rows.
        offsets: int ``[len(items) + 1]``; request ``b`` owns rows ``offsets[b]:offsets[b + 1]``.
        bitmask: int32 ``[offsets[-1], ceil(V/32)]`` CPU (pinned when asked and CUDA exists).
    """

    items: Sequence[tuple[GrammarMatcher, DraftTree]]
    vocab_size: int
    pin_memory: bool = False
    offsets: list[int] = field(init=False)
    bitmask: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        if len({id(matcher) for matcher, _ in self.items}) != len(self.items):
            raise ValueError("a matcher appears twice in one batch; it is not thread-safe")
        self.offsets = [0]
        for _, tree in self.items:
            self.offsets.append(self.offsets[-1] + tree.num_nodes)
        self.bitmask = bm.allocate(self.offsets[-1], self.vocab_size, pin_memory=self.pin_memory)

    def rows(self, b: int) -> torch.Tensor:
        """Request ``b``'s rows (a view of :attr:`bitmask`)."""
        return self.bitmask[self.offsets[b] : self.offsets[b + 1]]

    def submit(
        self,
        pool: Executor,
        budget: float | None = DEFAULT_BUDGET_S,
        deadline: float | None = None,
    ) -> Future[list[TreeMasks]]:
        """Fill every tree on ``pool``; the future resolves to one :class:`TreeMasks` per item.

        ``budget`` bounds each tree from the moment its task starts; ``deadline`` (a
        ``time.perf_counter()`` value) bounds the whole batch: a tree that starts late gets what
        is left (its root row is always filled). Before submitting again (the rows are reused),
        wait for each result's :meth:`~espalier.constrained.tree.masks.TreeMasks.wait_late_writes`.
        """
        return fill_tree_bitmasks(self, pool, budget, deadline)


def fill_tree_bitmasks(
    batch: TreeMaskBatch,
    pool: Executor,
    budget: float | None = DEFAULT_BUDGET_S,
    deadline: float | None = None,
) -> Future[list[TreeMasks]]:
    """See :meth:`TreeMaskBatch.submit`."""
    result: Future[list[TreeMasks]] = Future()
    masks: list[TreeMasks | None] = [None] * len(batch.items)
    remaining = [len(batch.items)]
    lock = threading.Lock()
    if not batch.items:
        result.set_result([])
        return result

    def run(b: int) -> TreeMasks:
        matcher, tree = batch.items[b]
        tree_budget = budget
        if deadline is not None:
            left = max(deadline - time.perf_counter(), 0.0)
            tree_budget = left if tree_budget is None else min(tree_budget, left)
        return matcher.fill_tree(tree, batch.rows(b), budget=tree_budget)

    def done(b: int, future: Future[TreeMasks]) -> None:
        error = future.exception()
        with lock:
            if result.done():
                return
            if error is not None:
                result.set_exception(error)
                return
            masks[b] = future.result()
            remaining[0] -= 1
            finished = remaining[0] == 0
        if finished:
            result.set_result([m for m in masks if m is not None])

    for b in range(len(batch.items)):
        task = pool.submit(run, b)
        task.add_done_callback(partial(done, b))
    return result
