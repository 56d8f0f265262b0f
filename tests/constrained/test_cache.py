"""Compile cache: hit, byte-bounded eviction, timeout, negative cache, cancellation, concurrency.

Compiles are injected callables (the cache takes one per call); slow compiles block on a
``threading.Event`` instead of sleeping, so every outcome is deterministic.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any

import pytest

from espalier.constrained.base import CompileReport
from espalier.constrained.cache import CacheKey, CompileCache
from espalier.constrained.errors import CompileTimeoutError, InvalidGrammarError
from espalier.constrained.spec import GrammarKind, GrammarSpec


@dataclass
class SizedGrammar:
    """A compiled grammar stand-in of a chosen size (the cache only reads ``memory_bytes``)."""

    name: str
    memory_bytes: int
    backend: str = "test"

    @property
    def spec(self) -> GrammarSpec:
        return GrammarSpec.regex(self.name)

    def matcher(self) -> Any:
        raise NotImplementedError


def key(name: str) -> CacheKey:
    return CacheKey(GrammarSpec(GrammarKind.REGEX, name).cache_key, "test", "tok", ())


def compiler(name: str, size: int = 100, calls: list[str] | None = None) -> Any:
    def compile_fn() -> tuple[Any, CompileReport]:
        if calls is not None:
            calls.append(name)
        return SizedGrammar(name, size), CompileReport(backend="test")

    return compile_fn


@pytest.fixture
def cache() -> Any:
    c = CompileCache(max_bytes=1000, workers=2, timeout_s=5.0)
    yield c
    c.close()


def test_hit_returns_the_same_grammar_without_compiling(cache: CompileCache) -> None:
    calls: list[str] = []
    first, report1 = cache.get(key("a"), compiler("a", calls=calls))
    second, report2 = cache.get(key("a"), compiler("a", calls=calls))
    assert first is second
    assert calls == ["a"]
    assert not report1.cache_hit and report2.cache_hit
    assert (cache.stats.hits, cache.stats.misses, cache.stats.compiles) == (1, 1, 1)
    assert cache.stats.compile_seconds_total >= 0.0


def test_lru_eviction_is_bounded_in_bytes(cache: CompileCache) -> None:
    calls: list[str] = []
    for name in "abc":  # 3 x 400 bytes > 1000: "a" goes
        cache.get(key(name), compiler(name, 400, calls))
    assert cache.stats.evictions == 1 and cache.stats.bytes == 800
    cache.get(key("b"), compiler("b", 400, calls))  # hit: "b" becomes most recent
    cache.get(key("d"), compiler("d", 400, calls))  # evicts "c", the least recent
    cache.get(key("b"), compiler("b", 400, calls))
    cache.get(key("c"), compiler("c", 400, calls))
    assert calls == ["a", "b", "c", "d", "c"]
    assert cache.stats.bytes <= 1000


def test_grammar_larger_than_the_cache_is_returned_but_not_kept(cache: CompileCache) -> None:
    calls: list[str] = []
    grammar, _ = cache.get(key("big"), compiler("big", 5000, calls))
    assert grammar.memory_bytes == 5000 and cache.stats.entries == 0
    cache.get(key("big"), compiler("big", 5000, calls))
    assert calls == ["big", "big"]


def test_negative_cache_fails_again_instantly_with_the_same_error(cache: CompileCache) -> None:
    calls: list[int] = []

    def bad() -> Any:
        calls.append(1)
        raise InvalidGrammarError("regex", "unbalanced parenthesis", column=3)

    with pytest.raises(InvalidGrammarError) as first:
        cache.get(key("("), bad)
    with pytest.raises(InvalidGrammarError) as second:
        cache.get(key("("), bad)
    assert first.value is second.value and len(calls) == 1
    assert cache.stats.negative_hits == 1 and cache.stats.failures == 1


def test_unexpected_exceptions_are_not_cached(cache: CompileCache) -> None:
    calls: list[int] = []

    def broken() -> Any:
        calls.append(1)
        raise RuntimeError("bug")

    for _ in range(2):
        with pytest.raises(RuntimeError):
            cache.get(key("x"), broken)
    assert len(calls) == 2


def stuck_until(release: threading.Event) -> Any:
    """A compile that runs until ``release`` is set (at most 30 s)."""

    def stuck() -> Any:
        release.wait(30)
        return SizedGrammar("slow", 10), CompileReport(backend="test")

    return stuck


def test_timeout_raises_and_the_pool_keeps_working() -> None:
    cache = CompileCache(workers=1, timeout_s=0.05)
    release = threading.Event()
    stuck = stuck_until(release)

    try:
        with pytest.raises(CompileTimeoutError):
            cache.get(key("slow"), stuck)
        # the only worker is still inside `stuck`, yet a new compile runs on its replacement
        grammar, _ = cache.get(key("fast"), compiler("fast"))
        assert grammar.name == "fast"
        with pytest.raises(CompileTimeoutError):  # negative cache: same error, no new compile
            cache.get(key("slow"), stuck)
        assert cache.stats.timeouts == 1 and cache.stats.negative_hits == 1
        release.set()
    finally:
        release.set()
        cache.close()


def test_a_timeout_is_remembered_for_a_while_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile slowed by a loaded machine timed out once and then failed every later request
    for good (a held-out sweep: a schema that compiles in 1.5 s); it gets another try once
    ``timeout_memory_s`` has passed (the clock moved on here, not waited for: a 0.5 s memory
    ran out between two calls on a loaded CI machine). The limit is a second: a timeout is
    remembered only after the compile ran half of it, and with 50 ms a loaded machine started
    the compile too late (a full run beside two servers)."""
    cache = CompileCache(workers=1, timeout_s=1.0, timeout_memory_s=60.0)
    release = threading.Event()
    stuck = stuck_until(release)

    try:
        with pytest.raises(CompileTimeoutError):
            cache.get(key("slow"), stuck)
        with pytest.raises(CompileTimeoutError):  # remembered: no new compile
            cache.get(key("slow"), compiler("now fast"))
        assert cache.stats.negative_hits == 1
        now = time.monotonic()
        monkeypatch.setattr(time, "monotonic", lambda: now + 61.0)
        grammar, report = cache.get(key("slow"), compiler("now fast"))
        assert grammar.name == "now fast" and not report.cache_hit
    finally:
        release.set()
        cache.close()


def test_abandoned_compile_that_finishes_replaces_the_negative_entry() -> None:
    cache = CompileCache(workers=1, timeout_s=0.05)
    release, finished = threading.Event(), threading.Event()

    def slow() -> Any:
        release.wait(30)
        finished.set()
        return SizedGrammar("slow", 10), CompileReport(backend="test")

    try:
        with pytest.raises(CompileTimeoutError):
            cache.get(key("slow"), slow)
        release.set()
        assert finished.wait(10)
        for _ in range(1000):  # _finish runs right after `slow` returns, on the same thread
            if cache.stats.entries:
                break
            threading.Event().wait(0.01)
        grammar, report = cache.get(key("slow"), compiler("never"))
        assert grammar.name == "slow" and report.cache_hit
    finally:
        release.set()
        cache.close()


def test_abandoned_compiles_never_block_new_ones() -> None:
    cache = CompileCache(workers=2, timeout_s=0.05)
    release = threading.Event()

    def stuck() -> Any:
        release.wait(30)
        return SizedGrammar("s", 1), CompileReport(backend="test")

    try:
        for n in range(10):  # more abandoned compiles than workers
            with pytest.raises(CompileTimeoutError):
                cache.get(key(f"s{n}"), stuck)
        assert cache.stats.abandoned_running == 10
        calls: list[str] = []
        grammar, _ = cache.get(key("fresh"), compiler("fresh", calls=calls))
        assert grammar.name == "fresh" and calls == ["fresh"]
        release.set()
        for _ in range(1000):  # each abandoned thread leaves when its call returns
            if cache.stats.abandoned_running == 0:
                break
            threading.Event().wait(0.01)
        assert cache.stats.abandoned_running == 0
    finally:
        release.set()
        cache.close()


def test_queue_wait_counts_against_the_waiting_compile_only() -> None:
    cache = CompileCache(workers=1, timeout_s=30)
    release, started = threading.Event(), threading.Event()

    def blocker() -> Any:
        started.set()
        release.wait(30)
        return SizedGrammar("block", 1), CompileReport(backend="test", compile_seconds=9.0)

    try:
        running = cache.submit(key("block"), blocker)
        assert started.wait(10)
        # queued behind the only worker: its own, shorter limit passes while it waits
        with pytest.raises(CompileTimeoutError):
            cache.get(key("queued"), compiler("queued"), timeout_s=0.05)
        assert cache.stats.negative_hits == 0
        release.set()
        grammar, report = running.result(timeout=10)
        assert grammar.name == "block" and report.queue_seconds >= 0.0
        assert report.compile_seconds < 9.0  # the cache's own measure bounds the reported run
        # it never ran, so it is not remembered as too slow: the next ask compiles it
        grammar, report = cache.get(key("queued"), compiler("queued"))
        assert grammar.name == "queued" and not report.cache_hit
    finally:
        release.set()
        cache.close()


def test_cancelling_a_queued_compile_skips_it() -> None:
    cache = CompileCache(workers=1, timeout_s=30)
    release, started = threading.Event(), threading.Event()
    calls: list[str] = []

    def blocker() -> Any:
        started.set()
        release.wait(30)
        return SizedGrammar("block", 1), CompileReport(backend="test")

    try:
        running = cache.submit(key("block"), blocker)
        assert started.wait(10)
        queued = cache.submit(key("queued"), compiler("queued", calls=calls))
        assert queued.cancel()
        with pytest.raises(CancelledError):
            queued.result()
        release.set()
        running.result(timeout=10)
        assert cache.get(key("after"), compiler("after", calls=calls))[0].name == "after"
        assert calls == ["after"]  # the cancelled compile never ran
        assert cache.stats.cancellations == 1
    finally:
        release.set()
        cache.close()


def test_cancelling_a_running_compile_frees_the_worker() -> None:
    cache = CompileCache(workers=1, timeout_s=30)
    release, started = threading.Event(), threading.Event()

    def blocker() -> Any:
        started.set()
        release.wait(30)
        return SizedGrammar("block", 1), CompileReport(backend="test")

    try:
        running = cache.submit(key("block"), blocker)
        assert started.wait(10)
        assert running.cancel()
        assert cache.get(key("next"), compiler("next"))[0].name == "next"
    finally:
        release.set()
        cache.close()


def test_concurrent_requests_for_one_key_compile_once(cache: CompileCache) -> None:
    release = threading.Event()
    calls: list[int] = []

    def slow() -> Any:
        calls.append(1)
        release.wait(30)
        return SizedGrammar("shared", 10), CompileReport(backend="test")

    futures = [cache.submit(key("shared"), slow) for _ in range(8)]
    results: list[Any] = []
    threads = [threading.Thread(target=lambda f=f: results.append(f.result())) for f in futures]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join(10)
    assert len(results) == 8 and len({id(r[0]) for r in results}) == 1
    assert calls == [1] and cache.stats.joined_in_flight == 7


def test_one_waiter_cancelling_does_not_cancel_the_others(cache: CompileCache) -> None:
    release = threading.Event()

    def slow() -> Any:
        release.wait(30)
        return SizedGrammar("x", 10), CompileReport(backend="test")

    first = cache.submit(key("x"), slow)
    second = cache.submit(key("x"), slow)
    assert first.cancel()
    release.set()
    assert second.result(timeout=10)[0].name == "x"


def test_many_threads_many_keys_stay_consistent() -> None:
    cache = CompileCache(max_bytes=2000, workers=2, timeout_s=30)
    errors: list[BaseException] = []

    def client(seed: int) -> None:
        try:
            for i in range(50):
                name = f"k{(seed * 7 + i) % 13}"
                grammar, _ = cache.get(key(name), compiler(name, 300))
                assert grammar.name == name
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    cache.close()
    assert not errors
    assert cache.stats.bytes <= 2000
    assert cache.stats.hits + cache.stats.misses + cache.stats.joined_in_flight == 300
