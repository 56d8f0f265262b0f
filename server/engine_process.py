"""The engine in a child process: start it, and drive it as a :class:`ServingEngine`.

The child (``multiprocessing`` spawn: CUDA is only ever initialised there, and a forked copy of
the server's threads and locks is never run) loads the model and steps the engine in
``espalier.engine.core.loop.EngineLoop``; this process keeps the gRPC server, validation,
tokenization of text prompts, and the streams, and makes their text: the child sends token ids,
finish reasons and statuses, and each stream's text is detokenized and post-validated here
(``engine/output.py``), off the engine's step. Grammars compile in the child, next to the
matchers that use them: a compiled grammar is a native object of its backend (xgrammar,
llguidance, outlines-core) with no common serialized form, and compiling there keeps the
request path one hop. CompileGrammar goes through the channel too (:meth:`EngineProcess.compile`),
so it warms the cache the requests use; before the child is ready it compiles on the server's
own grammar service (the on-disk cache, when configured, is shared through the file system).

One thread writes commands to the pipe (the event loop never blocks on a full pipe); one reads
the engine's per-step messages, makes their text, and hands each to the event loop in one
callback. Post-validation compiles a grammar only for a replay (EBNF, Lark, structural tags),
in this process's own compile cache (:attr:`EngineProcess.compile_service`). When the child
dies, every open stream ends with UNAVAILABLE and ``on_failure`` is called once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, fields, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import grpc

from espalier.engine.api import (
    ConstraintOptions,
    GenerationRequest,
    InvalidRequestError,
    RequestOutput,
)
from espalier.engine.core.messages import (
    Abort,
    AddRequest,
    Compile,
    Compiled,
    EngineCommand,
    EngineStopped,
    PortableError,
    Shutdown,
    StepOutputs,
    Withdraw,
)
from espalier.engine.output import OutputProcessor
from espalier.server.errors import DrainingError, ResourceExhaustedError, ServiceError
from espalier.server.loading import wait_unless_left
from espalier.server.state import ModelFacts

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from espalier.constrained.base import CompiledGrammar, CompileReport
    from espalier.constrained.cache import CacheStats
    from espalier.constrained.spec import GrammarSpec
    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.engine.constraints import GrammarService
    from espalier.server.loading import ModelOptions

log = logging.getLogger(__name__)


class EngineUnavailableError(ServiceError):
    """The engine process is gone; requests in flight end with this (gRPC UNAVAILABLE)."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "ENGINE_UNAVAILABLE"


@dataclass(frozen=True)
class EngineProcessConfig:
    """max_waiting: queued requests (compiling included, adds in flight counted) before new ones
    are refused. start_timeout_s: model load in the child. stop_timeout_s: after a Shutdown is
    answered, before the child is terminated. compile_timeout_s: the child's compile limit
    (``--compile-timeout``); CompileGrammar waits for its answer a little longer."""

    max_waiting: int = 1024
    start_timeout_s: float = 1800.0
    stop_timeout_s: float = 30.0
    compile_timeout_s: float = 30.0


@dataclass(frozen=True)
class _Ready:
    facts: ModelFacts
    vocab_size: int  # the engine's tokenizer width (the model may pad the vocabulary)
    rank_pids: tuple[int, ...]  # the tensor-parallel ranks this child started (rank 1 on)


@dataclass(frozen=True)
class _LoadFailed:
    error: PortableError


def engine_main(options: ModelOptions, channel: Connection, cache_dir: str) -> None:
    """The child's entry point: load, announce ``_Ready`` (or ``_LoadFailed``), run the loop.

    ``cache_dir``: the server's cache folder for converted models and tokenizers (a spawned
    child starts from the defaults). Signals are the server's to handle: SIGINT/SIGTERM sent to
    the process group are ignored here; the server drains and then sends Shutdown. A closed
    channel ends the child."""
    from espalier.constrained.tokenizer import set_cache_root
    from espalier.engine.core.loop import EngineLoop, FailureSignal
    from espalier.engine.engine import EngineCore
    from espalier.server.gc_freeze import freeze_startup_heap
    from espalier.server.loading import grammar_service, load_engine, load_tokenizer

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING)
    set_cache_root(cache_dir)
    failure = FailureSignal()  # a dead tensor-parallel rank ends the loop with its reason
    try:
        tokenizer = load_tokenizer(options)
        grammar = grammar_service(options, tokenizer)
        engine, facts = load_engine(
            options, tokenizer, grammar, on_failure=failure, engine_type=EngineCore
        )
    except Exception as exc:
        channel.send(_LoadFailed(PortableError.of(exc)))
        return
    freeze_startup_heap()
    rank_pids = tuple(engine.runner.rank_pids) if options.tensor_parallel > 1 else ()
    channel.send(_Ready(facts, engine.tokenizer.vocab_size, rank_pids))
    # On a thread, as in the server: torch's CPU kernels stepped on a process's main thread ran
    # many times slower on a loaded machine (bench/serve.py's note; the commit has the numbers).
    engine_loop = EngineLoop(engine, channel, failure=failure)
    loop = threading.Thread(target=engine_loop.run, name="espalier-engine")
    loop.start()
    loop.join()


@dataclass(frozen=True)
class SpawnedEngine:
    """A child started by :func:`spawn_engine_process`, loading; ``channel`` is our end."""

    process: BaseProcess
    channel: Connection

    def kill(self) -> None:
        self.process.kill()


def spawn_engine_process(options: ModelOptions) -> SpawnedEngine:
    """Start the child, which loads its tokenizer and model while this process loads its own
    tokenizer (the two loads overlap); :func:`start_engine_process` waits for it."""
    from espalier.constrained.tokenizer import cache_root

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe(duplex=True)
    process = context.Process(
        target=engine_main,
        args=(options, theirs, str(cache_root())),
        name="espalier-engine",
        # Not daemonic: it starts the tensor-parallel ranks, and a daemonic process may not have
        # children. It never outlives the server: the server's end of the channel closing (on
        # any exit) ends its loop, and ``espalier serve`` leaves through ``os._exit``.
        daemon=False,
    )
    process.start()
    theirs.close()  # the child holds the only other end: its death is EOF here
    return SpawnedEngine(process, ours)


async def start_engine_process(
    spawned: SpawnedEngine,
    tokenizer: TokenizerInfo,
    config: EngineProcessConfig,
    on_failure: Callable[[str], None],
) -> tuple[EngineProcess, ModelFacts, TokenizerInfo]:
    """Wait until the spawned child's model is loaded; returns the client, the model facts and
    the tokenizer at the engine's vocabulary width. Raises what the load raised (the child is
    gone then)."""
    from espalier.constrained.tokenizer import TokenizerInfo

    process, ours = spawned.process, spawned.channel
    try:
        if not await asyncio.to_thread(ours.poll, config.start_timeout_s):
            raise TimeoutError(f"the engine process did not load in {config.start_timeout_s} s")
        first = ours.recv()
    except EOFError:
        process.join(5.0)
        raise RuntimeError(
            f"the engine process exited while loading (exit code {process.exitcode})"
        ) from None
    except BaseException:
        process.kill()
        raise
    if isinstance(first, _LoadFailed):
        process.join(5.0)
        raise first.error.rebuild()
    assert isinstance(first, _Ready), first
    if first.vocab_size != tokenizer.vocab_size:
        tokenizer = TokenizerInfo(tokenizer.hf, vocab_size=first.vocab_size, name=tokenizer.name)
    client = EngineProcess(process, ours, tokenizer, config, on_failure, first.rank_pids)
    return client, first.facts, tokenizer


def coalesce(
    item: RequestOutput, stream: asyncio.Queue[RequestOutput | BaseException]
) -> tuple[RequestOutput, BaseException | None]:
    """``item`` joined with the chunks already queued behind it (up to a finished one), and an
    exception found queued after them (None if none). Why: when the stream's reader lags the
    engine (64 streams of 5 ms steps), one message carries what piled up instead of one per
    step, so the server's per-message cost cannot hold the engine back."""
    while not item.finished and not stream.empty():
        later = stream.get_nowait()
        if isinstance(later, BaseException):
            return item, later
        item = item.followed_by(later)
    return item, None


class EngineProcess:
    """A :class:`~espalier.server.engine_port.ServingEngine` over the child's channel; made
    inside the event loop it serves (its streams are that loop's queues)."""

    def __init__(
        self,
        process: BaseProcess,
        channel: Connection,
        tokenizer: TokenizerInfo,
        config: EngineProcessConfig,
        on_failure: Callable[[str], None],
        rank_pids: tuple[int, ...] = (),
    ) -> None:
        self.process = process
        self.rank_pids = rank_pids
        # The server's own grammar service (CompileGrammar before the child was ready, replays
        # for post-validation), closed after the child stops.
        self.compile_service: GrammarService | None = None
        self.tokenizer = tokenizer
        self._text = OutputProcessor(tokenizer, self._compiled)
        self.config = config
        self._channel = channel
        self._on_failure = on_failure
        self._loop = asyncio.get_running_loop()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._lock = threading.Lock()
        self._stats: dict[str, Any] = {"waiting": 0, "compiling": 0}
        self._adds_sent = 0
        self._adds_applied = 0
        self._closing = False
        self._failed: str | None = None
        self._stopped = threading.Event()
        self._outbox: queue.SimpleQueue[EngineCommand | None] = queue.SimpleQueue()
        self._compiles: dict[int, Future[CompileReport]] = {}  # by Compile.call_id
        self._call_ids = itertools.count()
        self.last_heard = time.monotonic()  # the child's last message (it sends one a second)
        self._killed: str | None = None  # why kill() ended the child
        threading.Thread(target=self._write, name="engine-channel-out", daemon=True).start()
        threading.Thread(target=self._read, name="engine-channel-in", daemon=True).start()

    # -- ServingEngine ------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's chunks; the last has ``finished=True``. Raises before yielding
        what the engine refused (typed), ``ResourceExhaustedError`` (``max_waiting`` requests
        queued), ``DrainingError`` (shutting down); mid-stream :class:`EngineUnavailableError`
        if the engine process dies."""
        request_id = request.request_id
        self._check_open()
        if request_id in self._streams:
            raise InvalidRequestError([("request_id", f"{request_id!r} is already in use")])
        with self._lock:
            waiting = self._stats["waiting"] + self._stats["compiling"]
            waiting += self._adds_sent - self._adds_applied
        if waiting >= self.config.max_waiting:
            limit = self.config.max_waiting
            raise ResourceExhaustedError(
                f"the queue is full: {waiting} requests waiting (limit {limit})",
                metadata={"limit": str(limit), "kind": "engine_queue"},
            )
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        finished = False
        try:
            if request.prompt_token_ids is None:  # tokenized here, off the engine's process
                ids = await asyncio.to_thread(self._encode, request.prompt or "")
                request = replace(request, prompt=None, prompt_token_ids=ids)
            self._check_open()
            with self._lock:
                self._adds_sent += 1
            self._text.add(request)
            self._outbox.put(AddRequest(request))
            first = True
            held: BaseException | None = None
            while not finished:
                item = held if held is not None else await stream.get()
                held = None
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                item, held = coalesce(item, stream)
                finished = item.finished
                if first and finished and item.exception is not None and not item.token_ids:
                    raise item.exception  # refused or failed to compile: typed, nothing yielded
                first = False
                yield item
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            self._text.discard(request_id)
            if not finished and self._failed is None:
                self._outbox.put(Abort(request_id))

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with a ``FinishReason.ABORT`` chunk."""
        if self._failed is None:
            self._outbox.put(Abort(request_id))

    def compile(
        self, spec: GrammarSpec, options: ConstraintOptions, left: threading.Event
    ) -> CompileReport:
        """CompileGrammar in the engine's compile cache (blocking: call it off the event loop).
        Raises what the compile raised (typed), ``CompileTimeoutError``, or
        :class:`EngineUnavailableError` if the engine process is gone. Once ``left`` is set
        (the caller left), the compile is withdrawn (:class:`Withdraw`) and CancelledError
        raised."""
        future: Future[CompileReport] = Future()
        call_id = next(self._call_ids)
        with self._lock:
            if self._failed is not None or self._stopped.is_set():
                raise EngineUnavailableError(self._failed or "the engine process stopped")
            self._compiles[call_id] = future
        self._outbox.put(Compile(call_id, spec, options))
        try:
            report: CompileReport = wait_unless_left(
                future, self.config.compile_timeout_s, 5.0, left
            )
            return report
        except CancelledError:
            self._outbox.put(Withdraw(call_id))
            raise
        finally:
            with self._lock:
                self._compiles.pop(call_id, None)

    def stats(self) -> dict[str, Any]:
        """The engine's gauges from its last message, and the streams open here."""
        with self._lock:
            snapshot = {k: v for k, v in self._stats.items() if k != "grammar_cache"}
        snapshot["streams"] = len(self._streams)
        return snapshot

    def grammar_cache_stats(self, other: CacheStats) -> CacheStats:
        """``other`` (the server's CompileGrammar cache) plus the engine's compile cache."""
        from espalier.constrained.cache import CacheStats

        with self._lock:
            theirs = dict(self._stats.get("grammar_cache", {}))
        return CacheStats(
            **{f.name: getattr(other, f.name) + theirs.get(f.name, 0) for f in fields(other)}
        )

    async def shutdown(self, drain: bool = True) -> None:
        """Refuse new requests; finish (``drain``) or abort in-flight ones; stop the child."""
        self._closing = True
        self._outbox.put(Shutdown(drain))
        await asyncio.to_thread(self._stopped.wait, self.config.stop_timeout_s)
        await asyncio.to_thread(self.process.join, self.config.stop_timeout_s)
        if self.process.is_alive():
            log.warning("the engine process did not stop; killing it")
            self.process.kill()
            await asyncio.to_thread(self.process.join, 5.0)
        self._outbox.put(None)
        if self.compile_service is not None:  # its disk cache's writes reach the disk
            await asyncio.to_thread(self.compile_service.close)

    @property
    def is_running(self) -> bool:
        return not self._stopped.is_set()

    def kill(self, why: str) -> None:
        """End the child now (it is hung); its streams and the failure report say ``why``."""
        self._killed = why
        self.process.kill()

    # -- the channel --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._failed is not None:
            raise EngineUnavailableError(self._failed)
        if self._closing:
            raise DrainingError("the engine is shutting down")

    def _encode(self, prompt: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.hf.encode(prompt, add_special_tokens=True))

    def _write(self) -> None:
        while (command := self._outbox.get()) is not None:
            try:
                self._channel.send(command)
            except (OSError, ValueError):  # the child is gone: the reader reports it
                return

    def _read(self) -> None:
        why = "the engine process stopped"
        try:
            while True:
                message = self._channel.recv()
                self.last_heard = time.monotonic()
                if isinstance(message, StepOutputs):
                    with self._lock:
                        self._stats = dict(message.stats)
                        self._adds_applied = message.adds_applied
                    outputs = self._text.process(message.outputs())  # here: off the event loop
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
                elif isinstance(message, Compiled):
                    self._answer(message)
                elif isinstance(message, EngineStopped):
                    if message.error is not None:
                        why = message.error
                    elif self._closing:
                        why = ""
                    break
        except (EOFError, OSError):
            self.process.join(1.0)
            why = self._killed or f"the engine process exited (exit code {self.process.exitcode})"
        finally:
            with self._lock:
                self._stopped.set()
                waiting, self._compiles = list(self._compiles.values()), {}
            for future in waiting:
                future.set_exception(EngineUnavailableError(why or "the engine process stopped"))
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
                self._loop.call_soon_threadsafe(self._end, why)

    def _answer(self, message: Compiled) -> None:
        with self._lock:
            future = self._compiles.get(message.call_id)
        if future is None:  # its caller gave up waiting
            return
        if message.error is not None:
            future.set_exception(message.error.rebuild())
        else:
            assert message.report is not None
            future.set_result(message.report)

    def _compiled(self, spec: GrammarSpec, options: ConstraintOptions) -> CompiledGrammar:
        """``spec`` compiled in this process (post-validation's replay), blocking."""
        from espalier.engine.constraints import GrammarService

        with self._lock:
            if self.compile_service is None:
                self.compile_service = GrammarService(
                    self.tokenizer, compile_timeout_s=self.config.compile_timeout_s
                )
            service = self.compile_service
        compiled: CompiledGrammar = service.submit(spec, options).result()[0]
        return compiled

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _end(self, why: str) -> None:
        """The child stopped: after a clean Shutdown (``why`` empty) or not."""
        if not why and not self._streams:
            return
        why = why or "the engine stopped with requests in flight"
        self._failed = why
        log.error("%s; failing %d open streams", why, len(self._streams))
        for stream in self._streams.values():
            stream.put_nowait(EngineUnavailableError(why))
        if not self._closing:
            self._on_failure(why)
