"""What every tree walk shares: the result it fills in place, the walker signature, the generic
walk over any matcher, and the row and vocabulary facts the walks read.

Backends' fast walks live with their backend (``constrained/backends/<name>/tree_walk.py``); the
driver that runs a walk within a budget and turns its result into ``TreeMasks`` is
``tree/masks.py``. Node semantics (valid, filled, terminated, budget) are stated there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.tree import NONE, DraftTree


@dataclass
class WalkResult:
    """What a walker hands back (python lists, converted once by ``tree/masks.py``).

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


def walk_generic(
    matcher: Any,
    tree: DraftTree,
    rows: np.ndarray,
    deadline: float,
    root_ready: bool,
    result: WalkResult,
) -> WalkResult:
    """Iterative DFS (first child first) over any ``GrammarMatcher`` (only its protocol methods).

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
