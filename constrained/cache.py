"""Compile cache: LRU bounded in bytes, async compile with a time limit, a negative cache.

Keys are :class:`CacheKey` tuples ``(spec.cache_key, backend, tokenizer.fingerprint, options)``.
Compiles run on a small pool of worker threads (:class:`_Pool`); callers get a
``concurrent.futures.Future`` resolving to ``(CompiledGrammar, CompileReport)``.

Time limit and cancellation — what can and cannot be done:
- A compile still waiting in the queue is dropped when every caller has cancelled it.
- A running compile is native code (xgrammar, llguidance, outlines-core) that cannot be
  interrupted from Python. On timeout or cancellation the caller's future completes at once
  (``CompileTimeoutError`` / cancelled) and the worker thread running it is *abandoned*: a new
  worker replaces it so the pool never stalls, and the abandoned thread exits when the native
  call returns. At most ``max_abandoned`` such threads may be alive; past that, new compiles fail
  fast with ``CompileTimeoutError`` instead of growing threads without bound.
- A timed-out grammar goes into the negative cache (it would time out again), unless its
  abandoned compile later finishes: then the result replaces the negative entry.
Failures with a :class:`GrammarError` are cached negatively: the same request fails again at
once with the same exception. Other exceptions (bugs) are not cached.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from espalier.constrained.base import CompiledGrammar, CompileReport
from espalier.constrained.errors import CompileTimeoutError, GrammarError

CompileResult = tuple[CompiledGrammar, CompileReport]
CompileFn = Callable[[], CompileResult]

_RUNNING = threading.local()


def compile_deadline() -> tuple[float, float] | None:
    """``(deadline, limit_s)`` of the compile running on this thread for a :class:`CompileCache`
    (``deadline`` on ``time.monotonic``'s clock; past it the cache has answered its callers with
    :class:`CompileTimeoutError` and abandoned this thread); None outside a cache's compile.

    A compile that can stop early (a child process it can kill) reads it to stop at the deadline
    instead of running on abandoned."""
    running: tuple[float, float] | None = getattr(_RUNNING, "deadline", None)
    return running


@dataclass(frozen=True)
class CacheKey:
    spec: tuple[str, str]
    backend: str
    tokenizer: str
    options: tuple[Any, ...] = ()


@dataclass
class CacheStats:
    """Counters for metrics (monotonic except ``bytes`` / ``entries``)."""

    hits: int = 0
    misses: int = 0
    negative_hits: int = 0
    joined_in_flight: int = 0
    evictions: int = 0
    compiles: int = 0
    failures: int = 0
    timeouts: int = 0
    cancellations: int = 0
    compile_seconds_total: float = 0.0
    bytes: int = 0
    entries: int = 0


@dataclass
class _Job:
    key: CacheKey
    fn: CompileFn
    timeout_s: float
    waiters: list[Future[CompileResult]] = field(default_factory=list)
    started: bool = False
    done: bool = False
    worker: _Worker | None = None


class CompileCache:
    """Byte-bounded LRU of compiled grammars with async, time-limited compiles."""

    def __init__(
        self,
        *,
        max_bytes: int = 1 << 30,
        workers: int = 2,
        timeout_s: float = 10.0,
        max_negative: int = 10_000,
        max_abandoned: int = 8,
    ) -> None:
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.max_negative = max_negative
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._entries: OrderedDict[CacheKey, CompileResult] = OrderedDict()
        self._sizes: dict[CacheKey, int] = {}
        self._negative: OrderedDict[CacheKey, BaseException] = OrderedDict()
        self._jobs: dict[CacheKey, _Job] = {}
        self._pool = _Pool(self, workers, max_abandoned)

    # -- public ---------------------------------------------------------------------------------

    def submit(
        self, key: CacheKey, compile_fn: CompileFn, *, timeout_s: float | None = None
    ) -> Future[CompileResult]:
        """A future of the compiled grammar for ``key``; ``compile_fn`` runs only on a miss."""
        caller: Future[CompileResult] = Future()
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                caller.set_result((hit[0], _as_hit(hit[1])))
                return caller
            failed = self._negative.get(key)
            if failed is not None:
                self.stats.negative_hits += 1
                caller.set_exception(failed)
                return caller
            job = self._jobs.get(key)
            if job is not None:
                self.stats.joined_in_flight += 1
            else:
                self.stats.misses += 1
                limit = self.timeout_s if timeout_s is None else timeout_s
                job = _Job(key, compile_fn, limit)
                if not self._pool.put(job):  # fail fast rather than grow threads without bound
                    self.stats.timeouts += 1
                    caller.set_exception(CompileTimeoutError(limit))
                    return caller
                self._jobs[key] = job
            job.waiters.append(caller)
        caller.add_done_callback(lambda f: self._on_caller_done(job, f))
        return caller

    def get(
        self, key: CacheKey, compile_fn: CompileFn, *, timeout_s: float | None = None
    ) -> CompileResult:
        """Blocking :meth:`submit`; raises the compile's error or CompileTimeoutError."""
        return self.submit(key, compile_fn, timeout_s=timeout_s).result()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._sizes.clear()
            self._negative.clear()
            self.stats.bytes = self.stats.entries = 0

    def close(self) -> None:
        """Stop the workers (running native compiles finish in the background)."""
        self._pool.close()

    # -- completion -----------------------------------------------------------------------------

    def _finish(
        self, job: _Job, result: CompileResult | None, error: BaseException | None, seconds: float
    ) -> None:
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds_total += seconds
            timed_out = job.done  # the watchdog already answered the callers
            job.done = True
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            if result is not None:
                self._negative.pop(job.key, None)
                self._store(job.key, result)
            elif isinstance(error, GrammarError) and not timed_out:
                self.stats.failures += 1
                self._remember_failure(job.key, error)
            waiters, job.waiters = job.waiters, []
        for waiter in waiters:
            _settle(waiter, result, error)

    def _expire(self, job: _Job) -> None:
        """Watchdog: the running compile passed its time limit."""
        with self._lock:
            if job.done:
                return
            job.done = True
            self.stats.timeouts += 1
            error = CompileTimeoutError(job.timeout_s)
            self._remember_failure(job.key, error)
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            waiters, job.waiters = job.waiters, []
        self._pool.abandon(job)
        for waiter in waiters:
            _settle(waiter, None, error)

    def _on_caller_done(self, job: _Job, caller: Future[CompileResult]) -> None:
        if not caller.cancelled():
            return
        with self._lock:
            self.stats.cancellations += 1
            if caller in job.waiters:
                job.waiters.remove(caller)
            orphaned = not job.waiters and not job.done
            if orphaned:
                job.done = True
                if self._jobs.get(job.key) is job:
                    del self._jobs[job.key]
        if orphaned and job.started:
            self._pool.abandon(job)

    def _store(self, key: CacheKey, result: CompileResult) -> None:
        size = max(int(result[0].memory_bytes), 1)
        if size > self.max_bytes:
            return
        if key in self._entries:
            self.stats.bytes -= self._sizes[key]
        self._entries[key] = result
        self._sizes[key] = size
        self.stats.bytes += size
        while self.stats.bytes > self.max_bytes:
            old, _ = self._entries.popitem(last=False)
            self.stats.bytes -= self._sizes.pop(old)
            self.stats.evictions += 1
        self.stats.entries = len(self._entries)

    def _remember_failure(self, key: CacheKey, error: BaseException) -> None:
        self._negative[key] = error
        while len(self._negative) > self.max_negative:
            self._negative.popitem(last=False)


def _as_hit(report: CompileReport) -> CompileReport:
    from dataclasses import replace

    return replace(report, cache_hit=True)


def _settle(
    waiter: Future[CompileResult], result: CompileResult | None, error: BaseException | None
) -> None:
    try:
        if result is not None:
            waiter.set_result(result)
        else:
            waiter.set_exception(error if error is not None else RuntimeError("compile failed"))
    except InvalidStateError:  # the caller cancelled meanwhile
        pass


class _Worker(threading.Thread):
    def __init__(self, pool: _Pool) -> None:
        super().__init__(name="espalier-compile", daemon=True)
        self.pool = pool
        self.abandoned = False

    def run(self) -> None:
        while not self.abandoned:
            job = self.pool.jobs.get()
            if job is None:
                return
            self.pool.run_job(self, job)


class _Pool:
    """Worker threads plus one watchdog thread enforcing each running job's deadline."""

    def __init__(self, cache: CompileCache, workers: int, max_abandoned: int) -> None:
        self.cache = cache
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.max_abandoned = max_abandoned
        self._lock = threading.Lock()
        self._abandoned_alive = 0
        self._deadlines: list[tuple[float, int, _Job]] = []
        self._counter = itertools.count()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._workers = [_Worker(self) for _ in range(max(1, workers))]
        for worker in self._workers:
            worker.start()
        self._watchdog = threading.Thread(
            target=self._watch, name="espalier-compile-watchdog", daemon=True
        )
        self._watchdog.start()

    def put(self, job: _Job) -> bool:
        """Queue a job; False when too many abandoned native compiles are still running."""
        with self._lock:
            if self._abandoned_alive >= self.max_abandoned:
                return False
        self.jobs.put(job)
        return True

    def run_job(self, worker: _Worker, job: _Job) -> None:
        with self.cache._lock:
            if job.done:  # every caller cancelled while it was queued
                return
            job.started = True
            job.worker = worker
        deadline = time.monotonic() + job.timeout_s
        with self._lock:
            heapq.heappush(self._deadlines, (deadline, next(self._counter), job))
            self._wake.notify()
        start = time.perf_counter()
        result: CompileResult | None = None
        error: BaseException | None = None
        _RUNNING.deadline = (deadline, job.timeout_s)
        try:
            result = job.fn()
        except BaseException as exc:  # delivered to the callers, never raised in the worker
            error = exc
        finally:
            _RUNNING.deadline = None
        self.cache._finish(job, result, error, time.perf_counter() - start)
        if worker.abandoned:
            with self._lock:
                self._abandoned_alive -= 1

    def abandon(self, job: _Job) -> None:
        """Give up on a running job: replace its worker so the pool keeps its size."""
        worker = job.worker
        if worker is None or worker.abandoned:
            return
        with self._lock:
            if self._closed:
                return
            worker.abandoned = True
            self._abandoned_alive += 1
            replacement = _Worker(self)
            self._workers = [w for w in self._workers if w is not worker] + [replacement]
        replacement.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()
        for _ in self._workers:
            self.jobs.put(None)

    def _watch(self) -> None:
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                while self._deadlines and (
                    self._deadlines[0][2].done or self._deadlines[0][0] <= now
                ):
                    _, _, job = heapq.heappop(self._deadlines)
                    if not job.done:
                        self._lock.release()
                        try:
                            self.cache._expire(job)
                        finally:
                            self._lock.acquire()
                wait = self._deadlines[0][0] - now if self._deadlines else None
                self._wake.wait(timeout=wait)
