"""Per-backend compile places (``constrained/compile_pool.py``): in-process lanes wait on their
own compile's deadline, children are bounded by memory, and a compile every caller left is
killed where it runs, freeing its child for the next."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from espalier.constrained.base import CompileReport
from espalier.constrained.cache import CacheKey, CompileCache
from espalier.constrained.compile_pool import ChildPool, InProcessLane, memory_bounded_children
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


def test_a_compile_nobody_waits_for_is_killed_and_frees_its_child() -> None:
    """One child, a compile of 600 s whose only caller cancels: the child is killed and the next
    compile gets the slot (with the old pool it waited for the first's 600 s deadline and
    timed out at its own 60 s)."""
    pool = ChildPool("test", "tests.fixtures.sleepy_child", b"", memory_limit=0, max_children=1)
    cache = CompileCache(timeout_s=600.0)

    def sleeping(seconds: str) -> Any:
        def compile_fn() -> Any:
            assert pool.ask(seconds.encode()) == b"done"
            return Grammar(), CompileReport(backend="test")

        return compile_fn

    try:
        slow = cache.submit(key("slow"), sleeping("600"))
        for _ in range(600):  # the child is building (it took the only slot)
            if pool.busy() == 1 and cache.stats.running == 1:
                break
            threading.Event().wait(0.05)
        assert pool.busy() == 1
        slow.cancel()
        _, report = cache.get(key("next"), sleeping("0"), timeout_s=60.0)
        assert report.backend == "test"
        assert pool.killed == 1 and cache.stats.cancellations == 1
        assert cache.stats.negative_hits == 0 and cache.stats.timeouts == 0
    finally:
        cache.close()
        pool.close()


def test_a_compile_still_awaited_by_another_caller_runs_on() -> None:
    pool = ChildPool("test", "tests.fixtures.sleepy_child", b"", memory_limit=0, max_children=1)
    cache = CompileCache(timeout_s=600.0)

    def compile_fn() -> Any:
        assert pool.ask(b"0.5") == b"done"
        return Grammar(), CompileReport(backend="test")

    try:
        first = cache.submit(key("shared"), compile_fn)
        second = cache.submit(key("shared"), compile_fn)  # joins the compile in flight
        first.cancel()
        assert second.result(timeout=60)[1].backend == "test"
        assert pool.killed == 0
    finally:
        cache.close()
        pool.close()
