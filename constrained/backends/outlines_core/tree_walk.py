"""outlines-core fast path: walk DFA states by lookup, rows from a per-grammar cache.

Node states come from ``Index.get_next_state`` (the token-level DFA is deterministic), so the
request's ``Guide`` is not needed to decide validity. A row depends only on the DFA state, so rows
are cached per compiled grammar (LRU, bounded in bytes); only a miss advances the request's
``Guide`` along the node's path (lazily, like a DFS; rolled back at the end) to write the mask,
post-processed like the adapter does (``__init__.py``): the sentinel token is never
allowed, and the stop tokens are allowed where the match may end.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from espalier.constrained.tree import NONE, DraftTree
from espalier.constrained.tree.walk import WalkResult, stop_row, tokenizer_vocab_size, walk_generic

ROW_CACHE_BYTES = 16 << 20
"""Cached rows per compiled grammar (bytes); 512 rows of a 262,144-token vocabulary."""


class RowCache:
    """LRU of DFA state → int32 row (read-only numpy), shared by every request of one grammar."""

    def __init__(self, max_rows: int) -> None:
        self._rows: OrderedDict[int, np.ndarray] = OrderedDict()
        self._max_rows = max(max_rows, 8)
        self._lock = threading.Lock()

    def get(self, state: int) -> np.ndarray | None:
        with self._lock:
            row = self._rows.get(state)
            if row is not None:
                self._rows.move_to_end(state)
            return row

    def put(self, state: int, row: np.ndarray) -> None:
        with self._lock:
            self._rows[state] = row
            if len(self._rows) > self._max_rows:
                self._rows.popitem(last=False)


_CACHES: weakref.WeakKeyDictionary[Any, RowCache] = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()


def row_cache(compiled: Any, words: int) -> RowCache:
    """The :class:`RowCache` of one compiled grammar (created on first use)."""
    with _CACHES_LOCK:
        cache = _CACHES.get(compiled)
        if cache is None:
            cache = RowCache(ROW_CACHE_BYTES // (4 * words))
            _CACHES[compiled] = cache
        return cache


class _GuideSync:
    """The request's ``Guide``, advanced lazily to the path of a node whose row is missing.

    Only used on cache misses; :meth:`restore` rolls it back to where the walk found it.
    """

    def __init__(self, guide: Any, words: int, sentinel: int) -> None:
        self.guide = guide
        self.path: list[int] = []  # nodes whose tokens the guide consumed during this walk
        self.words = words
        self.sentinel_word = sentinel >> 5
        self.sentinel_bit = np.uint32(1 << (sentinel & 31))

    def row(
        self, nodes: list[int], tokens: list[int], stops: np.ndarray, can_terminate: bool
    ) -> np.ndarray:
        keep = 0
        while keep < min(len(nodes), len(self.path)) and nodes[keep] == self.path[keep]:
            keep += 1
        if len(self.path) > keep:
            self.guide.rollback_state(len(self.path) - keep)
        del self.path[keep:]
        for node in nodes[keep:]:
            self.guide.advance(tokens[node], return_tokens=False)
            self.path.append(node)
        row = np.zeros(self.words, dtype=np.int32)
        self.guide.write_mask_into(row.ctypes.data, self.words, 4)
        unsigned = row.view(np.uint32)
        if unsigned[self.sentinel_word] & self.sentinel_bit:  # never allowed itself
            unsigned[self.sentinel_word] &= ~self.sentinel_bit
        if can_terminate:  # the match may end here: the stop tokens are allowed
            row |= stops
        row.flags.writeable = False
        return row

    def restore(self) -> None:
        if self.path:
            self.guide.rollback_state(len(self.path))
            self.path.clear()


def walk_outlines(
    matcher: Any,
    tree: DraftTree,
    rows: np.ndarray,
    deadline: float,
    root_ready: bool,
    result: WalkResult,
) -> WalkResult:
    """Fill ``rows`` for an outlines-core-backed matcher (see the module docstring)."""
    if matcher.is_terminated():
        return walk_generic(matcher, tree, rows, deadline, root_ready, result)
    compiled = matcher.compiled
    index = compiled.native
    next_state = index.get_next_state
    n = tree.num_nodes
    words = rows.shape[1]
    tokens = tree.tokens.tolist()
    first_child = tree.first_child.tolist()
    next_sibling = tree.next_sibling.tolist()
    facts = matcher._facts
    stops, excluded = facts.stops, facts.excluded
    stop_mask = stop_row(words, tuple(sorted(stops)))
    limit = min(words * 32, tokenizer_vocab_size(matcher))
    cache = row_cache(compiled, words)
    sync = _GuideSync(matcher.native, words, int(compiled.sentinel_id))
    states: list[int] = [0] * n
    states[0] = int(matcher.native.get_state())
    valid, filled, terminated = result.valid, result.filled, result.terminated
    parents = [NONE] * n

    def fill(node: int) -> None:
        state = states[node]
        row = cache.get(state)
        if row is None:
            path: list[int] = []
            walk = node
            while walk > 0:
                path.append(walk)
                walk = parents[walk]
            path.reverse()
            row = sync.row(path, tokens, stop_mask, compiled.can_terminate(state))
            cache.put(state, row)
        rows[node] = row

    if not root_ready:
        fill(0)
    valid[0] = filled[0] = True
    stack: list[tuple[int, int]] = []
    if first_child[0] != NONE:
        stack.append((first_child[0], 0))
    while stack:
        node, parent = stack.pop()
        sibling = next_sibling[node]
        if sibling != NONE:
            stack.append((sibling, parent))
        if time.perf_counter() > deadline:
            result.budget_hit = True
            break
        token = tokens[node]
        if token >= limit or token in excluded:
            continue
        parents[node] = parent
        if token in stops or terminated[parent]:
            if token not in stops or not (
                terminated[parent] or compiled.can_terminate(states[parent])
            ):
                continue
            rows[node] = stop_mask
            valid[node] = terminated[node] = filled[node] = True
        else:
            state = next_state(states[parent], token)
            if state is None:
                continue
            states[node] = int(state)
            valid[node] = True
            fill(node)
            filled[node] = True
        child = first_child[node]
        if child != NONE:
            stack.append((child, node))
    sync.restore()
    return result
