"""Grammar masks for a whole draft tree: one bitmask row per node, with a time budget.

Semantics of :func:`fill_tree_bitmask` (``n`` nodes, rows ``0..n-1`` of ``out``):

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

The matcher's state after the call equals its state before. Backends with a native fast path
(``tree/walk_xgrammar.py``, ``tree/walk_llguidance.py``, ``tree/walk_outlines.py``) are picked
by the matcher's backend name; any other :class:`GrammarMatcher` uses :func:`walk_generic`.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

import numpy as np
import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.base import GrammarMatcher
from espalier.constrained.tree import NONE, DraftTree

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


@dataclass
class WalkResult:
    """What a walker hands back (python lists, converted once by :func:`fill_tree_bitmask`).

    Walkers fill the lists in place and set ``filled[i]`` last, after ``valid[i]``,
    ``terminated[i]`` and row ``i`` are written: a snapshot of ``filled`` taken while a walk
    runs on another thread (``tree/bounded.py``) names only complete rows.
    """

    valid: list[bool]
    filled: list[bool]
    terminated: list[bool]
    budget_hit: bool
    abandoned: bool = False
    late_writes: threading.Event | None = None
    flags: np.ndarray | None = None
    """Set by walkers that write numpy flags instead of the lists (bool ``[3, n]``: valid,
    filled, terminated); then it is what counts, with ``complete``."""
    complete: bool = False
    """With ``flags``: every row is filled."""

    @classmethod
    def empty(cls, n: int) -> WalkResult:
        """Nothing decided yet for ``n`` nodes."""
        return cls([False] * n, [False] * n, [False] * n, False)


Walker = Callable[[Any, DraftTree, np.ndarray, float, bool, WalkResult], WalkResult]
"""``walker(matcher, tree, out_rows, deadline, root_ready, result) -> result``.

``out_rows`` is the int32 ``[n, words]`` numpy view of ``out``; ``deadline`` a
``time.perf_counter()`` value (``inf`` = none) after which no new node is started;
``root_ready``: row 0 already holds the root mask; ``result`` is :meth:`WalkResult.empty`,
filled in place (see :class:`WalkResult` for the order) and returned.
"""


def fill_tree_bitmask(
    matcher: GrammarMatcher,
    tree: DraftTree,
    out: torch.Tensor | np.ndarray,
    budget: float | None = DEFAULT_BUDGET_S,
    *,
    root_row: torch.Tensor | np.ndarray | None = None,
    threads: int = 1,
) -> TreeMasks:
    """Fill rows ``0..n-1`` of ``out`` with the masks of ``tree``'s nodes (see module docstring).

    Args:
        matcher: the request's matcher at the root's state; restored before returning.
        tree: a valid :class:`DraftTree` with ``n`` nodes.
        out: int32 ``[>= n, ceil(V/32)]`` C-contiguous CPU tensor (pinned is fine) or numpy array.
        budget: seconds for the whole fill; ``None`` = no limit (the walk runs inline). With a
            budget, xgrammar and llguidance walks run on a fork on a helper thread
            (``tree/bounded.py``) so that even one slow native fill cannot hold the call past
            it; only a root row that must be computed may take longer. Other walkers check it
            between nodes.
        root_row: the root's mask if already known (step reuse, see :func:`advance`); copied to
            row 0 instead of asking the grammar again.
        threads: threads the fill may use. Only llguidance's native walk uses a second one
            (for trees of ``walk_llguidance.SPLIT_MIN_NODES`` nodes or more); give 1 where
            other fills already keep every core busy (a batch with a tree per thread).
    """
    fill_tree = getattr(matcher, "fill_tree", None)
    if fill_tree is not None:  # a wrapper filtering its inner matcher's walk (unique_keys.py)
        masks: TreeMasks = fill_tree(
            fill_tree_bitmask, tree, out, budget=budget, root_row=root_row, threads=threads
        )
        return masks
    start = time.perf_counter()
    rows = _rows_view(out, tree.num_nodes, matcher.vocab_size)
    root_ready = root_row is not None
    if root_row is not None:
        rows[0] = np.asarray(root_row.numpy() if isinstance(root_row, torch.Tensor) else root_row)
    result = WalkResult.empty(tree.num_nodes)
    walker = walker_for(matcher)
    if threads > 1 and _backend(matcher) == "llguidance":
        from espalier.constrained.tree.walk_llguidance import walk_llguidance

        if walker is walk_llguidance:
            walker = partial(walk_llguidance, threads=threads)
    if budget is None:
        walker(matcher, tree, rows, float("inf"), root_ready, result)
    elif tree.num_nodes > 1 and _needs_helper(matcher, tree):
        from espalier.constrained.tree.bounded import walk_bounded

        if walker is not walk_generic and _backend(matcher) == "xgrammar":
            from espalier.constrained.tree.walk_xgrammar import walk_xgrammar_nodes as walker
        elif walker is not walk_generic and _backend(matcher) == "llguidance":
            from espalier.constrained.tree.walk_llguidance import walk_llguidance_py as walker

        result = walk_bounded(walker, matcher, tree, rows, start + budget, root_ready)
    else:
        walker(matcher, tree, rows, start + budget, root_ready, result)
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


SLOW_FILL_BACKENDS = frozenset({"xgrammar", "llguidance"})
"""Backends whose single mask fill can take milliseconds: budgeted walks go to a helper,
except llguidance's native walk (it checks the deadline between nodes, in C: inline) on the
trees it takes (``walk_llguidance.native_takes``)."""


def _needs_helper(matcher: Any, tree: DraftTree) -> bool:
    name = _backend(matcher)
    if name == "llguidance":
        from espalier.constrained.tree.walk_llguidance import native_takes, native_walk_ready

        return not (native_walk_ready(matcher) and native_takes(matcher, tree))
    return name in SLOW_FILL_BACKENDS


def _backend(matcher: Any) -> str | None:
    name: str | None = getattr(getattr(matcher, "compiled", None), "backend", None)
    return name


def walker_for(matcher: Any) -> Walker:
    """The fastest walker for ``matcher``: a backend fast path, else :func:`walk_generic`."""
    name = _backend(matcher)
    cached = _WALKERS.get(name)
    if cached is not None:
        return cached
    walker: Walker
    if name == "xgrammar":
        from espalier.constrained.tree.walk_xgrammar import walk_xgrammar as walker
    elif name == "llguidance":
        from espalier.constrained.tree.walk_llguidance import walk_llguidance as walker
    elif name == "outlines_core":
        from espalier.constrained.tree.walk_outlines import walk_outlines as walker
    else:
        return walk_generic
    _WALKERS[name] = walker
    return walker


_WALKERS: dict[str | None, Walker] = {}


def walk_generic(
    matcher: GrammarMatcher,
    tree: DraftTree,
    rows: np.ndarray,
    deadline: float,
    root_ready: bool,
    result: WalkResult,
) -> WalkResult:
    """Iterative DFS (first child first) over any :class:`GrammarMatcher`.

    A node is accepted only if its parent's row allows it, so no backend ever sees a token its own
    mask forbids; the matcher is rolled back lazily (only as far as the next node needs).
    """
    tokens = tree.tokens.tolist()
    first_child = tree.first_child.tolist()
    next_sibling = tree.next_sibling.tolist()
    words = rows.shape[1]
    flat = flat_words(rows)
    limit = min(words * 32, tokenizer_vocab_size(matcher))
    valid, filled, terminated = result.valid, result.filled, result.terminated
    table = torch.from_numpy(rows)
    if not root_ready:
        matcher.fill_bitmask(table, 0)
    valid[0] = True
    terminated[0] = matcher.is_terminated()
    filled[0] = True
    depth = 0  # tokens accepted since entry
    stack: list[tuple[int, int, int]] = []
    if first_child[0] != NONE:
        stack.append((first_child[0], 0, 1))
    while stack:
        node, parent, node_depth = stack.pop()
        sibling = next_sibling[node]
        if sibling != NONE:
            stack.append((sibling, parent, node_depth))
        if time.perf_counter() > deadline:
            result.budget_hit = True
            break
        token = tokens[node]
        if token >= limit or not (flat[parent * words + (token >> 5)] >> (token & 31)) & 1:
            continue
        if depth >= node_depth:
            matcher.rollback(depth - node_depth + 1)
            depth = node_depth - 1
        if not matcher.accept(token):
            continue
        depth = node_depth
        valid[node] = True
        matcher.fill_bitmask(table, node)
        terminated[node] = matcher.is_terminated()
        filled[node] = True
        child = first_child[node]
        if child != NONE:
            stack.append((child, node, node_depth + 1))
    if depth:
        matcher.rollback(depth)
    return result


# -- rows and vocabulary facts ----------------------------------------------------------------


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


def flat_words(rows: np.ndarray) -> memoryview:
    """A flat int32 memoryview of C-contiguous ``rows`` (item access gives python ints, fast)."""
    buffer: Any = rows.reshape(-1)
    return memoryview(buffer)


def tokenizer_vocab_size(matcher: Any) -> int:
    """Ids at or above this are never valid (model padding beyond the tokenizer)."""
    tokenizer = getattr(matcher, "tokenizer", None)
    if tokenizer is None:
        return int(matcher.vocab_size)
    return int(tokenizer.tokenizer_vocab_size)


def stop_bits(matcher: Any) -> tuple[tuple[int, int], ...]:
    """``(word, bits)`` pairs of the matcher's stop tokens (empty if it does not say)."""
    tokenizer = getattr(matcher, "tokenizer", None)
    stops = tuple(getattr(tokenizer, "stop_token_ids", ()))
    return _stop_bits(stops)


@lru_cache(maxsize=64)
def _stop_bits(stops: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    words: dict[int, int] = {}
    for token in stops:
        words[token >> 5] = words.get(token >> 5, 0) | (1 << (token & 31))
    # as int32 two's complement so numpy accepts bit 31
    return tuple((w, bits - (1 << 32) if bits >= 1 << 31 else bits) for w, bits in words.items())


@lru_cache(maxsize=16)
def stop_row(words: int, stops: tuple[int, ...]) -> np.ndarray:
    """int32 ``[words]`` row allowing exactly ``stops`` (read-only, cached)."""
    row = bm.row_from_tokens(stops, words * bm.BITS_PER_WORD)
    row.flags.writeable = False
    return row


def clear_tail(rows: np.ndarray, vocab_size: int) -> None:
    """Zero the last word's bits past V in every row (libraries may leave them set)."""
    rem = vocab_size % bm.BITS_PER_WORD
    if rem:
        rows[:, vocab_size // bm.BITS_PER_WORD] &= np.int32((1 << rem) - 1)


def mark_unfilled_rows(
    rows: np.ndarray, filled: Iterable[bool], bits: tuple[tuple[int, int], ...]
) -> None:
    """Set the stop-token bits in every row whose node is not filled (so no row is all-zero).

    Without stop tokens (a bare GrammarMatcher) bit 0 of word 0 is used instead. Plain Python on
    a memoryview: a few unfilled rows cost less than one numpy call just after a native walk.
    """
    flat = flat_words(rows)
    words = rows.shape[1]
    for node, done in enumerate(filled):
        if not done:
            for word, value in bits or ((0, 1),):
                flat[node * words + word] |= value
