"""The engine process's busy loop: commands in, one :class:`StepOutputs` per step out.

Single-threaded like the :class:`~espalier.engine.engine.Engine` it drives: between steps it
takes every command waiting on the channel (never blocking while requests are unfinished), steps
once, and sends the step's chunks as one message. Idle, it blocks on the channel up to
``idle_wait_s`` (waking early for a command) and steps anyway so finished compiles are noticed
(a request's, and CompileGrammar's: one :class:`Compiled` answer each).
The server process's end closing (the server died) aborts everything and ends the loop. A
:class:`FailureSignal` set from another thread (a dead tensor-parallel rank) fails the requests in
flight and ends the loop with :class:`EngineStopped` carrying the reason.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import fields
from multiprocessing.connection import Connection
from typing import Any

from espalier.engine.api import FinishReason, RequestOutput
from espalier.engine.core.messages import (
    Abort,
    AddRequest,
    Compile,
    Compiled,
    EngineStopped,
    PortableError,
    Shutdown,
    StepOutputs,
    Withdraw,
)
from espalier.engine.engine import EngineCore

log = logging.getLogger(__name__)


IDLE_WAIT_S = 0.02
"""How long an idle loop blocks on the channel before looking at compiles."""

HEARTBEAT_S = 1.0
"""The loop sends its stats at least this often, changed or not: the server reads a silence
much longer than a step as a hung engine (``server/engine_supervisor.py``)."""


class FailureSignal:
    """Set once, from any thread, by what leaves the engine unusable (``load_engine``'s
    ``on_failure``: a tensor-parallel rank died); the loop reads it between steps."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def __call__(self, why: str) -> None:
        if self.reason is None:
            self.reason = why


class EngineLoop:
    """Steps ``engine`` (an :class:`EngineCore`: token chunks, the server makes the text) on
    this thread, talking over ``channel`` (one end of a Pipe)."""

    def __init__(
        self,
        engine: EngineCore,
        channel: Connection,
        failure: FailureSignal | None = None,
    ):
        self.engine = engine
        self.channel = channel
        self.failure = failure or FailureSignal()
        self._live: set[str] = set()  # requests added and not yet finished
        self._adds = 0
        self._stopping = False
        self._drain = True
        self._last_stats: dict[str, Any] = {}
        self._last_sent = time.monotonic()
        self._compiles: dict[int, Future[Any]] = {}  # Compile call id -> the grammar's compile

    def run(self) -> None:
        """Until a Shutdown is done or the channel closes; sends :class:`EngineStopped` last."""
        error = None
        try:
            self._run()
            error = self.failure.reason
        except (EOFError, OSError):  # the server process is gone: nobody to answer
            log.warning("the server closed the channel; aborting %d requests", len(self._live))
            return
        except Exception as exc:
            log.exception("the engine loop failed")
            error = f"the engine loop failed: {type(exc).__name__}: {exc}"
        finally:
            self.engine.close()
        self.channel.send(EngineStopped(error))

    def _run(self) -> None:
        while self.failure.reason is None:
            busy = self.engine.has_unfinished()
            outputs = self._take_commands(0.0 if busy else IDLE_WAIT_S)
            if self._stopping and not self._drain:
                for request_id in self._live:
                    self.engine.abort(request_id)
            if self.engine.has_unfinished():
                outputs.extend(self._step())
            elif self._stopping:
                self._send(outputs)
                return
            self._answer_compiles()
            self._send(outputs)
        self._send(self._fail_live(f"engine failure: {self.failure.reason}"))

    def _take_commands(self, timeout_s: float) -> list[RequestOutput]:
        """Apply every waiting command (waiting up to ``timeout_s`` for the first); returns the
        chunks of refused adds."""
        refused: list[RequestOutput] = []
        while self.channel.poll(timeout_s):
            timeout_s = 0.0
            command = self.channel.recv()
            if isinstance(command, AddRequest):
                self._adds += 1
                request = command.request
                if self._stopping:
                    refused.append(_error_chunk(request.request_id, RuntimeError("shutting down")))
                    continue
                try:
                    self.engine.add_request(request)
                except Exception as exc:  # InvalidRequestError: the caller's, typed
                    refused.append(_error_chunk(request.request_id, exc))
                else:
                    self._live.add(request.request_id)
            elif isinstance(command, Abort):
                self.engine.abort(command.request_id)
            elif isinstance(command, Compile):
                future = self.engine.grammar.submit(command.spec, command.options)
                self._compiles[command.call_id] = future
            elif isinstance(command, Withdraw):
                withdrawn = self._compiles.pop(command.call_id, None)
                if withdrawn is not None:
                    withdrawn.cancel()
            elif isinstance(command, Shutdown):
                self._stopping, self._drain = True, command.drain
        return refused

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as exc:  # a bug or a dead rank: fail every request rather than hang them
            log.exception("engine step failed")
            return self._fail_live(f"engine failure: {exc!r}")

    def _fail_live(self, error: str) -> list[RequestOutput]:
        for request_id in self._live:
            self.engine.abort(request_id, error=error)
        return self.engine.take_pending()

    def _answer_compiles(self) -> None:
        """One :class:`Compiled` per finished compile (the compile cache bounds each in time)."""
        for call_id, future in list(self._compiles.items()):
            if not future.done():
                continue
            del self._compiles[call_id]
            error = future.exception()
            if error is None:
                self.channel.send(Compiled(call_id, future.result()[1]))
            else:
                self.channel.send(Compiled(call_id, None, PortableError.of(error)))

    def _send(self, outputs: list[RequestOutput]) -> None:
        stats = self._stats()
        now = time.monotonic()
        if not outputs and stats == self._last_stats and now - self._last_sent < HEARTBEAT_S:
            return
        self._last_stats, self._last_sent = stats, now
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        self.channel.send(StepOutputs.pack(outputs, stats, self._adds))

    def _stats(self) -> dict[str, Any]:
        stats = self.engine.stats()
        cache = self.engine.grammar.cache.stats
        stats["grammar_cache"] = {f.name: getattr(cache, f.name) for f in fields(cache)}
        return stats


def _error_chunk(request_id: str, exc: BaseException) -> RequestOutput:
    return RequestOutput(
        request_id,
        "",
        (),
        finished=True,
        finish_reason=FinishReason.ERROR,
        error=str(exc),
        exception=exc,
    )
