"""A C-API twin of a request's llguidance matcher, and how it catches up with the request.

The native tree walk (``backends/llguidance/tree_walk.py``) runs on clones of a C-API matcher,
not on the request's ``LLMatcher``. That matcher, the twin, only ever moves forward: each walk
first makes it consume what the request accepted since the last walk, and computes the root row
on it (a mask at its current state, as plain decoding would); every other row is computed on
clones.
(llguidance 1.9.1 can answer a stale mask after a rollback: ``tests/constrained/
test_llguidance_stale_rollback.py``.) When the request rolls back below what the twin consumed,
the twin is dropped and a new one consumes the whole history at the next walk.
"""

from __future__ import annotations

from dataclasses import dataclass

from espalier.constrained.backends.llguidance.native.capi import NativeMatcher


@dataclass
class Twin:
    """One C-API matcher following a request.

    Attributes:
        native: the C-API matcher.
        length: tokens it has consumed: the first ``length`` of the request's history, as long
            as the request has not rolled back below that.
        rows_filled: rows of tree masks filled by the walks' second thread (all walks).
    """

    native: NativeMatcher
    length: int = 0
    rows_filled: int = 0

    def ended(self, history_len: int, helper_filled: int) -> None:
        """A walk caught it up to ``history_len`` tokens; its second thread filled
        ``helper_filled`` rows."""
        self.length = history_len
        self.rows_filled += helper_filled
