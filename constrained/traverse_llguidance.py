"""llguidance tree walks: a Python DFS over ``deep_copy`` snapshots (the default), or a native
one (one C call per tree, opt-in).

**Native walk** (:func:`walk_llguidance`, with ``BackendOptions.llguidance_native_walk`` and a C
compiler, ``constrained/native/``): each request's matcher keeps a twin made through
llguidance's C API, which a walk first catches up with the request (rolls back what the request
rolled back, consumes what it accepted since) and then walks from in ``llg_walk.c``: the same
DFS as below, with no Python per node and the GIL dropped for the whole tree, so trees of a
batch fill in parallel; with ``threads`` > 1 a second twin walks part of a big tree on a second
thread (work stealing between two deques). It checks the budget between nodes (a walk overruns
it by at most one mask), so budgeted native walks run inline (``traverse.fill_tree_bitmask``).
**It is not exact with llguidance 1.9.1**: it moves one matcher down and rolls it back between
siblings, and after such a rollback llguidance can answer a mask of the rolled-back branch (one
tree of 98 on JSONSchemaBench; ``tests/constrained/test_llguidance_stale_rollback.py``). Hence
opt-in.

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

**No rollback.** llguidance's mask memo survives a rollback (``backends/llguidance.py``), so a
rollback-based walk must compute one extra mask after each rollback (+60 % walk time on
sibling-heavy trees). Instead, siblings start from copies of their parent's state: the last
sibling that needs one consumes on the parent's matcher itself, every earlier one on a
``deep_copy`` of it taken just before (p50 ~7 µs on Gemma, against ~15 µs for a mask). Each copy
only ever moves forward, like a decoding request, and its memo (copied along) describes its own
history. The caller's matcher is never advanced: the root's children all start from copies, so
nothing is restored at the end and an abandoned walk (``traverse_bounded``) leaves it as it was.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from espalier.constrained.backends.llguidance import MatcherStateError
from espalier.constrained.native import llguidance as native
from espalier.constrained.native.twin import Twin
from espalier.constrained.traverse import (
    WalkResult,
    flat_words,
    stop_row,
    tokenizer_vocab_size,
    walk_generic,
)
from espalier.constrained.tree import NONE, DraftTree


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
"""Budget kept for what follows a native walk's last node: the wrap-up (~30-60 µs on a quiet
2-core machine) and the jitter of the last mask. Budgeted 64-node Gemma trees on 40
JSONSchemaBench schemas (2 ms budget) finished within it for 94-96 % at 100 µs, 99.3 % at
200 µs, 100 % at 300 µs."""


def native_walk_ready(matcher: Any) -> bool:
    """The native walk can serve ``matcher`` now (its grammar's C-API template exists)."""
    return matcher.compiled.native_template() is not None


SPLIT_MIN_NODES = 8
"""A tree walks on two threads (when allowed) only from this many nodes: below it, the second
thread's start and catch-up (~30-60 µs) cost about what it would save."""


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
    else :func:`walk_llguidance_py`. ``threads`` > 1 lets a native walk of a tree of at least
    :data:`SPLIT_MIN_NODES` nodes share it with a second thread (on a second twin)."""
    if matcher.is_terminated() or matcher.native.is_error():
        return walk_generic(matcher, tree, rows, deadline, root_ready, result)
    twin = matcher.twin
    if twin is None:
        start = matcher.compiled.native_start()
        if start is None:
            return walk_llguidance_py(matcher, tree, rows, deadline, root_ready, result)
        twin = matcher.twin = Twin(start)
    history = matcher.history
    rollback_n, sync = twin.catch_up(history)
    helper_twin = None
    helper = None
    if threads > 1 and tree.num_nodes >= SPLIT_MIN_NODES:
        helper_twin = matcher.helper_twin
        if helper_twin is None:
            start = matcher.compiled.native_start()
            helper_twin = matcher.helper_twin = Twin(start) if start is not None else None
        if helper_twin is not None:
            back, catch = helper_twin.catch_up(history)
            helper = native.HelperStart(helper_twin.native, helper_twin.memo_stale, back, catch)
    n = tree.num_nodes
    flags = np.zeros((3, n), dtype=np.uint8)
    if deadline == float("inf"):
        budget = -1.0
    else:  # leave the wrap-up after the walk (flags, unfilled rows) inside the budget too
        budget = max(deadline - time.perf_counter() - WRAP_UP_S, 0.0)
    try:
        end = native.walk(
            twin.native,
            twin.memo_stale,
            rollback_n,
            sync,
            tree,
            rows,
            matcher.compiled.native_slot.tables,
            native.ROOT_READY if root_ready else native.ROOT_COMPUTE,
            budget,
            flags,
            helper,
        )
    except RuntimeError as exc:
        # their states are unknown now: the next walk starts new ones
        matcher.twin = matcher.helper_twin = None
        raise MatcherStateError(str(exc)) from exc
    helped = 0
    if helper_twin is not None and end.helper is not None:
        helped = end.helper.filled
        helper_twin.ended(len(history), end.helper.path, end.helper.memo_stale, helped)
    twin.ended(len(history), end.path, end.memo_stale, end.filled - helped)
    result.flags = flags.view(bool)
    result.complete = end.filled == n
    result.budget_hit = end.status == native.WALK_BUDGET_HIT
    return result
