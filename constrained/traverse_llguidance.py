"""llguidance fast path: an iterative DFS straight on the ``LLMatcher``.

An ``LLMatcher`` enters a sticky error state when it consumes a token it does not allow, so each
node's token is first checked against the parent's row (already computed) and consumed with
``try_consume_tokens`` (which consumes nothing on a mismatch); a mask is written straight into
the node's row through ``unsafe_compute_mask_ptr`` (which drops the GIL). The adapter's extra
rules (``backends/common.py``) are applied here too: special non-stop ids are never accepted, ids
at or above the tokenizer vocabulary are invalid, and after a stop token only further stop
tokens are accepted. Stop tokens are never consumed natively: the parent's row says whether one
may come (the grammar can terminate), and its row is the stop row. The matcher is rolled back lazily
and fully restored at the end.

llguidance's mask memo survives a rollback (``backends/llguidance.py``): after each rollback,
the final one included, the restored state's mask is computed again into a scratch row.
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
from espalier.constrained.tree import NONE, DraftTree


def walk_llguidance(
    matcher: Any,
    tree: DraftTree,
    rows: np.ndarray,
    deadline: float,
    root_ready: bool,
    result: WalkResult,
) -> WalkResult:
    """Fill ``rows`` for an llguidance-backed matcher (see the module docstring)."""
    native = matcher.native
    if matcher.is_terminated() or native.is_error():
        return walk_generic(matcher, tree, rows, deadline, root_ready, result)
    words = rows.shape[1]
    row_bytes = words * 4
    base = rows.ctypes.data
    flat = flat_words(rows)
    tokens = tree.tokens.tolist()
    first_child = tree.first_child.tolist()
    next_sibling = tree.next_sibling.tolist()
    facts = matcher._facts
    stops = facts.stops
    excluded = facts.excluded
    limit = min(words * 32, tokenizer_vocab_size(matcher))
    stop_mask = stop_row(words, tuple(sorted(stops)))
    compute = native.unsafe_compute_mask_ptr
    try_consume = native.try_consume_tokens
    clock = time.perf_counter
    timed = deadline != float("inf")
    valid, filled, terminated = result.valid, result.filled, result.terminated
    if not root_ready:
        compute(base, row_bytes)
    elif matcher.mask_memo_stale:
        matcher.refresh_mask_memo()
    refresh = matcher.refresh_mask_memo
    valid[0] = filled[0] = True
    depth = 0  # tokens consumed natively since entry
    # stack entries: (node, parent, native depth of the parent's state)
    stack: list[tuple[int, int, int]] = []
    if first_child[0] != NONE:
        stack.append((first_child[0], 0, 0))
    while stack:
        node, parent, parent_depth = stack.pop()
        sibling = next_sibling[node]
        if sibling != NONE:
            stack.append((sibling, parent, parent_depth))
        if timed and clock() > deadline:
            result.budget_hit = True
            break
        token = tokens[node]
        if token >= limit or token in excluded:
            continue
        if not (flat[parent * words + (token >> 5)] >> (token & 31)) & 1:
            continue
        if token in stops:  # never consumed natively (as the adapter does): a stop row
            rows[node] = stop_mask
            valid[node] = terminated[node] = filled[node] = True
            node_depth = parent_depth
        else:
            if depth > parent_depth:
                native.rollback(depth - parent_depth)
                depth = parent_depth
                refresh()  # the memo may be a rolled-back node's
            if try_consume([token]) != 1:
                continue
            depth = node_depth = parent_depth + 1
            compute(base + node * row_bytes, row_bytes)
            valid[node] = filled[node] = True
        child = first_child[node]
        if child != NONE:
            stack.append((child, node, node_depth))
    if depth:
        native.rollback(depth)
        # eagerly, not through the flag: a budgeted walk runs on a shallow copy of the wrapper
        refresh()
    if native.is_error():
        raise RuntimeError(f"llguidance matcher entered an error state: {native.get_error()}")
    return result
