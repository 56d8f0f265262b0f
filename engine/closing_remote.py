"""Closing decisions ahead in worker processes: the lookahead's Python off the engine's GIL.

On the H200 at batch 32 (``bench/gpu_timeline.py``, run 85) the closing lookahead jobs
(``engine/closing_ahead.py``) were 4.6-4.7 ms of pure Python per step on the mask threads. They
start after the step's fills, which is when the engine thread verifies: its waits for the GPU
drop the GIL, and getting it back behind a busy Python thread takes up to a switch interval.
Verification was done 15.2 ms after the forward's call (p50), against 10.1-10.5 ms
unconstrained, with the masks ready at 10.3-10.5 and the GPU at 10.0.

Here the same decisions (:func:`~espalier.engine.closing_ahead.decide_tree`, the same
``BudgetCloser.decide``) are made in worker processes, with their own GIL. A worker holds, per
request, a *mirror*: the request's grammar compiled again there (its backend and the spec it
compiled) in a matcher that has accepted the request's output tokens. Per step the engine sends
each worker one message (:meth:`ClosingWorkers.flush`): per request, the tokens appended since
its last message, the draft tree, the memo and the limits; the worker answers with every node's
decision. The engine thread receives the answer when it first takes a decision of the step
(appending after verification). The decisions are a function of the tokens alone, so they are
those of the engine's own matcher.

A worker that cannot build a mirror answers None for that request, and one that died answers
None for all: those tokens are decided inline, as without workers. The worker is a plain
``python -m`` child (not ``multiprocessing``'s spawn, which would import the parent's main
script again) talking over a ``multiprocessing`` pipe whose end it inherits.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable, Sequence
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from espalier.constrained.base import CompiledGrammar, GrammarMatcher
    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.engine.closing import BudgetCloser, Memo
    from espalier.engine.closing_ahead import Outcome
    from espalier.engine.request import Request

log = logging.getLogger(__name__)

MAX_COMPILED = 64  # grammars a worker keeps compiled (least recently opened dropped first)

# One request's share of a message: request id, (backend, spec) when the worker must build the
# mirror (else None), tokens to append to it, output length after them, memo, tree tokens,
# parents, output length at the step's start, limits, stop tokens.
Entry = tuple[
    str,
    "tuple[str, Any] | None",
    list[int],
    int,
    "Memo",
    list[int],
    list[int],
    int,
    tuple[int, int],
    frozenset[int],
]


class _Batch:
    """One message's answer: per entry, the node decisions (None: decide inline)."""

    __slots__ = ("received", "results")

    def __init__(self) -> None:
        self.received = False
        self.results: list[list[Outcome | None] | None] | None = None


class _Worker:
    """One worker process and the engine's side of its pipe."""

    def __init__(self, payload: tuple[Any, ...]) -> None:
        parent, child = Pipe()
        self.conn: Connection = parent
        fd = child.fileno()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "espalier.engine.closing_remote", str(fd)], pass_fds=(fd,)
        )
        child.close()
        self.alive = True
        self.outbox: list[Entry] = []
        self.forgets: list[str] = []
        self.batch = _Batch()  # the answer to the outbox, once sent
        self._sent: collections.deque[_Batch] = collections.deque()
        self._lock = threading.Lock()
        # the tokenizer is large (28 MB pickled for Gemma's 262k ids): sent from a thread, so
        # that the engine does not wait for the child to start; the pipe's lock orders it
        # before every message
        self._lock.acquire()
        threading.Thread(target=self._start, args=(payload,), daemon=True).start()

    def _start(self, payload: tuple[Any, ...]) -> None:
        try:
            self.conn.send(payload)
        except (OSError, ValueError):
            self.alive = False
        finally:
            self._lock.release()

    def flush(self) -> None:
        """Send the outbox and the requests to forget (nothing when both are empty)."""
        if not self.outbox and not self.forgets:
            return
        message, batch = (self.forgets, self.outbox), self.batch
        self.outbox, self.forgets, self.batch = [], [], _Batch()
        with self._lock:
            self._drain()  # earlier answers first: a worker blocked on a full pipe never reads
            if self.alive:
                try:
                    self.conn.send(message)
                    self._sent.append(batch)
                    return
                except (OSError, ValueError):
                    self._died()
            batch.received = True  # results None: inline

    def answer(self, batch: _Batch) -> list[list[Outcome | None] | None] | None:
        """``batch``'s results, waiting for them (sending it first if it is still the outbox)."""
        if batch is self.batch:
            self.flush()
        with self._lock:
            while not batch.received:
                self._receive_one()
        return batch.results

    def _drain(self) -> None:
        while self._sent:
            self._receive_one()

    def _receive_one(self) -> None:
        batch = self._sent[0] if self._sent else None
        if batch is None:
            return
        try:
            batch.results = self.conn.recv() if self.alive else None
        except (EOFError, OSError):
            self._died()
        self._sent.popleft()
        batch.received = True

    def _died(self) -> None:
        if self.alive:
            log.warning("closing worker %s stopped; deciding inline", self.process.pid)
        self.alive = False

    def close(self) -> None:
        with self._lock:
            with contextlib.suppress(OSError, ValueError):
                self.conn.send(None)
            self.conn.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()


class ClosingWorkers:
    """Worker processes that make the budget closer's decisions ahead (module docstring).

    ``processes``: how many; a request always goes to the same one (its mirror lives there).
    Used from the engine thread only."""

    def __init__(self, tokenizer: TokenizerInfo, processes: int) -> None:
        payload = (tokenizer.hf, tokenizer.vocab_size, tokenizer.stop_token_ids, tokenizer.name)
        self._workers = [_Worker(payload) for _ in range(max(1, processes))]
        self._synced: dict[str, int] = {}  # request id -> output tokens its mirror accepted

    def submit(
        self,
        request: Request,
        memo: Memo,
        tokens: list[int],
        parents: list[int],
        here: int,
        limits: tuple[int, int],
        stops: set[int] | frozenset[int],
    ) -> Callable[[], list[Outcome | None] | None]:
        """Queue the decisions for ``request``'s draft tree (sent by :meth:`flush`); returns
        what fetches them (blocking until they arrive; None: decide inline)."""
        compiled: CompiledGrammar | None = request.compiled
        assert compiled is not None
        request_id = request.request_id
        worker = self._worker_of(request_id)
        synced = self._synced.get(request_id)
        output = request.output_ids
        opening = None
        if synced is None or synced > len(output):
            opening, synced = (compiled.backend, compiled.spec), 0
        self._synced[request_id] = len(output)
        entry: Entry = (
            request_id,
            opening,
            list(output[synced:]),
            len(output),
            memo,
            tokens,
            parents,
            here,
            limits,
            frozenset(stops),
        )
        batch = worker.batch
        index = len(worker.outbox)
        worker.outbox.append(entry)

        def fetch() -> list[Outcome | None] | None:
            results = worker.answer(batch)
            outcomes = None if results is None else results[index]
            if outcomes is None:  # no mirror there (any more): build it with the next message
                self._synced.pop(request_id, None)
            return outcomes

        return fetch

    def flush(self) -> None:
        """Send what :meth:`submit` and :meth:`forget` queued (one message per worker)."""
        for worker in self._workers:
            worker.flush()

    def forget(self, request_id: str) -> None:
        """The request finished: its mirror is dropped with the next message."""
        if self._synced.pop(request_id, None) is not None:
            self._worker_of(request_id).forgets.append(request_id)

    def close(self) -> None:
        for worker in self._workers:
            worker.close()

    def _worker_of(self, request_id: str) -> _Worker:
        return self._workers[zlib.crc32(request_id.encode()) % len(self._workers)]


class _Mirrors:
    """The worker's side: per request a matcher that follows the engine's (module docstring)."""

    def __init__(self, tokenizer: TokenizerInfo) -> None:
        from espalier.engine.closing import BudgetCloser

        self.tokenizer = tokenizer
        self.closer: BudgetCloser = BudgetCloser(tokenizer)
        self._compiled: dict[tuple[str, Any], CompiledGrammar] = {}
        self._matchers: dict[str, tuple[GrammarMatcher, int]] = {}

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def decide(self, entry: Entry) -> list[Outcome | None] | None:
        """The node decisions for one entry; None when there is no mirror for its request."""
        from espalier.engine.closing_ahead import decide_tree

        request_id, opening, new, total, memo, tokens, parents, here, limits, stops = entry
        try:
            if opening is not None:
                self._matchers[request_id] = (self._compile(*opening).matcher(), 0)
            mirror = self._matchers.get(request_id)
            if mirror is None:
                return None
            matcher, synced = mirror
            if synced + len(new) != total or matcher.accept_tokens(new) != len(new):
                raise ValueError(f"mirror of {request_id} out of step with its request")
            self._matchers[request_id] = (matcher, total)
            return decide_tree(
                self.closer, memo, matcher.fork(), tokens, parents, here, limits, stops
            )
        except Exception:
            log.debug("closing worker: no decisions for %s", request_id, exc_info=True)
            self._matchers.pop(request_id, None)
            return None

    def _compile(self, backend: str, spec: Any) -> CompiledGrammar:
        from espalier.constrained.backends import get_backend

        key = (backend, spec.cache_key)
        compiled = self._compiled.pop(key, None)
        if compiled is None:
            compiled = get_backend(backend, self.tokenizer, None).compile(spec)
            while len(self._compiled) >= MAX_COMPILED:
                del self._compiled[next(iter(self._compiled))]
        self._compiled[key] = compiled
        return compiled


def serve(conn: Connection) -> None:
    """The worker's loop: a tokenizer first, then ``(forgets, entries)`` messages, each
    answered with the entries' decisions, until None or the engine's end of the pipe closes."""
    from espalier.constrained.tokenizer import TokenizerInfo

    hf, vocab_size, stops, name = conn.recv()
    mirrors = _Mirrors(TokenizerInfo(hf, vocab_size=vocab_size, stop_token_ids=stops, name=name))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        forgets, entries = message
        mirrors.forget(forgets)
        conn.send([mirrors.decide(entry) for entry in entries])


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
