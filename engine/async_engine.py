"""asyncio front of the engine for the server: a background step thread, streams per request.

The :class:`Engine` is single-threaded, so every call into it happens on one background thread.
asyncio callers talk to it through an inbox (add / abort commands) and get their chunks through
a per-request ``asyncio.Queue`` fed with ``loop.call_soon_threadsafe``.

Errors reach the caller typed: ``generate`` raises :class:`QueueFullError` (too many requests
waiting), :class:`EngineClosedError` (shutting down), ``InvalidRequestError`` (bad parameters,
prompt too long) and the grammar layer's ``GrammarError`` subclasses (invalid grammar, schema not
enforceable, compile timeout) before yielding anything. Closing the iterator early (client cancel,
disconnect, deadline) aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from espalier.engine.api import GenerationRequest, RequestOutput
from espalier.engine.engine import Engine

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_waiting`` allows (gRPC RESOURCE_EXHAUSTED)."""

    def __init__(self, waiting: int, limit: int) -> None:
        self.waiting = waiting
        self.limit = limit
        super().__init__(f"the queue is full: {waiting} requests waiting (limit {limit})")


class EngineClosedError(RuntimeError):
    """The engine is shutting down and takes no new requests (gRPC UNAVAILABLE)."""


@dataclass(frozen=True)
class AsyncEngineConfig:
    """max_waiting: requests queued but not running (compiling included) before new ones are
    refused. idle_wait_s: how long the step thread sleeps when there is nothing to do."""

    max_waiting: int = 1024
    idle_wait_s: float = 0.05


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]


class AsyncEngine:
    """Drives an :class:`Engine` on a daemon thread; safe to use from any asyncio loop."""

    def __init__(self, engine: Engine, config: AsyncEngineConfig | None = None) -> None:
        self.engine = engine
        self.config = config or AsyncEngineConfig()
        self._inbox: queue.SimpleQueue[tuple[str, Any, Future[None] | None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._stats: dict[str, Any] = dict(engine.stats())
        self._closing = False
        self._drain = True
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="espalier-engine", daemon=True)
        self._thread.start()

    # -- public API ---------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's chunks; the last has ``finished=True``."""
        if self._closing:
            raise EngineClosedError("the engine is shutting down")
        with self._lock:
            waiting = self._stats["waiting"] + self._stats["compiling"] + self._pending_adds
            if waiting >= self.config.max_waiting:
                raise QueueFullError(waiting, self.config.max_waiting)
            self._pending_adds += 1
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        added: Future[None] = Future()
        self._send("add", (request, stream), added)
        await asyncio.wrap_future(added)  # raises InvalidRequestError
        finished = False
        try:
            first = True
            while True:
                out = await stream.queue.get()
                if first and out.finished and out.exception is not None and not out.token_ids:
                    finished = True
                    raise out.exception  # e.g. a GrammarError from compiling
                first = False
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self._send("abort", request.request_id, None)

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with a ``FinishReason.ABORT`` chunk."""
        self._send("abort", request_id, None)

    def stats(self) -> dict[str, Any]:
        """Gauges from the last step: running, waiting, compiling, free/total KV blocks, steps."""
        with self._lock:
            snapshot = dict(self._stats)
            snapshot["streams"] = len(self._streams)
        return snapshot

    async def shutdown(self, drain: bool = True) -> None:
        """Refuse new requests; finish in-flight ones (``drain``) or abort them; stop the thread."""
        self._closing = True
        self._drain = drain
        self._send("stop", None, None)
        await asyncio.to_thread(self._stopped.wait)
        self._thread.join(timeout=5.0)
        self.engine.close()

    @property
    def is_running(self) -> bool:
        return not self._stopped.is_set()

    # -- the step thread ----------------------------------------------------------------------

    def _send(self, kind: str, payload: Any, done: Future[None] | None) -> None:
        self._inbox.put((kind, payload, done))
        self._wake.set()

    def _run(self) -> None:
        stopping = False
        try:
            while True:
                stopping = self._apply_inbox() or stopping
                if stopping and not self._drain:
                    for request_id in list(self._streams):
                        self.engine.abort(request_id)
                if not self.engine.has_unfinished():
                    if stopping:
                        return
                    self._wake.wait(self.config.idle_wait_s)
                    self._wake.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # a bug: fail every stream rather than hang them
                    log.exception("engine step failed")
                    outputs = self._fail_all(exc)
                self._deliver(outputs)
                self._update_stats()
        finally:
            self._stopped.set()

    def _apply_inbox(self) -> bool:
        stop = False
        while True:
            try:
                kind, payload, done = self._inbox.get_nowait()
            except queue.Empty:
                return stop
            if kind == "add":
                request, stream = payload
                try:
                    self.engine.add_request(request)
                    self._streams[request.request_id] = stream
                except Exception as exc:
                    assert done is not None
                    done.set_exception(exc)
                else:
                    assert done is not None
                    done.set_result(None)
                with self._lock:
                    self._pending_adds -= 1
                self._update_stats()
            elif kind == "abort":
                self.engine.abort(payload)
            elif kind == "stop":
                stop = True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            # a RuntimeError means the caller's loop is closed: nobody listens any more
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _fail_all(self, exc: Exception) -> list[RequestOutput]:
        for request_id in list(self._streams):
            self.engine.abort(request_id, error=f"engine failure: {exc!r}")
        return self.engine.take_pending()

    def _update_stats(self) -> None:
        stats = self.engine.stats()
        with self._lock:
            self._stats = stats
