"""Compile cache: LRU bounded in bytes, async compile with a time limit, a negative cache.

Keys are :class:`CacheKey` tuples ``(spec.cache_key, backend, tokenizer.fingerprint, options)``.
Compiles run on a small pool of worker threads (:class:`_Pool`); callers get a
``concurrent.futures.Future`` resolving to ``(CompiledGrammar, CompileReport)``.

Time limit and cancellation:
- A compile's limit runs from its submission: time waiting in the queue, or for a place to run
  in (``constrained/compile_pool.py``), counts against its own limit only. Its report tells the
  wait (``CompileReport.queue_seconds``) from the run (``compile_seconds``).
- A compile still waiting in the queue is dropped when every caller has cancelled it or its
  deadline passed.
- Compiles that may run long run in child processes that the backend kills at the deadline
  (:func:`compile_deadline`), so their worker returns at once. Whatever still runs in-process
  (Python preparation, llguidance's bounded compiles) is *abandoned* at the deadline or on
  cancellation: the caller's future completes at once (``CompileTimeoutError`` / cancelled), a
  new worker replaces the thread so the pool never stalls, and the abandoned thread exits when
  its call returns. Abandoned work never blocks new compiles; each backend bounds its own
  in-process compiles, which bounds the abandoned threads.
- A timed-out grammar goes into the negative cache (it would time out again) when it ran for at
  least half its limit (a compile that mostly waited is not blamed), for
  :data:`TIMEOUT_MEMORY_S` (a compile slowed by a loaded machine gets another try later), unless
  its abandoned compile later finishes: then the result replaces the negative entry.
Failures with a :class:`GrammarError` are cached negatively: the same request fails again at
once with the same exception. Other exceptions (bugs) are not cached.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field, replace
from typing import Any

from espalier.constrained.base import CompiledGrammar, CompileReport
from espalier.constrained.errors import CompileTimeoutError, GrammarError

CompileResult = tuple[CompiledGrammar, CompileReport]
CompileFn = Callable[[], CompileResult]

_RUNNING = threading.local()
TIMEOUT_MEMORY_S = 120.0
"""How long a compile timeout is remembered (the same grammar fails at once meanwhile)."""


@dataclass
class _Clock:
    """The deadline of one compile and the seconds it spent waiting for a place to run."""

    deadline: float  # time.monotonic()
    limit_s: float
    waited_s: float = 0.0
    waiting_since: float | None = None  # time.monotonic() of a wait in progress
    abandoned: bool = False  # every caller cancelled: nobody waits for the result any more

    def waited(self, now: float) -> float:
        """Seconds waited so far, a wait in progress included."""
        since = self.waiting_since
        return self.waited_s + (now - since if since is not None else 0.0)


def compile_deadline() -> tuple[float, float] | None:
    """``(deadline, limit_s)`` of the compile running on this thread for a :class:`CompileCache`
    (``deadline`` on ``time.monotonic``'s clock; past it the cache has answered its callers with
    :class:`CompileTimeoutError` and abandoned this thread); None outside a cache's compile.

    A compile that can stop early (a child process it can kill) reads it to stop at the deadline
    instead of running on abandoned."""
    clock: _Clock | None = getattr(_RUNNING, "clock", None)
    return None if clock is None else (clock.deadline, clock.limit_s)


def abandoned_check() -> Callable[[], bool]:
    """Whether every caller of the compile running on this thread has cancelled (read it
    again as the compile goes on; always False outside a cache's compile). A compile that can
    stop early (a child process it can kill, a wait for a slot) stops then: an abandoned compile
    must not hold a backend's place until its deadline while others wait for it."""
    clock: _Clock | None = getattr(_RUNNING, "clock", None)
    if clock is None:
        return lambda: False
    return lambda: clock.abandoned


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Count the time inside as the running compile's waiting, not running (a pool waits for a
    child process or a slot in it); a no-op outside a cache's compile."""
    clock: _Clock | None = getattr(_RUNNING, "clock", None)
    if clock is None:
        yield
        return
    since = clock.waiting_since = time.monotonic()
    try:
        yield
    finally:
        clock.waited_s += time.monotonic() - since
        clock.waiting_since = None


@dataclass(frozen=True)
class CacheKey:
    spec: tuple[str, str]
    backend: str
    tokenizer: str
    options: tuple[Any, ...] = ()


@dataclass
class CacheStats:
    """Counters for metrics (monotonic except ``bytes``, ``entries`` and the ``*running`` gauges).

    ``compile_seconds_total`` counts compiles' run time, ``queue_seconds_total`` their waits (in
    the queue and for a place to run); ``running``: compiles running now (abandoned ones
    included), of which ``abandoned_running`` were abandoned."""

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
    queue_seconds_total: float = 0.0
    abandoned_running: int = 0
    running: int = 0
    bytes: int = 0
    entries: int = 0


@dataclass
class _Job:
    key: CacheKey
    fn: CompileFn
    timeout_s: float
    clock: _Clock
    submitted: float  # time.monotonic()
    waiters: list[Future[CompileResult]] = field(default_factory=list)
    started_at: float | None = None
    returned: bool = False  # its compile function returned
    done: bool = False
    worker: _Worker | None = None


class CompileCache:
    """Byte-bounded LRU of compiled grammars with async, time-limited compiles.

    ``workers``: most compile threads (started on demand). A compile thread mostly waits (for a
    backend's child process or slot, each bounded per backend), so there are many: a slow
    backend's queue must not hold up the compiles of another. ``on_evict(result)``: called
    (on the compile's thread, outside the lock) for each grammar the bound evicts, so what the
    caller keeps per grammar (spare matchers) can leave with it.
    """

    def __init__(
        self,
        *,
        max_bytes: int = 1 << 30,
        workers: int = 32,
        timeout_s: float = 10.0,
        timeout_memory_s: float = TIMEOUT_MEMORY_S,
        on_evict: Callable[[CompileResult], None] | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self._on_evict = on_evict
        self.timeout_s = timeout_s
        self.timeout_memory_s = timeout_memory_s
        self.max_negative = 10_000  # failures remembered (an LRU)
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._entries: OrderedDict[CacheKey, CompileResult] = OrderedDict()
        self._sizes: dict[CacheKey, int] = {}
        # the failure and until when it is remembered (monotonic; inf: a GrammarError's, for good)
        self._negative: OrderedDict[CacheKey, tuple[BaseException, float]] = OrderedDict()
        self._jobs: dict[CacheKey, _Job] = {}
        self._pool = _Pool(self, workers)

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
            if failed is not None and failed[1] <= time.monotonic():
                del self._negative[key]  # a timeout remembered long enough: try again
                failed = None
            if failed is not None:
                self.stats.negative_hits += 1
                caller.set_exception(failed[0])
                return caller
            job = self._jobs.get(key)
            if job is not None:
                self.stats.joined_in_flight += 1
            else:
                self.stats.misses += 1
                limit = self.timeout_s if timeout_s is None else timeout_s
                now = time.monotonic()
                job = _Job(key, compile_fn, limit, _Clock(now + limit, limit), now)
                self._jobs[key] = job
                self._pool.put(job)
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
        queued = (job.started_at or job.submitted) - job.submitted + job.clock.waited_s
        if result is not None:
            result = (result[0], _with_times(result[1], queued, seconds - job.clock.waited_s))
        evicted: list[CompileResult] = []
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds_total += max(seconds - job.clock.waited_s, 0.0)
            self.stats.queue_seconds_total += queued
            timed_out = job.done  # the watchdog already answered the callers
            job.done = True
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            if result is not None:
                self._negative.pop(job.key, None)
                evicted = self._store(job.key, result)
            elif isinstance(error, CompileTimeoutError) and not timed_out:
                self.stats.timeouts += 1  # the compile stopped itself at its deadline
                self._remember_timeout(job, error)
            elif isinstance(error, GrammarError) and not timed_out:
                self.stats.failures += 1
                self._remember_failure(job.key, error)
            waiters, job.waiters = job.waiters, []
        for waiter in waiters:
            _settle(waiter, result, error)
        if self._on_evict is not None:
            for gone in evicted:
                self._on_evict(gone)

    def _expire(self, job: _Job) -> None:
        """Watchdog: the compile (queued or running) passed its deadline."""
        with self._lock:
            if job.done:
                return
            job.done = True
            self.stats.timeouts += 1
            error = CompileTimeoutError(job.timeout_s)
            self._remember_timeout(job, error)
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
                job.clock.abandoned = True
                if self._jobs.get(job.key) is job:
                    del self._jobs[job.key]
        if orphaned and job.started_at is not None:
            self._pool.abandon(job)

    def _store(self, key: CacheKey, result: CompileResult) -> list[CompileResult]:
        """Keep ``result`` (under the lock); returns what the bound evicted for it."""
        size = max(int(result[0].memory_bytes), 1)
        if size > self.max_bytes:
            return []
        if key in self._entries:
            self.stats.bytes -= self._sizes[key]
        self._entries[key] = result
        self._sizes[key] = size
        self.stats.bytes += size
        evicted = []
        while self.stats.bytes > self.max_bytes:
            old, gone = self._entries.popitem(last=False)
            self.stats.bytes -= self._sizes.pop(old)
            self.stats.evictions += 1
            evicted.append(gone)
        self.stats.entries = len(self._entries)
        return evicted

    def _remember_timeout(self, job: _Job, error: CompileTimeoutError) -> None:
        """Cache a timeout negatively when the compile ran for at least half its limit: it had
        its time and would time out again (one that mostly waited is not blamed)."""
        if job.started_at is not None:
            now = time.monotonic()
            ran = now - job.started_at - job.clock.waited(now)
            if ran >= job.timeout_s / 2:
                self._remember_failure(job.key, error, now + self.timeout_memory_s)

    def _remember_failure(
        self, key: CacheKey, error: BaseException, until: float = float("inf")
    ) -> None:
        self._negative[key] = (error, until)
        self._negative.move_to_end(key)
        while len(self._negative) > self.max_negative:
            self._negative.popitem(last=False)


def _as_hit(report: CompileReport) -> CompileReport:
    return replace(report, cache_hit=True, queue_seconds=0.0)


def _with_times(report: CompileReport, queued: float, ran: float) -> CompileReport:
    """``report`` with the cache's view of the wait; the run time the compile measured itself
    (one backend's) unless the cache's (every backend tried) is lower."""
    return replace(
        report, queue_seconds=queued, compile_seconds=max(min(report.compile_seconds, ran), 0.0)
    )


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
            job = self.pool.next_job()
            if job is None:
                return
            self.pool.run_job(self, job)
            if not self.abandoned:
                self.pool.job_done()


class _Pool:
    """Worker threads plus one watchdog thread enforcing each job's deadline from submission."""

    def __init__(self, cache: CompileCache, workers: int) -> None:
        self.cache = cache
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._deadlines: list[tuple[float, int, _Job]] = []
        self._counter = itertools.count()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._max_workers = max(1, workers)
        self._workers: list[_Worker] = []
        self._idle = 0  # workers waiting for a job
        self._pending = 0  # jobs queued, not yet taken by a worker
        self._watchdog = threading.Thread(
            target=self._watch, name="espalier-compile-watchdog", daemon=True
        )
        self._watchdog.start()

    def put(self, job: _Job) -> None:
        """Queue a job; its deadline is watched from now."""
        with self._lock:
            heapq.heappush(self._deadlines, (job.clock.deadline, next(self._counter), job))
            self._wake.notify()
            self._pending += 1
            worker = None
            full = len(self._workers) >= self._max_workers
            if self._pending > self._idle and not full and not self._closed:
                worker = _Worker(self)
                self._workers.append(worker)
                self._idle += 1  # counted idle until it takes its first job
        if worker is not None:
            worker.start()
        self.jobs.put(job)

    def next_job(self) -> _Job | None:
        """A worker's next job (None: stop); the worker counts as idle while it waits."""
        job = self.jobs.get()
        with self._lock:
            self._idle -= 1
            self._pending -= job is not None
        return job

    def job_done(self) -> None:
        with self._lock:
            self._idle += 1

    def run_job(self, worker: _Worker, job: _Job) -> None:
        with self.cache._lock:
            if job.done:  # every caller cancelled, or its deadline passed, while it was queued
                return
            job.started_at = time.monotonic()
            job.worker = worker
            self.cache.stats.running += 1
        start = time.perf_counter()
        result: CompileResult | None = None
        error: BaseException | None = None
        _RUNNING.clock = job.clock
        try:
            result = job.fn()
        except BaseException as exc:  # delivered to the callers, never raised in the worker
            error = exc
        finally:
            _RUNNING.clock = None
        self.cache._finish(job, result, error, time.perf_counter() - start)
        with self.cache._lock:
            job.returned = True
            self.cache.stats.running -= 1
            if worker.abandoned:
                self.cache.stats.abandoned_running -= 1

    def abandon(self, job: _Job) -> None:
        """Give up on a running job: replace its worker so the pool keeps its size."""
        worker = job.worker
        with self.cache._lock:
            if worker is None or worker.abandoned or job.returned or self._closed:
                return
            worker.abandoned = True
            self.cache.stats.abandoned_running += 1
        replacement = _Worker(self)
        with self._lock:
            self._workers = [w for w in self._workers if w is not worker] + [replacement]
            self._idle += 1
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
