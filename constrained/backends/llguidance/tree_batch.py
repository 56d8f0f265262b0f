"""llguidance's entry point for a step's draft trees (``GrammarMatcher.tree_batch_kind``).

:meth:`NativeTreeBatch.fill_trees` hands every tree it takes to one call of
``native/llg_walk.c`` (``espalier_llg_walk_batch``), which releases the GIL for its whole length
and runs the trees in parallel on native threads: per tree, the root row is computed on the
request's own C-API matcher and the tree is walked on clones of it (``tree_walk.py``), its
unfilled rows get the stop bits and the bits past V are cleared, and its row filter (the
duplicate-key tracker, ``constrained/keys/``) filters the rows node by node, in C. The Python
around the call only lays the trees out (a few array builds for the whole step).

Rows and flags are exactly those of ``Matcher.fill_tree`` followed by the filter's own
``fill_tree`` (``tests/constrained/test_llguidance_tree_batch.py``). A tree it does not take
(:meth:`NativeTreeBatch.takes`: a terminated or failed matcher) is filled by the caller with
``fill_tree``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from espalier.constrained.backends.llguidance.errors import MatcherStateError
from espalier.constrained.backends.llguidance.native import capi as native
from espalier.constrained.backends.llguidance.tree_walk import WRAP_UP_S
from espalier.constrained.base import BatchTree


class NativeTreeBatch:
    """One native call for a step's llguidance trees on up to ``threads`` native threads (the
    ``TreeBatch`` protocol); the matchers must share one tokenizer's native tables."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)

    def takes(self, matcher: Any, parents: Sequence[int]) -> bool:
        """See ``TreeBatch.takes``: a matcher neither terminated nor failed."""
        return not matcher.is_terminated() and not matcher.native.is_error()

    def fill_trees(
        self,
        trees: Sequence[BatchTree],
        rows: np.ndarray,
        flags: np.ndarray,
        budget: float | None,
        tree_threads: int,
        faults: dict[int, BaseException],
        seconds: dict[int, float] | None = None,
    ) -> float:
        """See ``TreeBatch.fill_trees``; one native call (per tokenizer and filter kind)."""
        groups: dict[tuple[int, int], list[tuple[BatchTree, int]]] = {}
        for tree in trees:
            fn, state = _native_filter(tree)
            matcher: Any = tree.matcher
            if matcher.mask_memo_stale:
                try:
                    matcher.refresh_mask_memo()  # clones carry the memo along
                except Exception as exc:
                    faults[tree.index] = exc
                    continue
            groups.setdefault((id(matcher.compiled.native_slot), fn), []).append((tree, state))
        budget_s = -1.0 if budget is None else max(budget - WRAP_UP_S, 0.0)
        total = 0.0
        for (_, fn), group in groups.items():
            total += self._fill(group, fn, rows, flags, budget_s, tree_threads, faults, seconds)
        return total

    def _fill(
        self,
        group: Sequence[tuple[BatchTree, int]],
        filter_fn: int,
        rows: np.ndarray,
        flags: np.ndarray,
        budget_s: float,
        tree_threads: int,
        faults: dict[int, BaseException],
        seconds: dict[int, float] | None,
    ) -> float:
        trees = [tree for tree, _ in group]
        matchers: list[Any] = [t.matcher for t in trees]
        sizes = [len(t.tokens) for t in trees]
        total = sum(sizes)
        laid_out = native.BatchTrees(
            roots=np.array([m.native.pointer for m in matchers], dtype=np.uint64),
            tokens=np.fromiter(_chain(t.tokens for t in trees), np.int64, total),
            parents=np.fromiter(_chain(t.parents for t in trees), np.int64, total),
            node_at=_offsets(sizes),
            row_at=np.array([t.row for t in trees], dtype=np.int64),
            flag_at=np.array([t.node for t in trees], dtype=np.int64),
            filter_states=np.array([state for _, state in group], dtype=np.uint64),
            filter=filter_fn,
            want_snapshot=np.array([m.snapshot_wanted for m in matchers], dtype=np.uint8),
        )
        compiled = matchers[0].compiled
        end = native.walk_batch(
            native.api(),
            laid_out,
            rows,
            flags,
            compiled.native_slot.tables,
            compiled.tokenizer.vocab_size,
            budget_s,
            self.threads,
            tree_threads,
            tokenizer=matchers[0].native.tokenizer,
        )
        for b, filled in enumerate(end.helper_filled.tolist()):
            matchers[b].helper_rows += filled
            matchers[b].took_snapshot(end.snapshots[b])
        for b, message in end.errors.items():
            faults[trees[b].index] = MatcherStateError(f"llguidance tree walk: {message}")
        if seconds is not None:
            seconds.update(zip((t.index for t in trees), end.seconds.tolist()))
        return float(end.seconds.sum())


_chain = itertools.chain.from_iterable


def _native_filter(tree: BatchTree) -> tuple[int, int]:
    """``(function, state)`` of the tree's row filter; ``(0, 0)``: none."""
    native_filter = tree.tree_filter.native_tree_filter if tree.tree_filter is not None else None
    return native_filter if native_filter is not None else (0, 0)


def _offsets(sizes: Any) -> np.ndarray:
    """int64 ``[k + 1]``: 0, then the running sums of ``sizes``."""
    counts = np.fromiter(sizes, np.int64)
    out = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out
