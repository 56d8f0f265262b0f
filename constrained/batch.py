"""One grammar call per engine step for a whole batch: every constrained request's next row.

:func:`fill_next_rows` fills bitmask row ``rows[j]`` from ``matchers[j]`` for all the
constrained requests of a plain decoding step at once, through each library's batch entry
point, so that the per-request work runs in native code on the library's own thread pool with
the GIL released for the whole call (one Python call per backend per step instead of one per
request): llguidance's ``LLExecutor.unsafe_compute_mask_ptr`` (Rust threads) and xgrammar's
``BatchGrammarMatcher.batch_fill_next_token_bitmask`` (its C++ thread pool); outlines-core and
any other matcher are filled one by one behind the same call shape.

Rows are exactly those of ``matcher.fill_bitmask`` (stop-only rows for terminated matchers, the
bits past V cleared). Faults are per request: a matcher that raises, or that a batch call
leaves in an error state, gets an all-allowed row (the engine ends that request, so the row is
only there to keep the batch's sampling well defined) and its exception in the result; the other
rows are exact.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from espalier.constrained.base import GrammarMatcher

NATIVE_BATCH = frozenset({"llguidance", "xgrammar"})
"""Backends whose library fills a batch of matchers in one native call."""

MIN_NATIVE_BATCH = 2
"""Fewer matchers of one backend than this are filled one by one (a batch call's thread
hand-off costs more than one fill)."""


class BatchFiller:
    """The batch entry points of the installed libraries, made once per engine (thread-safe
    for one caller at a time: the engine's grammar worker)."""

    def __init__(self, threads: int) -> None:
        """threads: native threads per batch call (the libraries' pools)."""
        self.threads = max(1, threads)
        self._llg: Any = None
        self._xgr: Any = None
        self._lock = threading.Lock()

    def fill_next_rows(
        self,
        matchers: Sequence[GrammarMatcher],
        bitmask: torch.Tensor,
        rows: Sequence[int],
    ) -> dict[int, BaseException]:
        """Fill ``bitmask[rows[j]]`` (int32, CPU, contiguous, ``[B, ceil(V/32)]``) from
        ``matchers[j]``; the matchers' states do not change. Returns ``{j: exception}`` for the
        matchers that failed (their rows allow every token)."""
        # wrappers that filter their inner matcher's row (unique_keys.py): the inner matchers
        # are filled in the batch call, then each wrapper filters its row
        filters = {j: m for j, m in enumerate(matchers) if hasattr(m, "filter_row")}
        if filters:
            matchers = [getattr(m, "inner", m) for m in matchers]
        faults: dict[int, BaseException] = {}
        groups: dict[str, list[int]] = {}
        for j, matcher in enumerate(matchers):
            try:
                own = matcher.is_terminated() or getattr(matcher, "_tail", None) is not None
            except Exception as exc:
                faults[j] = exc
                continue
            # terminated, or bits past V to clear: MatcherBase's own wrap-up, one by one
            groups.setdefault("" if own else _backend(matcher), []).append(j)
        batch = _Batch(matchers, bitmask, rows, faults)
        with self._lock:
            for backend, members in groups.items():
                if backend in NATIVE_BATCH and len(members) >= MIN_NATIVE_BATCH:
                    self._fill_native(backend, batch, members)
                else:
                    _fill_each(batch, members)
        for j, wrapper in filters.items():
            if j not in faults:
                wrapper.filter_row(bitmask[rows[j]])  # type: ignore[attr-defined]
        for j in faults:
            bitmask[rows[j]].fill_(-1)
        return faults

    def _fill_native(self, backend: str, batch: _Batch, members: list[int]) -> None:
        """One batch call of ``backend``'s library for ``matchers[j]``, ``j`` in ``members``."""
        matchers, bitmask, rows, faults = batch
        if backend == "xgrammar":
            import xgrammar

            if self._xgr is None:
                self._xgr = xgrammar.BatchGrammarMatcher(self.threads)
            natives = [matchers[j].native for j in members]  # type: ignore[attr-defined]
            try:
                self._xgr.batch_fill_next_token_bitmask(
                    natives, bitmask, [rows[j] for j in members]
                )
            except Exception:  # which one failed is not said: find it one by one
                _fill_each(batch, members)
            return
        import llguidance

        from espalier.constrained.backends.llguidance import MatcherStateError

        ready: list[int] = []
        for j in members:
            matcher: Any = matchers[j]
            try:
                if matcher.mask_memo_stale:
                    matcher.refresh_mask_memo()
                ready.append(j)
            except Exception as exc:
                faults[j] = exc
        if self._llg is None:
            self._llg = llguidance.LLExecutor(self.threads)
        pairs = [(matchers[j].native, rows[j]) for j in ready]  # type: ignore[attr-defined]
        row_bytes = bitmask.shape[1] * 4
        self._llg.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
        for j in ready:
            matcher = matchers[j]
            matcher.mask_memo_stale = False
            if matcher.native.is_error():
                faults[j] = MatcherStateError(f"llguidance: {matcher.native.get_error()}")


class _Batch(NamedTuple):
    matchers: Sequence[GrammarMatcher]
    bitmask: torch.Tensor
    rows: Sequence[int]
    faults: dict[int, BaseException]


def _fill_each(batch: _Batch, members: list[int]) -> None:
    matchers, bitmask, rows, faults = batch
    for j in members:
        try:
            matchers[j].fill_bitmask(bitmask, rows[j])
        except Exception as exc:
            faults[j] = exc


def _backend(matcher: GrammarMatcher) -> str:
    compiled = getattr(matcher, "compiled", None)
    return str(getattr(compiled, "backend", ""))
