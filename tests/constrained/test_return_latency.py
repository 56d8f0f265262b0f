"""The learnt give-up margin of budgeted tree fills (``constrained/tree/return_latency.py``)."""

from __future__ import annotations

import pytest

from espalier.constrained.tree import return_latency as rl


def test_margin_starts_at_the_default_and_follows_a_high_quantile() -> None:
    latency = rl.ReturnLatency()
    assert latency.margin == rl.START_MARGIN_S
    for _ in range(rl.WINDOW):
        latency.record(100e-6)
    assert latency.margin == pytest.approx(100e-6 + rl.WRAP_UP_S)
    for _ in range(rl.WINDOW // 10):  # a tenth of the calls wake up late: the margin covers them
        latency.record(300e-6)
    assert latency.margin == pytest.approx(300e-6 + rl.WRAP_UP_S)


def test_margin_forgets_old_latencies_and_is_clamped() -> None:
    latency = rl.ReturnLatency()
    for _ in range(rl.WINDOW):
        latency.record(5e-3)  # a stalled machine: never give away more than the maximum
    assert latency.margin == rl.MAX_MARGIN_S
    for _ in range(rl.WINDOW):
        latency.record(0.0)  # quiet again: the window forgets the stalls
    assert latency.margin == rl.MIN_MARGIN_S
