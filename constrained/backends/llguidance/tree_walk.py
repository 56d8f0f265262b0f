"""llguidance's tree walk: one C call per tree (``native/llg_walk.c``), the GIL dropped for
the whole call.

The walk computes the root row on the request's own C-API matcher (a mask at its current state,
as plain decoding would: its lexer's lazily built states then grow with the request, and the
clones start warm) and walks the tree on clones of it: a path on one clone, a node off that
path on a fresh clone that consumes the path to its parent; with ``threads`` > 1 a second
thread shares a branchy tree (work stealing between two deques). The request's matcher itself
is never advanced. It checks the budget between nodes (a walk overruns it by at most one mask),
so walks run inline (``Matcher.fill_tree``). A speculative step's trees all go to one such call
(``tree_batch.py``); :func:`walk_llguidance` is that call with one tree.

The adapter's extra rules (``backends/common.py``) hold in C too: special non-stop ids are never
accepted, ids at or above the tokenizer vocabulary are invalid, and after a stop token only
further stop tokens are accepted. Stop tokens are never consumed natively: the parent's row says
whether one may come (the grammar can terminate), and its row is the stop row.

**No rollback.** After a rollback llguidance (1.9.1) can answer a mask of the rolled-back branch,
even after a fresh mask at the rolled-back state (``backends/llguidance/__init__.py``,
``tests/constrained/test_llguidance_stale_rollback.py``). Siblings therefore start from clones
of their parent's state, each of which only ever moves forward.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from espalier.constrained.backends.llguidance.errors import MatcherStateError
from espalier.constrained.backends.llguidance.native import capi as native
from espalier.constrained.tree import DraftTree
from espalier.constrained.tree.walk import WalkResult, walk_generic

WRAP_UP_S = 300e-6
"""Budget kept for what follows a native walk's last node: the wrap-up and the jitter of the
last mask (the smallest margin that kept every budgeted fill within its budget:
``docs/decisions/llguidance-native-walk.md``)."""


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
    """Fill ``rows`` for an llguidance matcher (module docstring); a terminated or failed
    matcher takes the generic walk. ``threads`` > 1 lets a branchy tree of at least 8 nodes
    share its walk with a second thread (``llg_walk.c``)."""
    if matcher.is_terminated() or matcher.native.is_error():
        return walk_generic(matcher, tree, rows, deadline, root_ready, result)
    if matcher.mask_memo_stale:
        matcher.refresh_mask_memo()  # clones carry the memo along
    n = tree.num_nodes
    flags = np.zeros((3, n), dtype=np.uint8)
    if deadline == float("inf"):
        budget = -1.0
    else:  # leave the wrap-up after the walk (flags, unfilled rows) inside the budget too
        budget = max(deadline - time.perf_counter() - WRAP_UP_S, 0.0)
    one = native.BatchTrees(
        roots=np.array([matcher.native.pointer], dtype=np.uint64),
        tokens=tree.tokens,
        parents=tree.parents,
        node_at=np.array([0, n], dtype=np.int64),
        row_at=np.zeros(1, dtype=np.int64),
        flag_at=np.zeros(1, dtype=np.int64),
        filter_states=np.zeros(1, dtype=np.uint64),
        want_snapshot=np.array([matcher.snapshot_wanted], dtype=np.uint8),
    )
    end = native.walk_batch(
        native.api(),
        one,
        rows,
        flags,
        matcher.compiled.native_slot.tables,
        matcher.vocab_size,
        budget,
        1,
        threads,
        native.ROOT_READY if root_ready else native.ROOT_COMPUTE,
        matcher.native.tokenizer,
    )
    if end.errors:
        raise MatcherStateError(f"llguidance tree walk: {end.errors[0]}")
    matcher.helper_rows += int(end.helper_filled[0])
    matcher.took_snapshot(end.snapshots[0])
    result.flags = flags.view(bool)
    result.complete = int(end.filled[0]) == n
    result.budget_hit = int(end.status[0]) == native.WALK_BUDGET_HIT
    return result
