"""Tree masks of a verify batch, built on CPU threads while the target's forward runs.

``MaskBuilder.submit`` lays the step's trees out in one pinned buffer and queues their fills:
one job per library with a tree batch (``GrammarMatcher.tree_batch_kind``: llguidance's native
walk, every tree it takes in one native call on its own threads, the GIL released, row filters
applied inside it), one job per other tree (``fill_tree``: xgrammar, outlines-core, trees the
batch does not take); it starts the pool's workers on them. ``PendingMasks.result`` takes the
jobs no worker has started yet on the calling thread, then waits. On CUDA the engine submits
right after launching the verify forward (asynchronous), so the fills run while the GPU works
and never compete with the launch for the GIL; on the CPU (synchronous forward) it submits
before.

Row semantics (``constrained.tree``): row ``i`` holds the tokens allowed after the path root→i;
``valid[i]`` says the path is grammar-valid, ``filled[i]`` that the row was computed. The fill
itself is the grammar layer's tree walk (``constrained.tree.masks``); here we only lay the trees of
the batch out and stack the results.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.base import BatchTree
from espalier.constrained.fill_cost import FillCosts
from espalier.constrained.tree.bounded import start_row_fill
from espalier.engine.spec.tree_builder import Draft, sibling_links
from espalier.engine.spec.verify import TreeMasks

if TYPE_CHECKING:
    from espalier.constrained.base import GrammarMatcher, TreeBatch
    from espalier.constrained.tree.masks import TreeMasks as ConstrainedTreeMasks

log = logging.getLogger(__name__)

Fill = tuple[np.ndarray, np.ndarray]
"""``(valid, filled)`` of one tree: bool ``[n]`` numpy each."""


@dataclass
class FillJobs:
    """One step's fill jobs; workers and the caller take them one at a time (``next`` on an
    ``itertools.count`` is atomic under the GIL), so each matcher is used by one thread only.

    jobs: each one fills its requests' rows and flags and sets their ``results``.
    results: one slot per request of the step, set when its fill is done (None before, and for
        unconstrained requests).
    faults: request index -> the exception its fill raised (its grammar's fault alone).
    seconds: the fills' time summed over trees (a native batch reports its own).
    """

    jobs: list[Callable[[FillJobs], None]]
    results: list[Fill | None]
    flags: np.ndarray
    """uint8 ``[3, N]`` (valid, filled, terminated) over every node of the step."""
    then: Callable[[], None] | None = None
    """Called once, by the thread that finishes the last job (``MaskBuilder.submit``'s
    ``after`` jobs start there); never when there are no jobs."""
    faults: dict[int, BaseException] = field(default_factory=dict)
    seconds: float = 0.0
    _next: itertools.count[int] = field(default_factory=itertools.count)
    _done: itertools.count[int] = field(default_factory=itertools.count)

    def work(self) -> None:
        """Run jobs until none is left (on whichever thread calls it)."""
        while (job := next(self._next)) < len(self.jobs):
            try:
                self.jobs[job](self)
            finally:
                if next(self._done) == len(self.jobs) - 1 and self.then is not None:
                    self.then()


@dataclass
class PendingMasks:
    """Masks being filled; ``result()`` helps with the jobs left, then waits for the workers."""

    bitmask: torch.Tensor | None
    mask_rows: torch.Tensor
    fills: FillJobs
    workers: list[Future[None]]
    trees: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    """Request index -> its tree's first bitmask row, first node and node count (constrained
    requests)."""
    ready: TreeMasks | None = None

    def faults(self) -> dict[int, BaseException]:
        """Request index -> the exception its fill raised (after :meth:`result`)."""
        return dict(self.fills.faults)

    def result(self) -> TreeMasks:
        if self.ready is None:
            self.fills.work()
            for worker in self.workers:
                worker.result()  # re-raises a worker's failure
            for index in self.fills.faults:  # a root that allows everything, nothing below
                assert self.bitmask is not None
                row, node, n = self.trees[index]
                self.bitmask[row].fill_(-1)
                self.fills.flags[:, node : node + n] = 0
                self.fills.flags[:2, node] = 1
            self.ready = TreeMasks(
                self.bitmask,
                self.mask_rows,
                torch.from_numpy(self.fills.flags[0].view(bool)),
                torch.from_numpy(self.fills.flags[1].view(bool)),
            )
        return self.ready


class MaskBuilder:
    """Fills the tree masks of a batch on a small thread pool plus the thread that waits for
    them (the grammar backends release the GIL inside their mask computations): a library's
    tree batch (``GrammarMatcher.tree_batch_kind``) as one job on up to ``threads`` native
    threads of its own, each other tree as one job."""

    def __init__(
        self,
        vocab_size: int,
        *,
        threads: int = 2,
        pin_memory: bool = False,
        budget_s: float | None = None,
    ) -> None:
        """vocab_size: V of the bitmask rows; budget_s: time budget per tree (None = none)."""
        self.vocab_size = vocab_size
        self.budget_s = budget_s
        self.pin_memory = pin_memory
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="tree-mask")
        self._buffer: torch.Tensor | None = None
        self._buffer_array: tuple[torch.Tensor, np.ndarray] | None = None
        # fills abandoned at their budget whose native call may still write an unfilled row of
        # the buffer (constrained.tree.bounded): such a buffer is parked until they end
        self._late: list[ConstrainedTreeMasks] = []
        self._batches: dict[Callable[[int], TreeBatch], TreeBatch] = {}
        self.costs = FillCosts()  # a tree's time past its budget is its root's: the guard's
        self._parked: list[tuple[torch.Tensor, list[ConstrainedTreeMasks]]] = []

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _rows(self, n: int) -> torch.Tensor:
        """``n`` rows of one reused (pinned on CUDA) buffer: page-locking per step is slow. The
        previous step's upload finished at its host sync, so the rows are free to overwrite;
        the tree walk writes every row it hands to verification (``constrained.tree.masks``)."""
        late, self._late = [m for m in self._late if m.writes_pending()], []
        if late and self._buffer is not None:  # park it until its late writers end
            self._parked.append((self._buffer, late))
            self._buffer = None
        if self._buffer is None:  # a parked buffer whose writers ended, else a new one
            free = [
                k for k, (_, w) in enumerate(self._parked) if not any(m.writes_pending() for m in w)
            ]
            if free:
                self._buffer = self._parked.pop(free[0])[0]
        if self._buffer is None or self._buffer.shape[0] < n:
            size = max(n, 2 * (0 if self._buffer is None else self._buffer.shape[0]))
            self._buffer = bm.allocate(size, self.vocab_size, pin_memory=self.pin_memory, fill=0)
        return self._buffer[:n]

    def submit(
        self,
        matchers: Sequence[GrammarMatcher | None],
        drafts: Sequence[Draft],
        after: Sequence[Callable[[np.ndarray], None]] = (),
        *,
        hidden_s: float = 0.0,
    ) -> PendingMasks:
        """Queue the fills of ``drafts`` (``matchers[b]`` None = unconstrained request): the
        trees a library's tree batch takes as one job (first), every other tree as one job of
        its own (``fill_tree``); start at most ``threads`` workers on them; the caller's
        ``result()`` takes what is left (on CUDA, where it waits at once, often the batch).
        ``after``: other jobs, run one after the other on a pool thread from when the last
        fill ends, each given the step's ``filled`` flags (bool ``[N]`` over every node of
        ``drafts``, in order: a node verification may accept; a faulted tree's may read as
        filled) (``result()`` does not wait for them; they must not touch the matchers: they
        own what they use; one that raises is logged, the rest still run). Not before: run
        alongside the fills, their Python competed with the fills' for the GIL
        (``docs/decisions/closing-ahead-after-fills.md``).

        hidden_s: how long the target's forward is expected to run alongside the fills. A
        tree's budget stretches to it (never below ``budget_s``): the budget exists so that
        one slow tree cannot hold the batch past the point where the masks are needed, and
        that point is the forward's end. (On the CPU the fills share the cores with a forward
        of hundreds of ms: a fixed 2 ms budget there cut trees, and so their accepted tokens,
        for nothing.)"""
        budget = None if self.budget_s is None else max(self.budget_s, hidden_s)
        self.costs.keep(matchers)  # None (unconstrained) keeps nothing
        rows = sum(d.num_nodes for d, m in zip(drafts, matchers) if m is not None)
        bitmask = self._rows(rows) if rows else None
        # the fills write through numpy slices of one view (a tensor slice per tree would cost a
        # Tensor.numpy() each, tens of µs right after a native walk)
        array = self._array() if bitmask is not None else None
        flags = np.zeros((3, sum(d.num_nodes for d in drafts)), dtype=np.uint8)
        mask_rows: list[int] = []
        singles: list[Callable[[FillJobs], None]] = []
        batches: dict[TreeBatch, list[BatchTree]] = {}
        # fewer trees than threads: a tree may share its walk with a spare thread (only
        # llguidance's native walk does, ``constrained/backends/llguidance/tree_walk.py``)
        constrained = sum(m is not None for m in matchers)
        tree_threads = max(1, min(2, self.threads // max(1, constrained)))
        trees: dict[int, tuple[int, int, int]] = {}
        row = node = 0
        for index, (matcher, draft) in enumerate(zip(matchers, drafts)):
            n = draft.num_nodes
            if matcher is None or array is None:
                mask_rows.extend([-1] * n)
                flags[:2, node : node + n] = 1
                node += n
                continue
            batch, item = self._batch_of(index, matcher, draft, row, node)
            if batch is not None and item is not None:
                batches.setdefault(batch, []).append(item)
            else:
                out = array[row : row + n]
                singles.append(
                    functools.partial(
                        self._fill_one, index, matcher, draft, out, budget, tree_threads, node
                    )
                )
            trees[index] = (row, node, n)
            mask_rows.extend(range(row, row + n))
            row += n
            node += n
        # the native batches first: the first worker takes them while the others fill the rest
        jobs = [
            functools.partial(self._fill_batch, batch, items, matchers, array, budget, tree_threads)
            for batch, items in batches.items()
            if array is not None
        ] + singles
        after_jobs = list(after)
        filled = flags[1].view(bool)
        fills = FillJobs(
            jobs, [None] * len(drafts), flags, functools.partial(self._start, after_jobs, filled)
        )
        mask_rows_t = torch.tensor(mask_rows, dtype=torch.int64)  # before the workers hold the GIL
        workers = [self._pool.submit(fills.work) for _ in range(min(self.threads, len(jobs)))]
        if not jobs:
            self._start(after_jobs, filled)
        return PendingMasks(bitmask, mask_rows_t, fills, workers, trees)

    def _batch_of(
        self, index: int, matcher: GrammarMatcher, draft: Draft, row: int, node: int
    ) -> tuple[TreeBatch | None, BatchTree | None]:
        """The tree batch that takes ``matcher``'s tree (its library's, with the row filter
        applied natively), and the tree's entry; ``(None, None)``: ``fill_tree`` alone."""
        tree_filter = matcher.row_filter
        source = matcher if tree_filter is None else tree_filter.source
        if tree_filter is not None and tree_filter.native_tree_filter is None:
            return None, None
        try:
            kind = source.tree_batch_kind
            if kind is None:
                return None, None
            batch = self._batches.get(kind)
            if batch is None:
                batch = self._batches[kind] = kind(self.threads)
            if not batch.takes(source, draft.parents):
                return None, None
        except Exception:  # its own fill_tree meets the fault again, and reports it
            return None, None
        return batch, BatchTree(index, source, tree_filter, draft.tokens, draft.parents, row, node)

    def _fill_batch(
        self,
        batch: TreeBatch,
        items: list[BatchTree],
        requests: Sequence[GrammarMatcher | None],
        array: np.ndarray,
        budget_s: float | None,
        threads: int,
        fills: FillJobs,
    ) -> None:
        """One native call for the trees ``batch`` takes (``TreeBatch.fill_trees``); each
        tree's time past its budget charged to its request's matcher (``requests[index]``)."""
        faults: dict[int, BaseException] = {}
        times: dict[int, float] = {}
        try:
            fills.seconds += batch.fill_trees(
                items, array, fills.flags, budget_s, threads, faults, times
            )
        except Exception as exc:  # the call failed as a whole: each of its requests
            faults = dict.fromkeys((item.index for item in items), exc)
        for item in items:  # each tree's time past its budget, charged to its matcher
            if item.index in times and item.index not in faults:
                overrun = times[item.index] - (budget_s or 0.0)
                costly = self.costs.charge(requests[item.index], overrun)
                if costly is not None:
                    faults[item.index] = costly
        fills.faults.update(faults)
        for item in items:
            n = len(item.tokens)
            fills.results[item.index] = (
                fills.flags[0, item.node : item.node + n].view(bool),
                fills.flags[1, item.node : item.node + n].view(bool),
            )

    def _start(self, jobs: list[Callable[[np.ndarray], None]], filled: np.ndarray) -> None:
        """Run ``jobs`` one after the other on one pool thread: they are Python (the closing
        decisions ahead), so more threads would only take turns at the GIL, and each turn the
        engine thread waits for is a switch interval (5 ms) long. Their consumer runs a job not
        yet started itself (``Lookahead.take``); numbers:
        ``docs/decisions/closing-ahead-after-fills.md``."""
        if not jobs:
            return
        try:
            self._pool.submit(_run_all, jobs, filled)
        except RuntimeError:  # the pool was shut down meanwhile: jobs not run are taken inline
            return

    def _array(self) -> np.ndarray:
        """The numpy view of the current buffer (made once per buffer)."""
        assert self._buffer is not None
        if self._buffer_array is None or self._buffer_array[0] is not self._buffer:
            self._buffer_array = (self._buffer, self._buffer.numpy())
        return self._buffer_array[1]

    def _fill_one(
        self,
        index: int,
        matcher: GrammarMatcher,
        draft: Draft,
        out: np.ndarray,
        budget_s: float | None,
        threads: int,
        node: int,
        fills: FillJobs,
    ) -> None:
        """One tree's fill (``GrammarMatcher.fill_tree``), its flags copied into the step's; its
        time past the budget charged to ``matcher`` (``costs``). A matcher known to be slow
        has its root row filled first on a helper thread, abandoned (its request failed) past
        its limit (``constrained/fill_cost.py``); the tree's nodes keep the budget."""
        from espalier.constrained.tree import DraftTree

        budget = budget_s or 0.0
        limit = self.costs.limit(matcher, budget) if self.costs.watching else None
        root_s = 0.0
        try:
            tree = DraftTree(draft.tokens, *sibling_links(draft.parents))
            if limit is None:
                result = matcher.fill_tree(tree, out, budget=budget_s, threads=threads)
            else:
                fill = start_row_fill(matcher, torch.from_numpy(out[:1]))
                root = fill.result(limit)
                if root is None:
                    seconds = time.perf_counter() - fill.started
                    fills.faults[index] = self.costs.abandoned(matcher, seconds - budget)
                    return
                root_s = root
                result = matcher.fill_tree(
                    tree, out, budget=budget_s, root_row=out[0], threads=threads
                )
        except Exception as exc:  # this request's grammar: its own fault
            fills.faults[index] = exc
            return
        if result.writes_pending():
            self._late.append(result)
        costly = self.costs.charge(matcher, root_s + result.seconds - budget)
        if costly is not None:
            fills.faults[index] = costly
        n = draft.num_nodes
        fills.flags[0, node : node + n] = result.valid
        fills.flags[1, node : node + n] = result.filled
        fills.flags[2, node : node + n] = result.terminated
        fills.seconds += result.seconds
        fills.results[index] = (result.valid, result.filled)


def _run_all(jobs: list[Callable[[np.ndarray], None]], filled: np.ndarray) -> None:
    for job in jobs:
        try:
            job(filled)
        except Exception:  # one job's failure is its own: the others still run
            log.exception("a mask-thread job failed")
