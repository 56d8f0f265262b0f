"""Per-backend compile places (``constrained/compile_pool.py``): in-process lanes wait on their
own compile's deadline, children are bounded by memory."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from espalier.constrained.base import CompileReport
from espalier.constrained.cache import CacheKey, CompileCache
from espalier.constrained.compile_pool import InProcessLane, memory_bounded_children
from espalier.constrained.errors import CompileTimeoutError
from espalier.constrained.spec import GrammarSpec


def key(name: str) -> CacheKey:
    return CacheKey(GrammarSpec.regex(name).cache_key, "test", "tok", ())


class Grammar:
    backend = "test"
    memory_bytes = 1


def test_children_are_bounded_by_available_memory() -> None:
    assert memory_bounded_children(0, 3) == 3  # no cap: as many as asked
    assert memory_bounded_children(1 << 20, 3) == 3  # 1 MiB each fits
    assert memory_bounded_children(1 << 62, 3) == 1  # never fits, yet one may run
    assert memory_bounded_children(1 << 20, 0) == 1


def test_a_full_lane_makes_its_own_compiles_wait_not_other_lanes() -> None:
    busy, other = InProcessLane(1), InProcessLane(1)
    cache = CompileCache(timeout_s=30.0)
    entered, release = threading.Event(), threading.Event()

    def on(lane: InProcessLane, hold: bool = False) -> Any:
        def compile_fn() -> Any:
            with lane.slot():
                if hold:
                    entered.set()
                    release.wait(30)
                return Grammar(), CompileReport(backend="test")

        return compile_fn

    try:
        holder = cache.submit(key("holder"), on(busy, hold=True))
        assert entered.wait(10)
        # the other lane compiles at once; the busy lane's next compile waits on its own limit
        assert cache.get(key("other"), on(other))[1].backend == "test"
        with pytest.raises(CompileTimeoutError):
            cache.get(key("waits"), on(busy), timeout_s=0.2)
        assert cache.stats.negative_hits == 0
        release.set()
        holder.result(timeout=10)
        _, report = cache.get(key("waits"), on(busy))  # not blamed: it only waited
        assert report.queue_seconds >= 0.0 and not report.cache_hit
    finally:
        release.set()
        cache.close()
