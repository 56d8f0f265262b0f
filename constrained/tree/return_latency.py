"""How early a budgeted tree fill must stop waiting to return within its budget, learnt online.

``tree/bounded.py`` runs the walk on a helper thread and the caller waits until just before
the deadline. Giving up is not free: the caller wakes from a timed wait (timer slack, a CPU to
run on), takes the GIL back from the helper, snapshots the walk and wraps up. That latency is
~0.1 ms on a quiet machine and several times more on a loaded one, so a fixed margin is either
wasteful or too small. :class:`ReturnLatency` keeps the last :data:`WINDOW` measured latencies
(seconds from the moment the caller could have returned, the walk's end or the give-up time,
whichever is first, to its return) and sets the margin to a high quantile of them plus the
fill's fixed wrap-up, clamped to ``[MIN_MARGIN_S, MAX_MARGIN_S]``.
"""

from __future__ import annotations

import threading
from collections import deque

WINDOW = 256
"""Latencies remembered (the newest)."""

QUANTILE = 0.99
"""The margin covers this share of the remembered latencies."""

WRAP_UP_S = 150e-6
"""``masks.fill_with``'s work after the bounded walk returns (flags, stop bits, tail), with the
helper thread still finishing (GIL hand-over): ~60 µs alone, up to ~150 µs measured."""

MIN_MARGIN_S = 150e-6
MAX_MARGIN_S = 0.5e-3
"""Clamp: never wait past ``deadline - MIN``; never give away more than ``MAX`` of the budget."""

START_MARGIN_S = 250e-6
"""The margin before any latency is measured."""


class ReturnLatency:
    """A thread-safe estimate of the caller's give-up latency and the margin it implies."""

    def __init__(self) -> None:
        self._samples: deque[float] = deque(maxlen=WINDOW)
        self._lock = threading.Lock()
        self._margin = START_MARGIN_S
        self._since_update = 0
        self.recorded = 0  # latencies recorded so far (all time)

    @property
    def margin(self) -> float:
        """Seconds before the deadline at which the caller stops waiting."""
        return self._margin

    def record(self, seconds: float) -> None:
        """One measured latency; the margin is recomputed every 16 samples."""
        with self._lock:
            self._samples.append(max(seconds, 0.0))
            self.recorded += 1
            self._since_update += 1
            if self._since_update >= 16 or len(self._samples) < 16:
                self._since_update = 0
                ordered = sorted(self._samples)
                high = ordered[min(int(QUANTILE * len(ordered)), len(ordered) - 1)]
                self._margin = min(max(high + WRAP_UP_S, MIN_MARGIN_S), MAX_MARGIN_S)
