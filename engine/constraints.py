"""The engine's side of the grammar layer: async compiles and per-request matchers.

Compiles go through the grammar layer's compile cache (``constrained/compile.py`` on top of
``constrained/cache.py``) and come back as a ``concurrent.futures.Future`` that the engine polls
each step, so a request whose grammar compiles does not hold up the batch. A request's own
matcher is made on this service's threads too, never on the engine thread: a new matcher can
take milliseconds (llguidance builds each request its own lexer).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import ConstraintOptions

if TYPE_CHECKING:
    import torch

    from espalier.constrained.backends.common import BackendOptions
    from espalier.constrained.base import CompiledGrammar, CompileReport, GrammarMatcher
    from espalier.constrained.cache import CompileCache
    from espalier.constrained.disk_cache import GrammarDiskCache
    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.engine.closing import ClosingPaths

SPARE_GRAMMARS = 16  # grammars whose spares are kept (least recently requested dropped)
SPARE_THREADS = 2  # threads that refill spares, apart from the requests' own matchers

RequestGrammar = tuple["CompiledGrammar", "CompileReport", "GrammarMatcher"]


class _Spares:
    """A grammar's spare matchers: ``ready`` (new, never used), ``making`` (on the way) and
    ``target`` (how many to keep: one more each time a request found none ready)."""

    def __init__(self, compiled: CompiledGrammar) -> None:
        # weak: a grammar requested once is not kept; the ready matchers hold theirs until the
        # compile cache evicts it (GrammarService._evicted)
        self.compiled = weakref.ref(compiled)
        self.ready: list[GrammarMatcher] = []
        self.making = 0
        self.target = 0


class GrammarService:
    """Compiles grammars for one tokenizer (post-validation is ``engine/output.py``'s).

    ``cache``: the compile cache to share (e.g. with the server's CompileGrammar); a private one
    with ``compile_timeout_s`` and ``cache_max_bytes`` when None (its evictions drop the
    grammar's spare matchers). ``disk_cache``: compiled xgrammar grammars kept across
    restarts (``constrained/disk_cache.py``), consulted on an in-memory miss. ``backend_options``:
    the options every backend compiles with (compile slots, whitespace, number bounds); the
    backends' defaults when None. ``matcher_threads``: threads that make requests' matchers
    (``min(8, cpu count)`` when None): a burst of requests waits for its matchers (an
    llguidance one is a clone of its grammar's template with its start row computed, the GIL
    released), so they are made in parallel. Spares: for a grammar requested
    more than once (of the :data:`SPARE_GRAMMARS` requested last), new matchers are kept ready,
    refilled on threads of their own as requests take them, so a repeated schema's request
    starts without waiting for its matcher. Each is made fresh from the compiled grammar, never
    shared, exactly as one made on request. How many a grammar keeps follows its bursts: one
    more each time one of its requests finds none ready, up to ``spares_per_grammar`` (0: no
    spares).
    Every matcher leaves the service with its start state's mask computed (the first mask a
    request computes anyway: its lexer builds that state off the engine's step). Once an engine
    has taken :meth:`closing_paths`, every matcher also leaves with its grammar's start-state
    closing path searched (``ClosingPaths.start_path``: once per grammar, kept there).
    """

    def __init__(
        self,
        tokenizer: TokenizerInfo,
        *,
        compile_timeout_s: float = 30.0,
        cache: CompileCache | None = None,
        disk_cache: GrammarDiskCache | None = None,
        backend_options: BackendOptions | None = None,
        matcher_threads: int | None = None,
        spares_per_grammar: int = 16,
        cache_max_bytes: int = 512 << 20,
    ) -> None:
        from espalier.constrained.cache import CompileCache

        if matcher_threads is not None and matcher_threads < 1:
            raise ValueError(f"matcher_threads must be at least 1, got {matcher_threads}")
        if spares_per_grammar < 0:
            raise ValueError(f"spares_per_grammar must be >= 0, got {spares_per_grammar}")
        self.tokenizer = tokenizer
        self._own_cache = cache is None
        self.cache = cache or CompileCache(
            timeout_s=compile_timeout_s, max_bytes=cache_max_bytes, on_evict=self._evicted
        )
        self.disk_cache = disk_cache
        self.backend_options = backend_options
        self.matcher_threads = matcher_threads or min(8, os.cpu_count() or 2)
        self.spares_per_grammar = spares_per_grammar
        self._matchers: ThreadPoolExecutor | None = None  # made on first use, again after close
        self._spare_makers: ThreadPoolExecutor | None = None  # likewise
        self._matchers_lock = threading.Lock()
        self._spares: OrderedDict[int, _Spares] = OrderedDict()  # by id(compiled), LRU
        self._spares_lock = threading.Lock()
        self._rows = threading.local()  # a scratch bitmask row per matcher thread
        self._closing: ClosingPaths | None = None  # closing_paths(): made on first call

    def closing_paths(self) -> ClosingPaths:
        """The budget-closing searches for this tokenizer, shared by the engines that close
        (``BudgetCloser(paths=)``), made on first call. From then on :meth:`_new_matcher`
        searches each grammar's start path with them, so that search (up to ~100 ms where the
        greedy walk fails: ``engine/closing/backtrack.py``) holds up the first request of its
        grammar, on a matcher thread, never an engine step and every request in it."""
        from espalier.engine.closing import ClosingPaths

        with self._matchers_lock:
            if self._closing is None:
                self._closing = ClosingPaths(self.tokenizer)
            return self._closing

    def submit(self, spec: GrammarSpec, options: ConstraintOptions) -> Future[Any]:
        """Start compiling (or hit the cache); the Future resolves to ``(CompiledGrammar,
        CompileReport)`` or raises a ``GrammarError`` (invalid grammar, schema not enforceable,
        compile timeout...)."""
        from espalier.constrained.cache import CacheKey
        from espalier.constrained.compile import compile_grammar

        key = CacheKey(
            spec.cache_key, options.backend, self.tokenizer.fingerprint, (options.allow_weakening,)
        )

        disk = self.disk_cache

        def compile_fn() -> Any:
            stored = disk.load(key) if disk is not None else None
            if stored is not None:
                return stored
            result = compile_grammar(
                spec,
                self.tokenizer,
                options.backend,
                allow_weakening=options.allow_weakening,
                options=self.backend_options,
            )
            if disk is not None:
                disk.store(key, result)
            return result

        return self.cache.submit(key, compile_fn)

    def submit_request(
        self,
        spec: GrammarSpec,
        options: ConstraintOptions,
        *,
        on_compiled: Callable[[], None] | None = None,
    ) -> Future[Any]:
        """:meth:`submit`, then one new matcher for the request: the Future resolves to a
        :data:`RequestGrammar` ``(CompiledGrammar, CompileReport, GrammarMatcher)`` or raises
        what the compile raised. The matcher is made on this service's matcher threads, off the
        engine thread. Cancelling the Future withdraws the request from the compile: one that
        no request or CompileGrammar call waits for any more stops (its child killed, its place
        in the backend freed: ``CompileCache``).
        ``on_compiled``: called once the compile succeeded, before the matcher is made (on the
        compile's thread, or on this one for a cached grammar): the engine may compute the
        request's prompt meanwhile."""
        compiled_future = self.submit(spec, options)
        out: Future[Any] = Future()

        def make(compiled: CompiledGrammar, report: CompileReport) -> None:
            if not out.set_running_or_notify_cancel():
                return
            try:
                matcher = self._new_matcher(compiled)
                out.set_result((compiled, report, matcher))
            except Exception as exc:  # the request's own failure, reported through its Future
                out.set_exception(exc)

        def compiled_done(done: Future[Any]) -> None:
            try:
                compiled, report = done.result()
            except BaseException as exc:  # compile errors and cancellation alike
                if out.set_running_or_notify_cancel():
                    out.set_exception(exc)
                return
            if on_compiled is not None:
                on_compiled()
            spare, again = self._take_spare(compiled)
            try:
                if spare is None:
                    self._matcher_pool().submit(make, compiled, report)
                elif out.set_running_or_notify_cancel():
                    out.set_result((compiled, report, spare))
                if again:  # on threads of their own: a refill never delays a request's matcher
                    self._matcher_pool(spare=True).submit(self._add_spare, compiled)
            except RuntimeError as exc:  # shut down while submitting: the engine is closing
                if out.set_running_or_notify_cancel():
                    out.set_exception(exc)

        compiled_future.add_done_callback(compiled_done)
        # weak: a strong one would make the two Futures a cycle holding the grammar and the
        # matcher past the request, until a rare full collection (the engine's gc settings)
        compile_ref = weakref.ref(compiled_future)

        def withdraw(done: Future[Any]) -> None:
            compiling = compile_ref()
            if done.cancelled() and compiling is not None:
                compiling.cancel()

        out.add_done_callback(withdraw)
        return out

    def _new_matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A request's new matcher, prepared (``GrammarMatcher.prepare``: its start state's
        mask computed once into a scratch row), and its
        grammar's start-state closing path searched (once per grammar, after
        :meth:`closing_paths`): what its first step makes anyway, made here, off the engine's
        step; nothing else changes."""
        from espalier.constrained import bitmask as bm
        from espalier.constrained.keys import with_unique_keys

        matcher = with_unique_keys(compiled.spec, compiled.matcher(), self.tokenizer)
        row: torch.Tensor | None = getattr(self._rows, "row", None)
        if row is None:
            row = self._rows.row = bm.allocate(1, self.tokenizer.vocab_size, fill=0)
        matcher.prepare(row)
        closing = self._closing
        if closing is not None:
            closing.start_path(compiled, matcher)  # kept for the engine's first decision
        return matcher

    def _take_spare(self, compiled: CompiledGrammar) -> tuple[GrammarMatcher | None, bool]:
        """A spare matcher of ``compiled`` (None: none ready), and whether to make one more
        (counted as being made): a grammar's first request only marks it (a grammar requested
        once costs no spare); each later one that finds none ready raises the grammar's target
        by one (up to ``spares_per_grammar``), and each refills its spares up to the target."""
        if not self.spares_per_grammar:
            return None, False
        with self._spares_lock:
            entry = self._spares.get(id(compiled))
            if entry is None or entry.compiled() is not compiled:
                self._spares[id(compiled)] = _Spares(compiled)
                while len(self._spares) > SPARE_GRAMMARS:
                    self._spares.popitem(last=False)
                return None, False
            self._spares.move_to_end(id(compiled))
            spare = entry.ready.pop() if entry.ready else None
            if spare is None:
                entry.target = min(entry.target + 1, self.spares_per_grammar)
            again = len(entry.ready) + entry.making < entry.target
            entry.making += again
            return spare, again

    def _evicted(self, result: tuple[CompiledGrammar, CompileReport]) -> None:
        """The compile cache dropped a grammar: its spares go too (they would keep it)."""
        with self._spares_lock:
            entry = self._spares.get(id(result[0]))
            if entry is not None and entry.compiled() is result[0]:
                del self._spares[id(result[0])]

    def _add_spare(self, compiled: CompiledGrammar) -> None:
        """Make one spare matcher of ``compiled`` (on a spare thread); dropped when the grammar
        left the spares meanwhile."""
        try:
            matcher: GrammarMatcher | None = self._new_matcher(compiled)
        except Exception:  # the request that takes none makes its own and meets the error
            matcher = None
        with self._spares_lock:
            entry = self._spares.get(id(compiled))
            if entry is not None and entry.compiled() is compiled:
                entry.making = max(0, entry.making - 1)
                if matcher is not None:
                    entry.ready.append(matcher)

    def _matcher_pool(self, spare: bool = False) -> ThreadPoolExecutor:
        with self._matchers_lock:
            if spare:
                if self._spare_makers is None:
                    self._spare_makers = ThreadPoolExecutor(
                        SPARE_THREADS, thread_name_prefix="espalier-spare"
                    )
                return self._spare_makers
            if self._matchers is None:
                self._matchers = ThreadPoolExecutor(
                    self.matcher_threads, thread_name_prefix="espalier-matcher"
                )
            return self._matchers

    def close(self) -> None:
        with self._matchers_lock:
            pool, self._matchers = self._matchers, None
            spares, self._spare_makers = self._spare_makers, None
        if pool is not None:  # a service shared by several engines stays usable after one closes
            pool.shutdown(wait=False)  # queued matchers are still made: their requests wait on them
        if spares is not None:  # queued refills still run: each one's count is given back
            spares.shutdown(wait=False)
        if self._own_cache:
            self.cache.close()
        if self.disk_cache is not None:
            self.disk_cache.flush()  # grammars compiled so far reach the disk before exit
