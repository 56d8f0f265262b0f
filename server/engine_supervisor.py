"""The served engine, replaced when its process dies or hangs.

A death (a native library's abort, the OOM killer, a dead tensor-parallel rank), or a silence
past ``stall_timeout_s`` (the engine loop sends its stats every second: a hang in native code,
a stopped process; the process is then killed, and says why), ends the open
streams with ``UNAVAILABLE`` (reason ``ENGINE_UNAVAILABLE``, or the rank's ``INTERNAL``), turns
health ``NOT_SERVING``, and a new engine process loads and warms up; then health is ``SERVING``
again and requests run as before (the grammar caches start empty). Why: one request that takes
the engine down must not end the service for every request after it. More than
``max_restarts`` deaths within :data:`RESTART_WINDOW_S` (a crash loop), or a restart that fails,
fail the server as a death did before: drain, exit 1, for the supervisor above (systemd,
Kubernetes, ``scripts/gateway.sh``) to see.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from espalier.server.engine_process import EngineUnavailableError
from espalier.server.state import announce

if TYPE_CHECKING:
    from espalier.constrained.base import CompileReport
    from espalier.constrained.cache import CacheStats
    from espalier.constrained.spec import GrammarSpec
    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.engine.api import ConstraintOptions, GenerationRequest, RequestOutput
    from espalier.engine.constraints import GrammarService
    from espalier.server.engine_port import ServingEngine
    from espalier.server.engine_process import (
        EngineProcess,
        EngineProcessConfig,
        SpawnedEngine,
    )
    from espalier.server.loading import ModelOptions
    from espalier.server.state import ModelFacts, ServingState

RESTART_WINDOW_S = 600.0
"""Deaths older than this do not count against ``max_restarts``."""


async def warm_up(engine: ServingEngine) -> None:
    """One short generation through the whole path before health turns SERVING."""
    from espalier.engine.api import GenerationRequest, SamplingParams

    request = GenerationRequest(
        request_id=f"warmup-{uuid.uuid4().hex}",
        prompt="Hello",
        sampling=SamplingParams(max_tokens=2, ignore_eos=True),
    )
    async for _ in engine.generate(request):
        pass


class EngineSupervisor:
    """A :class:`~espalier.server.engine_port.ServingEngine` over the current
    :class:`~espalier.server.engine_process.EngineProcess`; made and driven in the serving event
    loop. While a replacement loads, generations and compiles raise
    :class:`EngineUnavailableError` (retryable ``UNAVAILABLE``), never wait for it."""

    def __init__(
        self,
        options: ModelOptions,
        state: ServingState,
        grammar: GrammarService,
        config: EngineProcessConfig,
        max_restarts: int,
        on_engine: Callable[[EngineProcess], None] = lambda _engine: None,
        stall_timeout_s: float = 0.0,
    ) -> None:
        self._options = options
        self._state = state
        self._grammar = grammar  # the server's own: CompileGrammar while loading, replays
        self._config = config
        self._max_restarts = max_restarts
        self._on_engine = on_engine  # told of each engine made (pids, announcements)
        self._stall_s = stall_timeout_s  # 0: never read a silence as a hang
        self._watchdog: asyncio.Task[None] | None = None
        self._current: EngineProcess | None = None
        self._generation = 0  # which engine's failure callbacks still count
        self._deaths: deque[float] = deque()  # monotonic times of restarts in the window
        self._restarting: asyncio.Task[None] | None = None
        self._why = ""
        self._closing = False
        self.restarts = 0

    async def start(
        self, spawned: SpawnedEngine, tokenizer: TokenizerInfo
    ) -> tuple[ModelFacts, TokenizerInfo]:
        """Wait for the first engine (spawned while the server loaded its tokenizer)."""
        engine, facts, tokenizer = await self._started(spawned, tokenizer)
        self.tokenizer = tokenizer
        self._current = engine
        if self._stall_s > 0:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        return facts, tokenizer

    # -- ServingEngine ------------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """The current engine's stream (see ``EngineProcess.generate``); raises
        :class:`EngineUnavailableError` while a replacement loads."""
        return self._live().generate(request)

    def abort(self, request_id: str) -> None:
        if self._current is not None:
            self._current.abort(request_id)

    def compile(
        self, spec: GrammarSpec, options: ConstraintOptions, left: threading.Event
    ) -> CompileReport:
        """CompileGrammar in the current engine's cache (blocking; ``EngineProcess.compile``)."""
        return self._live().compile(spec, options, left)

    def stats(self) -> dict[str, Any]:
        return self._current.stats() if self._current is not None else {}

    def grammar_cache_stats(self, other: CacheStats) -> CacheStats:
        current = self._current
        return current.grammar_cache_stats(other) if current is not None else other

    async def shutdown(self, drain: bool = True) -> None:
        """Stop the current engine (a replacement being loaded is stopped too)."""
        self._closing = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._restarting is not None and not self._restarting.done():
            self._restarting.cancel()
            with contextlib.suppress(BaseException):
                await self._restarting
        if self._current is not None:
            await self._current.shutdown(drain)  # it closes the grammar service
        else:
            await asyncio.to_thread(self._grammar.close)

    # -- restarts -----------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Kill the current engine once it has sent nothing for ``stall_timeout_s``."""
        while True:
            await asyncio.sleep(min(5.0, self._stall_s / 4))
            current = self._current
            if current is None or not current.is_running:
                continue
            silent = time.monotonic() - current.last_heard
            if silent > self._stall_s:
                why = (
                    f"the engine process sent nothing for {silent:.0f} s (hung; "
                    f"--engine-stall-timeout {self._stall_s:g})"
                )
                announce(event="engine_stalled", pid=current.process.pid, silent_s=round(silent))
                await asyncio.to_thread(current.kill, why)

    def _live(self) -> EngineProcess:
        current = self._current
        if current is None:
            raise EngineUnavailableError(f"the engine process is restarting ({self._why})")
        return current

    async def _started(
        self, spawned: SpawnedEngine, tokenizer: TokenizerInfo
    ) -> tuple[EngineProcess, ModelFacts, TokenizerInfo]:
        from espalier.server.engine_process import start_engine_process

        self._generation += 1
        generation = self._generation

        def on_failure(why: str) -> None:  # in the event loop (EngineProcess._end)
            self._failed(generation, why)

        engine, facts, tokenizer = await start_engine_process(
            spawned, tokenizer, self._config, on_failure
        )
        engine.compile_service = self._grammar
        self._on_engine(engine)
        return engine, facts, tokenizer

    def _failed(self, generation: int, why: str) -> None:
        dead = self._current
        if generation != self._generation or dead is None or self._closing:
            return  # a replacement's death before it served: its restart reports it
        now = time.monotonic()
        while self._deaths and now - self._deaths[0] > RESTART_WINDOW_S:
            self._deaths.popleft()
        if len(self._deaths) >= self._max_restarts:
            # the dead engine stays current: the server's shutdown stops and reaps it
            limit = f"--engine-restarts {self._max_restarts}"
            why += (
                f"; not replaced: {len(self._deaths)} replaced within ten minutes already ({limit})"
                if self._max_restarts
                else f"; not replaced ({limit})"
            )
            asyncio.get_running_loop().create_task(self._state.fail(why))
            return
        self._current = None
        self._why = why
        self._deaths.append(now)
        self._restarting = asyncio.get_running_loop().create_task(self._restart(dead, why))

    async def _restart(self, dead: EngineProcess, why: str) -> None:
        from espalier.server.engine_process import spawn_engine_process

        announce(event="engine_failed", error=why, restarting=True)
        await self._state.set_serving(False)
        await asyncio.to_thread(_reap, dead)
        spawned = spawn_engine_process(self._options)
        try:
            engine, _facts, _tokenizer = await self._started(spawned, self.tokenizer)
            await warm_up(engine)
        except asyncio.CancelledError:
            spawned.kill()
            raise
        except Exception as exc:
            spawned.kill()
            await self._state.fail(f"{why}; its replacement failed: {type(exc).__name__}: {exc}")
            return
        if self._closing:
            await engine.shutdown(drain=False)
            return
        self._current = engine
        self.restarts += 1
        self._state.metrics.engine_restarts.inc()
        announce(event="engine_restarted", pid=engine.process.pid, restarts=self.restarts)
        await self._state.set_serving(True)


def _reap(engine: EngineProcess) -> None:
    """The dead engine's process and tensor-parallel ranks are gone (their memory, GPU memory
    included, is free) before a replacement loads."""
    process = engine.process
    if process.is_alive():
        process.kill()
    process.join(30.0)
    for pid in engine.rank_pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
