"""xgrammar fast path: one native ``GrammarMatcher.traverse_draft_tree`` call, then translation.

xgrammar's conventions, and what we make of them:

- It visits nodes in preorder (first child first), checks each token against the parent's row,
  accepts it, fills the row, recurses and rolls back. The matcher ends where it started.
- Rejected nodes and nodes after a stop token get **all-zero rows**; descendants of a rejected
  node are not touched at all (stale rows); it reports no per-node validity. We recompute validity
  from the parent rows (an xgrammar row is exact: a set bit means ``accept_token`` succeeds).
- A stop-token child of a terminated node is invalid for xgrammar but valid for our protocol (a
  repeated stop token is a no-op): we mark such chains valid and give them the stop row.
- ``time_threshold`` is checked before each non-root node; on timeout it returns ``False`` and the
  rows of the timed-out node and of every later node in preorder are untouched. We find that node
  with a sentinel written into word 0 of each row beforehand (a real row that happens to equal the
  sentinel only makes us stop earlier, which is safe).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from espalier.constrained.traverse import (
    WalkResult,
    flat_words,
    stop_row,
    tokenizer_vocab_size,
    walk_generic,
)
from espalier.constrained.tree import DraftTree

SENTINEL = np.int32(0x5EA5_1DE5)


def walk_xgrammar(
    matcher: Any, tree: DraftTree, rows: np.ndarray, deadline: float, root_ready: bool
) -> WalkResult:
    """Fill ``rows`` with xgrammar's native walk (the root row is always recomputed)."""
    if matcher.is_terminated():  # xgrammar would clear every row; the generic walk is exact
        return walk_generic(matcher, tree, rows, deadline, root_ready)
    n = tree.num_nodes
    threshold = -1.0
    if deadline != float("inf"):
        threshold = max(deadline - time.perf_counter(), 1e-9)
        rows[1:, 0] = SENTINEL
    completed = bool(
        matcher.native.traverse_draft_tree(
            tree.first_child, tree.next_sibling, tree.tokens, rows, threshold
        )
    )
    stops = frozenset(matcher.tokenizer.stop_token_ids)
    words = rows.shape[1]
    limit = min(words * 32, tokenizer_vocab_size(matcher))
    flat = flat_words(rows)
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    valid = [False] * n
    filled = [False] * n
    terminated = [False] * n
    valid[0] = filled[0] = True
    chain: list[int] = []  # stop-token nodes whose row must become the stop row
    budget_hit = False
    for node in tree.preorder[1:]:
        parent = parents[node]
        if not filled[parent]:
            continue
        token = tokens[node]
        if terminated[parent]:
            if token in stops:
                valid[node] = filled[node] = terminated[node] = True
                chain.append(node)
            continue
        if token >= limit or not (flat[parent * words + (token >> 5)] >> (token & 31)) & 1:
            continue
        if not completed and flat[node * words] == SENTINEL:
            budget_hit = True  # the native walk timed out here: this node and later are unknown
            break
        valid[node] = filled[node] = True
        if token in stops:
            terminated[node] = True
            chain.append(node)
    if chain:
        rows[chain] = stop_row(words, tuple(sorted(stops)))
    return WalkResult(valid, filled, terminated, budget_hit or not completed)
