"""Grammar masks for a whole draft tree: one bitmask row per node, with a time budget.

Semantics of ``GrammarMatcher.fill_tree`` (``n`` nodes, rows ``0..n-1`` of ``out``):

- **root** (node 0): the matcher's current state. Always filled, whatever the budget, because the
  engine needs it even without speculation.
- **valid node**: its path root→i is accepted token by token by the matcher. Its row holds exactly
  what ``matcher.fill_bitmask`` gives after that path (``filled[i]``).
- **invalid node**: the parent's row forbids the token (or the parent is invalid, or the token
  id is ``>=`` the tokenizer vocabulary, e.g. model padding): ``valid[i] = False`` and the whole
  subtree is skipped (invalid too).
- **terminated**: after a stop token the grammar is finished: the row allows exactly the stop
  tokens (``terminated[i]``). A stop-token child of a terminated node is valid (accepting another
  stop token is a no-op, see ``backends/common.py``); any other child is invalid.
- **budget**: nodes not processed before the deadline have ``filled = valid = False``;
  ``budget_hit`` says so: they are pruned from verification (the engine's kernels treat a node
  that is not ``filled`` as absent, and the path stops at its parent, whose row is exact). Fewer
  tokens get accepted, never a wrong one. The root row is always filled and exact. For the
  backends whose single fills can be slow the deadline is a wall-clock bound
  (``tree/bounded.py``); only computing the root row may take longer.

Verification accepts node i only where ``filled[i]`` (which implies ``valid[i]``). **No row is
all-zero**: rows of nodes with ``filled = False`` have at least the stop-token bits set; their
other bits are unspecified (stale data or a partial mask) and must not be used.

The matcher's state after the call equals its state before. Each backend's matcher implements
``GrammarMatcher.fill_tree`` with its own walk (``constrained/backends/<name>/tree_walk.py``)
through :func:`fill_with`, the driver shared by every walk (rows, root row, budget, wrap-up).
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.tree import DraftTree
from espalier.constrained.tree.bounded import walk_bounded
from espalier.constrained.tree.walk import (
    Walker,
    WalkResult,
    clear_tail,
    mark_unfilled_rows,
    stop_bits,
)

DEFAULT_BUDGET_S = 0.002
"""Default time budget of one tree fill (seconds)."""


@dataclass
class TreeMasks:
    """Per-node outcome of a tree fill. All arrays are bool ``[n]`` numpy, CPU.

    Attributes:
        valid: the path root→i is accepted by the grammar (known within the budget).
        filled: row i holds the exact mask after that path; implies ``valid``.
        terminated: valid and the grammar is finished after the path (row = stop tokens).
        budget_hit: the deadline stopped the walk before every node was decided.
        seconds: wall time of the fill.
        abandoned: the deadline came during one slow native fill, which was left running on a
            fork (``tree/bounded.py``); implies ``budget_hit``.
        late_writes: only after an abandoned fill: set once that fill has ended. Until then it
            may still write the row of one node that is *not* filled; do not reuse ``out`` for
            other data before :meth:`wait_late_writes` (filled rows never change).
    """

    valid: np.ndarray
    filled: np.ndarray
    terminated: np.ndarray
    budget_hit: bool = False
    seconds: float = 0.0
    abandoned: bool = False
    late_writes: threading.Event | None = None

    @property
    def num_nodes(self) -> int:
        return int(self.valid.shape[0])

    def writes_pending(self) -> bool:
        """An abandoned fill may still write an unfilled row of ``out``."""
        return self.late_writes is not None and not self.late_writes.is_set()

    def wait_late_writes(self, timeout: float | None = None) -> bool:
        """Block until no late write can happen (True), or ``timeout`` passes (False)."""
        return self.late_writes is None or self.late_writes.wait(timeout)


def fill_tree_bitmask(
    matcher: Any,
    tree: DraftTree,
    out: torch.Tensor | np.ndarray,
    budget: float | None = DEFAULT_BUDGET_S,
    *,
    root_row: torch.Tensor | np.ndarray | None = None,
    threads: int = 1,
) -> TreeMasks:
    """``matcher.fill_tree(tree, out, budget=budget, root_row=root_row, threads=threads)``: the
    walk of ``matcher``'s backend (see the module docstring and ``GrammarMatcher.fill_tree``)."""
    masks: TreeMasks = matcher.fill_tree(
        tree, out, budget=budget, root_row=root_row, threads=threads
    )
    return masks


def fill_with(
    matcher: Any,
    tree: DraftTree,
    out: torch.Tensor | np.ndarray,
    *,
    budget: float | None,
    root_row: torch.Tensor | np.ndarray | None,
    walk: Walker,
    bounded_walk: Walker | None,
) -> TreeMasks:
    """Fill rows ``0..n-1`` of ``out`` with ``walk`` (see the module docstring).

    Args:
        matcher: the request's matcher at the root's state; restored before returning.
        tree: a valid :class:`DraftTree` with ``n`` nodes.
        out: int32 ``[>= n, ceil(V/32)]`` C-contiguous CPU tensor (pinned is fine) or numpy array.
        budget: seconds for the whole fill; ``None`` = no limit (``walk`` runs inline).
        root_row: the root's mask if already known (step reuse: the row of the node the last
            verification ended on); copied to row 0 instead of asking the grammar again.
        walk: the backend's walk; with a budget it checks the deadline between nodes.
        bounded_walk: for backends whose single fills can be slow: with a budget and more than
            the root, this walk runs on a fork on a helper thread (``tree/bounded.py``) so that
            even one slow native fill cannot hold the call past the budget (only a root row
            that must be computed may take longer). None: ``walk`` runs inline.
    """
    start = time.perf_counter()
    rows = _rows_view(out, tree.num_nodes, matcher.vocab_size)
    root_ready = root_row is not None
    if root_row is not None:
        rows[0] = np.asarray(root_row.numpy() if isinstance(root_row, torch.Tensor) else root_row)
    result = WalkResult.empty(tree.num_nodes)
    if budget is None:
        walk(matcher, tree, rows, float("inf"), root_ready, result)
    elif bounded_walk is not None and tree.num_nodes > 1:
        result = walk_bounded(bounded_walk, matcher, tree, rows, start + budget, root_ready)
    else:
        walk(matcher, tree, rows, start + budget, root_ready, result)
    return _wrap_up(matcher, rows, result, start)


def _wrap_up(matcher: Any, rows: np.ndarray, result: WalkResult, start: float) -> TreeMasks:
    """The walk's flags as a :class:`TreeMasks`; unfilled rows made safe, tail bits cleared."""
    # One array for the three flags: each numpy call costs tens of µs just after a native walk
    # has swept the caches (measured on xgrammar trees), so the wrap-up makes as few as it can.
    flags = result.flags
    if flags is None:
        flags = np.array((result.valid, result.filled, result.terminated), dtype=bool)
        complete = all(result.filled)
    else:
        complete = result.complete
    if not complete:
        mark_unfilled_rows(rows, flags[1], stop_bits(matcher))
    if matcher.vocab_size % bm.BITS_PER_WORD:
        clear_tail(rows, matcher.vocab_size)
    return TreeMasks(
        flags[0],
        flags[1],
        flags[2],
        result.budget_hit,
        time.perf_counter() - start,
        result.abandoned,
        result.late_writes,
    )


def _rows_view(out: torch.Tensor | np.ndarray, n: int, vocab_size: int) -> np.ndarray:
    """The int32 ``[n, words]`` numpy view of ``out`` (no copy); checks layout and size."""
    array = _numpy_of(out) if isinstance(out, torch.Tensor) else out
    words = bm.words_per_row(vocab_size)
    if array.dtype != np.int32 or array.ndim != 2 or not array.flags.c_contiguous:
        raise ValueError("tree bitmask must be a C-contiguous int32 2-D array")
    if array.shape[1] != words or array.shape[0] < n:
        raise ValueError(f"tree bitmask shape {array.shape} cannot hold {n} rows of {words} words")
    return array[:n]


_NUMPY_VIEWS: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Size, np.ndarray]] = {}
"""``id(tensor) -> (tensor ref, data pointer, shape, numpy view)`` of the last buffers filled:
``Tensor.numpy()`` costs ~60 µs right after a native walk, and the engine reuses its buffers."""


def _numpy_of(out: torch.Tensor) -> np.ndarray:
    """The numpy view of CPU tensor ``out`` (cached while the tensor and its storage live)."""
    hit = _NUMPY_VIEWS.get(id(out))
    if hit is not None and hit[0]() is out and hit[1] == out.data_ptr() and hit[2] == out.shape:
        return hit[3]
    if out.device.type != "cpu":
        raise ValueError(f"tree bitmask must be on the CPU (pinned is fine), got {out.device}")
    array: np.ndarray = out.numpy()
    if len(_NUMPY_VIEWS) >= 64:
        _NUMPY_VIEWS.clear()
    _NUMPY_VIEWS[id(out)] = (weakref.ref(out), out.data_ptr(), out.shape, array)
    return array
