"""llguidance tree walks: native (one C call per tree) for chain-like trees, a Python DFS over
``deep_copy`` snapshots for branchy ones. Neither ever rolls a matcher back (below).

**Native walk** (:func:`walk_llguidance`, with ``BackendOptions.llguidance_native_walk``, on by
default, ``constrained/backends/llguidance/native/``): each request's matcher keeps a twin made
through llguidance's C API, which only moves forward with the request (each walk first makes it
consume what the request accepted since; it computes the root row). ``llg_walk.c`` walks the
tree on clones of it: the same DFS as below, with no Python per node and the GIL dropped for the
whole call; with ``threads`` > 1 a second thread shares a branchy tree (work stealing between
two deques). A speculative step's trees all go to one such call (``tree_batch.py``: in
parallel on native threads, their key filters applied inside it); :func:`walk_llguidance` is
the same call with one tree, for ``Matcher.fill_tree``. A node off the current path gets a
fresh clone, which costs more than the Python walk's ``deep_copy``, so trees with more than
``BackendOptions.llguidance_native_max_branches`` branches take the Python walk. It checks the
budget between nodes (a walk overruns it by at most one mask), so budgeted native walks run
inline (``Matcher.fill_tree``).

**Python walk** (:func:`walk_llguidance_py`): an iterative DFS over ``deep_copy`` snapshots of
the ``LLMatcher``.

An ``LLMatcher`` enters a sticky error state when it consumes a token it does not allow, so each
node's token is first checked against the parent's row (already computed) and consumed with
``try_consume_tokens`` (which consumes nothing on a mismatch); a mask is written straight into
the node's row through ``unsafe_compute_mask_ptr`` (which drops the GIL). The adapter's extra
rules (``backends/common.py``) are applied here too: special non-stop ids are never accepted, ids
at or above the tokenizer vocabulary are invalid, and after a stop token only further stop
tokens are accepted. Stop tokens are never consumed natively: the parent's row says whether one
may come (the grammar can terminate), and its row is the stop row.

**No rollback.** After a rollback llguidance (1.9.1) can answer a mask of the rolled-back branch,
even after a fresh mask at the rolled-back state (``backends/llguidance.py``,
``tests/constrained/test_llguidance_stale_rollback.py``: the former native walk, which rolled one
matcher back between siblings, got 1 tree of 98 wrong on JSONSchemaBench). Instead, siblings
start from copies of their parent's state: the last
sibling that needs one consumes on the parent's matcher itself, every earlier one on a
``deep_copy`` of it taken just before (p50 ~7 µs on Gemma, against ~15 µs for a mask). Each copy
only ever moves forward, like a decoding request, and its memo (copied along) describes its own
history. The caller's matcher is never advanced: the root's children all start from copies, so
nothing is restored at the end and an abandoned walk (``constrained/tree/bounded.py``) leaves it
as it was.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from espalier.constrained.backends.llguidance.errors import MatcherStateError
from espalier.constrained.backends.llguidance.native import capi as native
from espalier.constrained.backends.llguidance.native.twin import Twin
from espalier.constrained.tree import NONE, DraftTree
from espalier.constrained.tree.walk import (
    WalkResult,
    flat_words,
    stop_row,
    tokenizer_vocab_size,
    walk_generic,
)


def walk_llguidance_py(
    matcher: Any,
    tree: DraftTree,
    rows: np.ndarray,
    deadline: float,
    root_ready: bool,
    result: WalkResult,
) -> WalkResult:
    """Fill ``rows`` for an llguidance-backed matcher in Python (see the module docstring)."""
    root = matcher.native
    if matcher.is_terminated() or root.is_error():
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
    clock = time.perf_counter
    timed = deadline != float("inf")
    valid, filled, terminated = result.valid, result.filled, result.terminated
    if not root_ready:
        root.unsafe_compute_mask_ptr(base, row_bytes)
    elif matcher.mask_memo_stale:  # copies inherit the memo: make it describe the root first
        matcher.refresh_mask_memo()
    valid[0] = filled[0] = True
    # Stack entries: (node, parent matcher or None for a stop chain, copy it before consuming).
    stack: list[tuple[int, Any, bool]] = []

    def push_children(parent: int, source: Any, keep_source: bool) -> None:
        """Queue the children of ``parent`` that its row allows, first child on top.

        ``source`` is a matcher at ``parent``'s state (None after a stop token); the last child
        to consume may take it over unless ``keep_source`` (the caller's own matcher).
        """
        kids: list[int] = []
        child = first_child[parent]
        at = parent * words
        while child != NONE:
            token = tokens[child]
            allowed = token < limit and (flat[at + (token >> 5)] >> (token & 31)) & 1
            if allowed and token not in excluded:
                kids.append(child)
            child = next_sibling[child]
        owner = keep_source
        for kid in reversed(kids):  # the last kid is processed last: it may own ``source``
            if tokens[kid] in stops or source is None:
                stack.append((kid, None, False))
            else:
                stack.append((kid, source, owner))
                owner = True

    push_children(0, root, True)
    while stack:
        node, source, copy_first = stack.pop()
        if timed and clock() > deadline:
            result.budget_hit = True
            break
        if source is None:  # a stop token (or one after it): never consumed natively
            rows[node] = stop_mask
            valid[node] = terminated[node] = filled[node] = True
            push_children(node, None, False)
            continue
        state = source.deep_copy() if copy_first else source
        if state.try_consume_tokens([tokens[node]]) != 1:
            continue
        state.unsafe_compute_mask_ptr(base + node * row_bytes, row_bytes)
        valid[node] = filled[node] = True
        if first_child[node] != NONE:
            push_children(node, state, False)
    return result


WRAP_UP_S = 300e-6
"""Budget kept for what follows a native walk's last node: the wrap-up and the jitter of the
last mask (the smallest margin that kept every budgeted fill within its budget:
``docs/decisions/llguidance-native-walk.md``)."""


def branches(tree: DraftTree) -> int:
    """Children beyond the first, summed over the nodes (0: a chain)."""
    return tree.num_nodes - 1 - int(np.count_nonzero(tree.first_child >= 0))


def native_takes(matcher: Any, tree: DraftTree) -> bool:
    """The native walk takes ``tree`` for ``matcher``: at most
    ``BackendOptions.llguidance_native_max_branches`` :func:`branches`."""
    max_branches: int = matcher.compiled.native_max_branches
    return branches(tree) <= max_branches


def native_walk_ready(matcher: Any) -> bool:
    """The native walk can serve ``matcher`` now (its grammar's C-API template exists)."""
    return matcher.compiled.native_template() is not None


def walk_llguidance(
    matcher: Any,
    tree: DraftTree,
    rows: np.ndarray,
    deadline: float,
    root_ready: bool,
    result: WalkResult,
    *,
    threads: int = 1,
) -> WalkResult:
    """Fill ``rows`` for an llguidance-backed matcher: natively when it can (module docstring),
    else :func:`walk_llguidance_py`. ``threads`` > 1 lets a native walk of a branchy tree of at
    least 8 nodes share it with a second thread (``llg_walk.c``)."""
    if matcher.is_terminated() or matcher.native.is_error():
        return walk_generic(matcher, tree, rows, deadline, root_ready, result)
    if not native_takes(matcher, tree):
        return walk_llguidance_py(matcher, tree, rows, deadline, root_ready, result)
    twin = twin_of(matcher)
    if twin is None:
        return walk_llguidance_py(matcher, tree, rows, deadline, root_ready, result)
    n = tree.num_nodes
    flags = np.zeros((3, n), dtype=np.uint8)
    if deadline == float("inf"):
        budget = -1.0
    else:  # leave the wrap-up after the walk (flags, unfilled rows) inside the budget too
        budget = max(deadline - time.perf_counter() - WRAP_UP_S, 0.0)
    history = matcher.history
    length = len(history)
    sync = history[twin.length :]
    one = native.BatchTrees(
        roots=np.array([twin.native.pointer], dtype=np.uint64),
        sync=np.array(sync, dtype=np.uint32),
        sync_at=np.array([0, len(sync)], dtype=np.int64),
        tokens=tree.tokens,
        parents=tree.parents,
        node_at=np.array([0, n], dtype=np.int64),
        row_at=np.zeros(1, dtype=np.int64),
        flag_at=np.zeros(1, dtype=np.int64),
        filter_states=np.zeros(1, dtype=np.uint64),
    )
    compiled = matcher.compiled
    end = native.walk_batch(
        native.api(),
        one,
        rows,
        flags,
        compiled.native_slot.tables,
        matcher.vocab_size,
        budget,
        1,
        threads,
        native.ROOT_READY if root_ready else native.ROOT_COMPUTE,
    )
    if end.errors:
        if matcher.twin is twin:
            matcher.twin = None  # its state is unknown now: the next walk starts a new one
        raise MatcherStateError(f"llguidance tree walk: {end.errors[0]}")
    twin.ended(length, int(end.helper_filled[0]))
    result.flags = flags.view(bool)
    result.complete = int(end.filled[0]) == n
    result.budget_hit = int(end.status[0]) == native.WALK_BUDGET_HIT
    return result


def twin_of(matcher: Any) -> Twin | None:
    """``matcher``'s twin, made when it has none (None: no C-API template for its grammar)."""
    twin: Twin | None = matcher.twin
    if twin is None:
        start = matcher.compiled.native_start()
        if start is None:
            return None
        twin = matcher.twin = Twin(start)
    return twin
