"""One grammar call per engine step for a whole batch: every constrained request's next row,
and the accepts of the step's tokens (:meth:`BatchFiller.accept_runs`).

:meth:`BatchFiller.fill_next_rows` fills bitmask row ``rows[j]`` from ``matchers[j]`` for all
the constrained requests of a plain decoding step at once. It only groups: matchers whose
library has a batch entry point (``GrammarMatcher.batch_kind``: llguidance's ``LLExecutor``,
xgrammar's ``BatchGrammarMatcher``, each owned by its backend) are filled by one call of it per
library, in native code on the library's own thread pool with the GIL released; terminated
matchers, outlines-core and small groups are filled one by one behind the same call. A matcher
with a ``row_filter`` (the duplicate-key tracker, ``constrained/keys/``) has its source filled
with the others, then all such rows are filtered in one native call per filter kind.

Rows are exactly those of ``matcher.fill_bitmask`` (stop-only rows for terminated matchers, the
bits past V cleared). Faults are per request: a matcher that raises, or that a batch call
leaves in an error state, gets an all-allowed row (the engine ends that request, so the row is
only there to keep the batch's sampling well defined) and its exception in the result; the other
rows are exact. So is a matcher whose fills stay slow (``constrained/fill_cost.py``): fills made
one by one are timed, and a library's batch call that takes too long has its matchers filled
one by one, timed, until none is slow. Matchers known to be slow are filled alone, at once, on
helper threads, each abandoned (its request failed) once its fill passes its limit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from espalier.constrained.base import BatchStep, GrammarMatcher, RowFilter
from espalier.constrained.fill_cost import FillCosts
from espalier.constrained.tree.bounded import RowFill, start_row_fill

Aside = tuple[RowFill, float, "Callable[[int], BatchStep] | None"]
"""A fill on a helper thread (:func:`_start_aside`): it, its limit, its matcher's batch kind."""

MIN_NATIVE_BATCH = 2
"""Fewer matchers of one library than this are filled one by one (a batch call's thread
hand-off costs more than one fill)."""


class BatchFiller:
    """The batch entry points of the libraries met so far (thread-safe for one caller at a
    time: each user makes its own, the engine's grammar worker for fills, the engine thread
    for accepts)."""

    def __init__(self, threads: int, costs: FillCosts | None = None) -> None:
        """threads: native threads per batch call (the libraries' pools); costs: the slow-fill
        guard of :meth:`fill_next_rows` (its defaults when None)."""
        self.threads = max(1, threads)
        self.costs = FillCosts() if costs is None else costs
        self._steps: dict[Callable[[int], BatchStep], BatchStep] = {}
        self._lock = threading.Lock()

    def fill_next_rows(
        self,
        matchers: Sequence[GrammarMatcher],
        bitmask: torch.Tensor,
        rows: Sequence[int],
    ) -> dict[int, BaseException]:
        """Fill ``bitmask[rows[j]]`` (int32, CPU, contiguous, ``[B, ceil(V/32)]``) from
        ``matchers[j]``; the matchers' states do not change. Returns ``{j: exception}`` for the
        matchers that failed (their rows allow every token), among them those whose fills
        stayed too slow (:class:`~espalier.constrained.fill_cost.FillCosts`: their grammar would
        hold the whole batch)."""
        # matchers that filter another's rows (GrammarMatcher.row_filter): that one is filled
        # here, in its library's batch call, then the filters run, one call per kind
        requests = matchers  # what the costs are kept by (a filter's source changes)
        filters = {j: f for j, m in enumerate(matchers) if (f := m.row_filter) is not None}
        if filters:
            matchers = [filters[j].source if j in filters else m for j, m in enumerate(matchers)]
        faults: dict[int, BaseException] = {}
        groups = _by_kind(matchers, range(len(matchers)), faults)
        costs = self.costs
        with self._lock:
            costs.keep(requests)
            # known slow ones alone, at once, on helpers, bounded (fill_cost: their limits)
            aside = _start_aside(matchers, bitmask, rows, groups, requests, costs)
            for kind, members in groups.items():
                if kind is None or len(members) < MIN_NATIVE_BATCH or costs.suspect(kind):
                    slowest = _fill_each(matchers, bitmask, rows, members, faults, requests, costs)
                    if kind is not None:
                        costs.batch_took(kind, slowest)
                    continue
                step = self._step(kind)
                failed: dict[int, BaseException] = {}
                started = time.perf_counter()
                try:
                    step.fill_next_rows(
                        [matchers[j] for j in members], bitmask, [rows[j] for j in members], failed
                    )
                except Exception:  # which one failed is not said: find it one by one
                    _fill_each(matchers, bitmask, rows, members, faults, requests, costs)
                    continue
                # per matcher, about: the call fills its members in rounds of `threads`
                rounds = -(-len(members) // self.threads)
                costs.batch_took(kind, (time.perf_counter() - started) / rounds)
                faults.update({members[k]: exc for k, exc in failed.items()})
            _finish_aside(aside, requests, costs, faults)
        _filter_rows(filters, bitmask, rows, faults, self.threads)
        for j in faults:
            bitmask[rows[j]].fill_(-1)
        return faults

    def accept_runs(
        self, matchers: Sequence[GrammarMatcher], runs: Sequence[Sequence[int]]
    ) -> tuple[list[int], dict[int, BaseException]]:
        """Advance ``matchers[j]`` by ``runs[j]`` exactly as ``matchers[j].accept_tokens(runs[j])``
        would, for a whole step's runs at once: one call per library whose batch entry point
        accepts (``BatchStep.accept_runs``), the rest one by one (outlines-core, terminated
        ones). A row filter's matcher (the duplicate-key tracker) is its source's batch accept
        of the filter's clean prefix, then the filter's :meth:`RowFilter.settle`: one native
        call for the batch's tracked requests too. Returns each run's accepted
        count and ``{j: exception}`` for the matchers that raised (their state is undefined:
        the caller ends those requests)."""
        accepted = [0] * len(matchers)
        faults: dict[int, BaseException] = {}
        # a row filter (the duplicate-key tracker) takes its clean prefix first; its source
        # accepts that in its library's batch call, then the filter settles (RowFilter)
        filters: dict[int, tuple[RowFilter, int]] = {}
        sources, heads = list(matchers), list(runs)
        for j, matcher in enumerate(matchers):
            row_filter = matcher.row_filter if runs[j] else None
            if row_filter is None:
                continue
            try:
                clean = row_filter.take_clean(runs[j])
            except Exception as exc:
                faults[j] = exc
                continue
            filters[j] = (row_filter, clean)
            sources[j], heads[j] = row_filter.source, runs[j][:clean]
        members = [j for j, run in enumerate(heads) if run and j not in faults]
        groups = _by_kind(sources, members, faults)
        with self._lock:
            for kind, members in groups.items():
                if kind is None or len(members) < MIN_NATIVE_BATCH:
                    for j in members:
                        try:
                            accepted[j] = sources[j].accept_tokens(heads[j])
                        except Exception as exc:
                            faults[j] = exc
                    continue
                counts = [0] * len(members)
                failed: dict[int, BaseException] = {}
                try:
                    self._step(kind).accept_runs(
                        [sources[j] for j in members], [heads[j] for j in members], counts, failed
                    )
                except Exception as exc:  # against its contract: their states are unknown
                    failed = dict.fromkeys(range(len(members)), exc)
                for k, j in enumerate(members):
                    accepted[j] = counts[k]
                faults.update({members[k]: exc for k, exc in failed.items()})
        for j, (row_filter, clean) in filters.items():
            if j in faults:
                continue
            try:
                accepted[j] = row_filter.settle(runs[j], clean, accepted[j])
            except Exception as exc:
                faults[j] = exc
        return accepted, faults

    def _step(self, kind: Callable[[int], BatchStep]) -> BatchStep:
        step = self._steps.get(kind)
        if step is None:
            step = self._steps[kind] = kind(self.threads)
        return step


def _by_kind(
    matchers: Sequence[GrammarMatcher], members: Iterable[int], faults: dict[int, BaseException]
) -> dict[Callable[[int], BatchStep] | None, list[int]]:
    """``members`` (indices into ``matchers``) grouped by their library's batch entry point
    (None: terminated, or no batch entry point); a matcher whose state cannot be read goes to
    ``faults`` instead."""
    groups: dict[Callable[[int], BatchStep] | None, list[int]] = {}
    for j in members:
        matcher = matchers[j]
        try:
            kind = None if matcher.is_terminated() else matcher.batch_kind
        except Exception as exc:
            faults[j] = exc
            continue
        groups.setdefault(kind, []).append(j)
    return groups


def _filter_rows(
    filters: dict[int, RowFilter],
    bitmask: torch.Tensor,
    rows: Sequence[int],
    faults: dict[int, BaseException],
    threads: int,
) -> None:
    kinds: dict[Callable[..., None], list[int]] = {}
    for j, row_filter in filters.items():
        if j not in faults:
            kinds.setdefault(row_filter.filter_kind, []).append(j)
    for kind, members in kinds.items():
        try:
            kind([filters[j] for j in members], bitmask, [rows[j] for j in members], threads)
        except Exception as exc:  # which one failed is not said: all of them
            faults.update(dict.fromkeys(members, exc))


def _fill_each(
    matchers: Sequence[GrammarMatcher],
    bitmask: torch.Tensor,
    rows: Sequence[int],
    members: Sequence[int],
    faults: dict[int, BaseException],
    requests: Sequence[GrammarMatcher],
    costs: FillCosts,
) -> float:
    """Fill ``members`` one by one, each timed and charged to ``requests[j]``; returns the
    slowest fill's seconds."""
    slowest = 0.0
    for j in members:
        started = time.perf_counter()
        try:
            matchers[j].fill_bitmask(bitmask, rows[j])
        except Exception as exc:
            faults[j] = exc
            continue
        slowest = max(slowest, _charge(j, time.perf_counter() - started, requests, costs, faults))
    return slowest


def _start_aside(
    matchers: Sequence[GrammarMatcher],
    bitmask: torch.Tensor,
    rows: Sequence[int],
    groups: dict[Callable[[int], BatchStep] | None, list[int]],
    requests: Sequence[GrammarMatcher],
    costs: FillCosts,
) -> dict[int, Aside]:
    """Take the matchers with a :meth:`FillCosts.limit`, and every matcher of a suspect kind
    (:meth:`FillCosts.suspect`: one of them is slow, which is not known), out of ``groups`` and
    start their fills at once on helper threads, each bounded (waiting for each in turn, or
    filling a suspect kind one by one inline, would hold the step for all of them):
    ``{j: (fill, limit, kind)}``."""
    aside: dict[int, Aside] = {}
    for kind in list(groups):
        suspect = kind is not None and costs.suspect(kind)
        if not suspect and not costs.watching:
            continue
        kept = []
        for j in groups[kind]:
            limit = costs.bound(requests[j]) if suspect else costs.limit(requests[j])
            if limit is None:
                kept.append(j)
            else:
                fill = start_row_fill(matchers[j], bitmask[rows[j] : rows[j] + 1])
                aside[j] = (fill, limit, kind)
        if kept:
            groups[kind] = kept
        else:
            del groups[kind]
    return aside


def _finish_aside(
    aside: dict[int, Aside],
    requests: Sequence[GrammarMatcher],
    costs: FillCosts,
    faults: dict[int, BaseException],
) -> None:
    """Wait for :func:`_start_aside`'s fills, each until its limit; charge them; one past its
    limit is abandoned and fails its request. A suspect kind stays one while the slowest of
    its fills is slow."""
    slowest: dict[Callable[[int], BatchStep], float] = {}
    for j, (fill, limit, kind) in aside.items():
        try:
            seconds = fill.result(limit)
        except Exception as exc:
            faults[j] = exc
            continue
        if seconds is None:
            seconds = time.perf_counter() - fill.started
            faults[j] = costs.abandoned(requests[j], seconds)
        else:
            _charge(j, seconds, requests, costs, faults)
        if kind is not None and costs.suspect(kind):
            slowest[kind] = max(slowest.get(kind, 0.0), seconds)
    for kind, seconds in slowest.items():
        costs.batch_took(kind, seconds)


def _charge(
    j: int,
    seconds: float,
    requests: Sequence[GrammarMatcher],
    costs: FillCosts,
    faults: dict[int, BaseException],
) -> float:
    """Charge ``requests[j]`` one fill of ``seconds`` (a fault when that fails it); returns
    the seconds."""
    costly = costs.charge(requests[j], seconds)
    if costly is not None:
        faults[j] = costly
    return seconds
