"""One grammar call per engine step for a whole batch: every constrained request's next row.

:meth:`BatchFiller.fill_next_rows` fills bitmask row ``rows[j]`` from ``matchers[j]`` for all
the constrained requests of a plain decoding step at once. It only groups: matchers whose
library has a batch entry point (``GrammarMatcher.batch_kind``: llguidance's ``LLExecutor``,
xgrammar's ``BatchGrammarMatcher``, each owned by its backend) are filled by one call of it per
library, in native code on the library's own thread pool with the GIL released; terminated
matchers, outlines-core and small groups are filled one by one behind the same call.

Rows are exactly those of ``matcher.fill_bitmask`` (stop-only rows for terminated matchers, the
bits past V cleared). Faults are per request: a matcher that raises, or that a batch call
leaves in an error state, gets an all-allowed row (the engine ends that request, so the row is
only there to keep the batch's sampling well defined) and its exception in the result; the other
rows are exact.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from espalier.constrained.base import BatchStep, GrammarMatcher

MIN_NATIVE_BATCH = 2
"""Fewer matchers of one library than this are filled one by one (a batch call's thread
hand-off costs more than one fill)."""


class BatchFiller:
    """The batch entry points of the libraries met so far, made once per engine (thread-safe
    for one caller at a time: the engine's grammar worker)."""

    def __init__(self, threads: int) -> None:
        """threads: native threads per batch call (the libraries' pools)."""
        self.threads = max(1, threads)
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
        matchers that failed (their rows allow every token)."""
        # wrappers that filter their inner matcher's row (unique_keys.py): the inner matchers
        # are filled in the batch call, then each wrapper filters its row
        filters = {j: m for j, m in enumerate(matchers) if hasattr(m, "filter_row")}
        if filters:
            matchers = [getattr(m, "inner", m) for m in matchers]
        faults: dict[int, BaseException] = {}
        groups: dict[Callable[[int], BatchStep] | None, list[int]] = {}
        for j, matcher in enumerate(matchers):
            try:
                kind = None if matcher.is_terminated() else matcher.batch_kind
            except Exception as exc:
                faults[j] = exc
                continue
            groups.setdefault(kind, []).append(j)
        with self._lock:
            for kind, members in groups.items():
                if kind is None or len(members) < MIN_NATIVE_BATCH:
                    _fill_each(matchers, bitmask, rows, members, faults)
                    continue
                step = self._steps.get(kind)
                if step is None:
                    step = self._steps[kind] = kind(self.threads)
                failed: dict[int, BaseException] = {}
                try:
                    step.fill_next_rows(
                        [matchers[j] for j in members], bitmask, [rows[j] for j in members], failed
                    )
                except Exception:  # which one failed is not said: find it one by one
                    _fill_each(matchers, bitmask, rows, members, faults)
                    continue
                faults.update({members[k]: exc for k, exc in failed.items()})
        for j, wrapper in filters.items():
            if j not in faults:
                try:
                    wrapper.filter_row(bitmask[rows[j]])  # type: ignore[attr-defined]
                except Exception as exc:
                    faults[j] = exc
        for j in faults:
            bitmask[rows[j]].fill_(-1)
        return faults


def _fill_each(
    matchers: Sequence[GrammarMatcher],
    bitmask: torch.Tensor,
    rows: Sequence[int],
    members: Sequence[int],
    faults: dict[int, BaseException],
) -> None:
    for j in members:
        try:
            matchers[j].fill_bitmask(bitmask, rows[j])
        except Exception as exc:
            faults[j] = exc
