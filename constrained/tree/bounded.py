"""A budget that holds even when one native mask fill is slow: the walk runs on a helper thread.

Walkers check the deadline between nodes, so without help a single slow fill overruns the budget
by its own length (an xgrammar fill can take 80 ms on a Github_medium schema, an llguidance one
5 ms). :func:`walk_bounded` makes the deadline a wall-clock bound instead:

1. The walk runs on a helper thread, on the caller's native matcher through a wrapper of its
   own; a fork made beforehand becomes the caller's native matcher if the walk is abandoned, so
   the caller's matcher is free, at its state before the call, the moment we return. The
   libraries drop the GIL inside their fills, so the waiting caller costs nothing. Node rows are
   written straight into ``out``.
2. The caller waits until just before the deadline. Finished in time: done (the common case).
3. Still running: the walk is **abandoned**. The caller keeps the nodes whose rows were complete
   at that moment (walkers set ``filled[i]`` only after row ``i`` is written, see
   ``walk.WalkResult``) and prunes every other node (``valid = filled = False``). The fill in
   flight may still write *its* row of ``out`` (a pruned node's, never a kept one and never the
   root's) until ``TreeMasks.late_writes`` is set: the caller must not reuse ``out`` for other
   data before that (``engine/spec/masks.py`` allocates a fresh buffer instead). Nothing else
   changes after the return: the walk starts no node past its deadline and uses only the
   native matcher it was given, which the caller no longer holds.
4. The root row is always exact: the helper computes it into a private row and copies it into
   ``out`` only while the caller still waits; if it is not there when the caller gives up, the
   caller computes it itself on its own matcher (the only part that may exceed the budget).

Cost on the common path: one fork (~10-40 µs), one thread hand-off, one root-row copy.
Walkers whose fills cannot be slow (outlines-core: cached rows) do not need this and run inline.

:func:`start_row_fill` bounds one row fill the same way, for a matcher whose request is ended
if the fill overruns (``constrained/fill_cost.py``): an ambiguous grammar's masks grow with the
text, and one long token can make the next mask cost 15 times the last (seconds to minutes).
"""

from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from espalier.constrained.tree import DraftTree
from espalier.constrained.tree.return_latency import ReturnLatency
from espalier.constrained.tree.walk import Walker, WalkResult

LATENCY = ReturnLatency()
"""How early the caller stops waiting (``constrained/tree/return_latency.py``): waking from a timed
wait, taking the GIL back and the wrap-up take ~0.1 ms on a quiet 2-core machine and more on a
busy one, and the call should return *within* its budget; learnt from the calls that gave up."""

MAX_MARGIN_SHARE = 0.25
"""The give-up margin never exceeds this share of the time left when the call starts."""

FILL_ALLOWANCE_S = 100e-6
"""The helper's walk starts no new node after ``deadline - LATENCY.margin - FILL_ALLOWANCE_S``,
so that a typical fill started just before (p50 8 µs llguidance, 84 µs xgrammar on Gemma) ends
before the caller gives up and its node is kept rather than pruned."""

MAX_HELPERS = 32
"""Helper threads at most; abandoned walks and row fills hold theirs until their fill returns
(past that, new ones queue: their waits time out, so a tree keeps its root alone and a slow
matcher fails, while every other request goes on)."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_scratch = threading.local()


def _helpers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_HELPERS, thread_name_prefix="tree-walk")
        return _pool


def walk_bounded(
    walker: Walker,
    matcher: Any,
    tree: DraftTree,
    rows: np.ndarray,
    deadline: float,
    root_ready: bool,
) -> WalkResult:
    """Run ``walker`` for ``matcher`` on a helper thread; return by ``deadline``.

    Same contract as a :data:`~espalier.constrained.tree.walk.Walker` (``rows`` filled for every
    node the result marks ``filled``; the matcher's state unchanged), plus: the call returns by
    ``deadline`` unless the root row itself has to be computed after it. When the walk is
    abandoned, ``result.late_writes`` is an event set when it ends (see :class:`WalkResult`).
    """
    # a loaded machine must not make the margin eat the budget: at most a quarter of what is left
    margin = min(LATENCY.margin, MAX_MARGIN_SHARE * (deadline - time.perf_counter()))
    if deadline - margin <= time.perf_counter():  # no time left: the root alone
        result = WalkResult.empty(tree.num_nodes)
        result.budget_hit = True
    else:
        # The walk runs on the caller's native matcher (already warm) through a wrapper of its
        # own; the copy made here replaces it in the caller's wrapper only if the walk is
        # abandoned (the abandoned walk keeps the old one until its fill returns).
        spare = matcher.fork().native
        give_up = deadline - margin
        walk_deadline = give_up - FILL_ALLOWANCE_S
        walk = _HelperWalk(walker, copy.copy(matcher), tree, rows, walk_deadline, root_ready)
        _helpers().submit(walk.run)
        walk.done.wait(max(give_up - time.perf_counter(), 0.0))
        with walk.lock:
            if walk.done.is_set():
                if walk.error is not None:
                    raise walk.error
                # the caller could have returned when the walk ended (or at give-up, if later)
                LATENCY.record(time.perf_counter() - min(walk.done_at, give_up))
                return walk.result
            walk.abandoned = True
            result = walk.snapshot()
        matcher.native = spare
        LATENCY.record(time.perf_counter() - give_up)
    if not result.filled[0]:  # the root row is always exact: the caller's own matcher fills it
        result.valid[0] = True
        if not root_ready:
            matcher.fill_bitmask(torch.from_numpy(rows), 0)
        result.terminated[0] = matcher.is_terminated()
        result.filled[0] = True
    return result


def start_row_fill(matcher: Any, out: torch.Tensor) -> RowFill:
    """Start ``matcher.fill_bitmask`` of ``out`` (an int32 ``[1, ceil(V/32)]`` CPU row; a view
    into a batch's bitmask is fine) on a helper thread; its :meth:`RowFill.result` waits (so
    several run at once)."""
    fill = RowFill(matcher, out)
    _helpers().submit(fill.run)
    return fill


class RowFill:
    """One row fill on a helper thread (:func:`start_row_fill`). Costs a thread hand-off: for
    matchers already known to be slow only."""

    def __init__(self, matcher: Any, out: torch.Tensor) -> None:
        self.matcher, self.out = matcher, out
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.abandoned = False
        self.started = time.perf_counter()
        self.seconds = 0.0
        self.error: BaseException | None = None

    def result(self, limit_s: float) -> float | None:
        """Wait until ``limit_s`` after the start. The fill's seconds, with ``out`` written; or
        None when it was abandoned: ``out`` is then unwritten and never written later (the
        helper fills a private row and copies it under the lock only while the caller
        waits), but the fill goes on on the matcher until it returns, so the caller must
        never use that matcher again (its request is ended). An exception the fill raised in
        time is re-raised."""
        self.done.wait(max(0.0, self.started + limit_s - time.perf_counter()))
        with self.lock:
            if self.done.is_set():
                if self.error is not None:
                    raise self.error
                return self.seconds
            self.abandoned = True
        return None

    def run(self) -> None:
        if self.abandoned:  # queued behind busy helpers past its caller's wait
            return
        row = torch.empty_like(self.out)  # private: an abandoned fill writes nothing shared
        error: BaseException | None = None
        try:
            self.matcher.fill_bitmask(row, 0)
        except BaseException as exc:  # re-raised by the caller if it still waits
            error = exc
        with self.lock:
            if self.abandoned:
                return
            if error is None:
                self.out.copy_(row)
            self.error, self.seconds = error, time.perf_counter() - self.started
            self.done.set()


class _HelperWalk:
    """One walk handed to a helper thread; ``lock`` orders the helper's root hand-over and its
    end against the caller giving up.

    The walk writes node rows straight into ``out`` (no copy), except the root's: computed into
    a private row and copied into ``out`` under ``lock`` unless the caller gave up, so a late root
    fill can never overwrite the root row the caller computed itself.
    """

    def __init__(
        self,
        walker: Walker,
        view: Any,
        tree: DraftTree,
        out: np.ndarray,
        deadline: float,
        root_ready: bool,
    ) -> None:
        self.walker, self.view, self.tree, self.out = walker, view, tree, out
        self.deadline, self.root_ready = deadline, root_ready
        self.result = WalkResult.empty(tree.num_nodes)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.ended = threading.Event()  # set when the helper no longer touches ``out``
        self.abandoned = False
        self.done_at = float("inf")  # when ``done`` was set
        self.error: BaseException | None = None

    def run(self) -> None:
        """On the helper thread: root into a private row, hand it over, walk the rest."""
        error: BaseException | None = None
        try:
            if self._root():
                self.walker(self.view, self.tree, self.out, self.deadline, True, self.result)
        except BaseException as exc:  # re-raised by the caller if it still waits
            error = exc
        with self.lock:
            self.ended.set()
            if not self.abandoned:
                self.error = error
                self.done_at = time.perf_counter()
                self.done.set()

    def _root(self) -> bool:
        """Make ``out[0]`` the root row; False when the caller gave up meanwhile."""
        if self.root_ready:
            with self.lock:
                return not self.abandoned
        row = _root_scratch(self.out.shape[1])
        self.view.fill_bitmask(row, 0)
        terminated = self.view.is_terminated()
        with self.lock:
            if self.abandoned:
                return False
            self.out[0] = row[0].numpy()
            self.result.valid[0] = True
            self.result.terminated[0] = terminated
            self.result.filled[0] = True
            return True

    def snapshot(self) -> WalkResult:
        """Under ``lock``, when giving up: the nodes whose rows are complete now; the rest pruned.

        Rows not in the snapshot may still be written by the walk's fill in flight, until
        ``late_writes`` (this walk's ``ended``) is set.
        """
        filled = list(self.result.filled)  # rows of these nodes are written
        terminated = [t and f for t, f in zip(self.result.terminated, filled)]
        late = None if self.ended.is_set() else self.ended
        return WalkResult(list(filled), filled, terminated, True, True, late)


def _root_scratch(words: int) -> torch.Tensor:
    """This helper thread's private root row (int32 ``[1, words]``)."""
    row: torch.Tensor | None = getattr(_scratch, "root", None)
    if row is None or row.shape[1] != words:
        row = torch.zeros((1, words), dtype=torch.int32)
        _scratch.root = row
    return row
