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
import torch

from espalier.constrained.tree import NONE, DraftTree
from espalier.constrained.tree.walk import (
    WalkResult,
    flat_words,
    stop_row,
    tokenizer_vocab_size,
    walk_generic,
)

SENTINEL = np.int32(0x5EA5_1DE5)


def walk_xgrammar(
    matcher: Any,
    tree: DraftTree,
    rows: np.ndarray,
    deadline: float,
    root_ready: bool,
    result: WalkResult,
) -> WalkResult:
    """Fill ``rows`` with xgrammar's native walk (the root row is always recomputed)."""
    if matcher.is_terminated():  # xgrammar would clear every row; the generic walk is exact
        return walk_generic(matcher, tree, rows, deadline, root_ready, result)
    threshold = -1.0
    if deadline != float("inf"):
        threshold = max(deadline - time.perf_counter(), 1e-9)
        rows[1:, 0] = SENTINEL
    completed = bool(
        matcher.native.traverse_draft_tree(
            tree.first_child, tree.next_sibling, tree.tokens, rows, threshold
        )
    )
    valid, terminated, chain, stopped = _translate(matcher, tree, rows, completed)
    if chain:
        stops = tuple(sorted(matcher._facts.stops))
        rows[chain] = stop_row(rows.shape[1], stops)
    result.budget_hit = stopped or not completed
    result.valid[:] = valid
    result.terminated[:] = terminated
    result.filled[:] = valid  # last: a concurrent snapshot of ``filled`` sees complete rows
    return result


def _translate(
    matcher: Any, tree: DraftTree, rows: np.ndarray, completed: bool
) -> tuple[list[bool], list[bool], list[int], bool]:
    """Per node: valid, terminated; the stop-token nodes whose row must become the stop row;
    whether the native walk stopped early. One preorder pass, first child first."""
    n = tree.num_nodes
    stops = matcher._facts.stops
    words = rows.shape[1]
    limit = min(words * 32, tokenizer_vocab_size(matcher))
    flat = flat_words(rows)
    tokens = tree.tokens.tolist()
    first_child = tree.first_child.tolist()
    next_sibling = tree.next_sibling.tolist()
    valid = [False] * n
    terminated = [False] * n
    valid[0] = True
    chain: list[int] = []
    stack: list[tuple[int, int]] = []
    if first_child[0] != NONE:
        stack.append((first_child[0], 0))
    while stack:
        node, parent = stack.pop()
        sibling = next_sibling[node]
        if sibling != NONE:
            stack.append((sibling, parent))
        token = tokens[node]
        if terminated[parent]:
            if token not in stops:
                continue
        elif token >= limit or not (flat[parent * words + (token >> 5)] >> (token & 31)) & 1:
            continue
        elif not completed and flat[node * words] == SENTINEL:
            return valid, terminated, chain, True  # the native walk timed out here
        valid[node] = True
        if token in stops:
            terminated[node] = True
            chain.append(node)
        child = first_child[node]
        if child != NONE:
            stack.append((child, node))
    return valid, terminated, chain, False


def walk_xgrammar_nodes(
    matcher: Any,
    tree: DraftTree,
    rows: np.ndarray,
    deadline: float,
    root_ready: bool,
    result: WalkResult,
) -> WalkResult:
    """Node-by-node DFS on the native ``GrammarMatcher`` (the budgeted walk on a helper thread).

    A Python step per node makes it a little slower than the native walk, but each row is
    published (``result.filled``) as soon as it is written, so a walk abandoned at the deadline
    (``constrained/tree/bounded.py``) keeps every finished row, and it honours ``root_ready``.
    Same rules as the adapter: stop tokens never go to the library (the parent's row says
    whether the grammar may end; their row is the stop row), ids at or above the tokenizer
    vocabulary are invalid, after a stop token only stop tokens follow.
    """
    native = matcher.native
    if matcher.is_terminated():
        return walk_generic(matcher, tree, rows, deadline, root_ready, result)
    words = rows.shape[1]
    flat = flat_words(rows)
    table = torch.from_numpy(rows)
    tokens = tree.tokens.tolist()
    first_child = tree.first_child.tolist()
    next_sibling = tree.next_sibling.tolist()
    stops = matcher._facts.stops
    stop_mask = stop_row(words, tuple(sorted(stops)))
    limit = min(words * 32, tokenizer_vocab_size(matcher))
    fill, accept, rollback = native.fill_next_token_bitmask, native.accept_token, native.rollback
    clock = time.perf_counter
    valid, filled, terminated = result.valid, result.filled, result.terminated
    if not root_ready:
        fill(table, 0)
    valid[0] = filled[0] = True
    depth = 0  # tokens accepted natively since entry
    stack: list[tuple[int, int, int]] = []  # (node, parent, native depth of the parent's state)
    if first_child[0] != NONE:
        stack.append((first_child[0], 0, 0))
    while stack:
        node, parent, parent_depth = stack.pop()
        sibling = next_sibling[node]
        if sibling != NONE:
            stack.append((sibling, parent, parent_depth))
        if clock() > deadline:
            result.budget_hit = True
            break
        token = tokens[node]
        if terminated[parent]:
            if token not in stops:
                continue
        elif token >= limit or not (flat[parent * words + (token >> 5)] >> (token & 31)) & 1:
            continue
        if token in stops:
            rows[node] = stop_mask
            valid[node] = terminated[node] = filled[node] = True
            node_depth = parent_depth
        else:
            if depth > parent_depth:
                rollback(depth - parent_depth)
                depth = parent_depth
            if not accept(token):
                continue
            depth = node_depth = parent_depth + 1
            fill(table, node)
            valid[node] = filled[node] = True
        child = first_child[node]
        if child != NONE:
            stack.append((child, node, node_depth))
    if depth:
        rollback(depth)
    return result
