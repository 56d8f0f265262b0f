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
compiled) in a matcher that has accepted the request's output tokens. A request goes to the
worker with the fewest requests when it is first seen, and stays there. Per step the engine
sends each worker one message (:meth:`ClosingWorkers.flush`): per request, the tokens appended
since its last message, the draft tree, the memo and the limits; the worker answers with every
node's decision, in parts (:data:`CHUNK_S`). The engine thread receives a request's part when
it first takes a decision of the request in the step (appending after verification). The
decisions are a function of the tokens alone, so they are those of the engine's own matcher.

A worker that cannot build a mirror answers None for that request, and one that died answers
None for all: those tokens are decided inline, as without workers; so are those of requests
whose worker has not started yet (a few seconds: it builds the tokenizer first). The worker is
a plain ``python -m`` child (not ``multiprocessing``'s spawn, which would import the parent's
main script again) talking over a ``multiprocessing`` pipe whose end it inherits.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, NamedTuple

from espalier.engine.closing_ahead import Outcome, child_index, decide_tree, path_nodes

if TYPE_CHECKING:
    from espalier.constrained.base import CompiledGrammar, GrammarMatcher
    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.engine.closing import BudgetCloser, Memo
    from espalier.engine.request import Request

log = logging.getLogger(__name__)

REMOTE_BACKENDS = ("llguidance", "xgrammar")
"""Backends whose requests are decided in the workers. A worker compiles each grammar again;
outlines-core's compiles take seconds (26 s for ``{"type": "object"}`` with Gemma's vocabulary
here), so its requests keep the mask threads' lookahead."""
WAIT_S = 0.02
"""The longest the engine thread waits for a worker's answer before deciding inline (a worker
still compiling a new grammar); the next waits of that step for the same worker do not wait."""

CHUNK_S = 0.001
"""A worker sends the tree decisions it has made so far once making them took this long since
its last send (then goes on), so the engine appends the first requests of a step while the
worker decides for the last ones: one message in a step of quick decisions, several in a step
where many requests search for closing paths at once (their first checks in the window: H200,
batch 32, ``bench/gpu_timeline.py`` run 91, appends of 8.5-15.6 ms in such steps against 2-3
in the others)."""

READY = "ready"  # the worker's first message: it has built the tokenizer and the backends
MAX_COMPILED = 64  # grammars a worker keeps compiled (least recently opened dropped first)


class Entry(NamedTuple):
    """One request's share of a message. No tree tokens: only the mirror is built or advanced
    (``ClosingWorkers.open``)."""

    request_id: str
    opening: tuple[str, Any] | None  # (backend, spec): the worker must build the mirror
    new: list[int]  # tokens to append to the mirror
    total: int  # the request's output length after them
    memo: Memo | None
    tokens: list[int]  # the draft tree (node 0 = root)
    parents: list[int]
    here: int  # output length at the step's start
    limits: tuple[int, int]
    stops: frozenset[int]


Query = tuple[str, list[int], int]
"""A decision asked for after a step's verification: request id, the accepted tree tokens
below the root, the token after them (off the tree: the bonus token)."""


class _Reply:
    """One answer the engine waits for: ``value`` once ``received`` (None: inline).

    ``parts``: the answer to a message's entries, which comes in parts (``(decisions, last,
    seconds)`` messages, :data:`CHUNK_S`): ``value`` is the list of the decisions received so
    far."""

    __slots__ = ("parts", "received", "sent", "sent_at", "value")

    def __init__(self, *, parts: bool = False) -> None:
        self.parts = parts
        self.sent = False  # its message went to the worker (else it is still queued)
        self.sent_at = 0.0  # perf_counter when it did
        self.received = False
        self.value: Any = [] if parts else None


class _Worker:
    """One worker process and the engine's side of its pipe.

    ``payload``: the pickled tokenizer, sent from a thread (28 MB for Gemma's 262k ids: the
    engine does not wait for the child to start); the worker answers ``READY`` once it has
    built it. Until then :meth:`ClosingWorkers.submit` queues nothing for it (inline)."""

    def __init__(self, payload: bytes, chunk_s: float = CHUNK_S) -> None:
        parent, child = Pipe()
        self.conn: Connection = parent
        fd = child.fileno()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "espalier.engine.closing_remote", str(fd), repr(chunk_s)],
            pass_fds=(fd,),
        )
        child.close()
        self.alive = True
        self.ready = threading.Event()
        self.outbox: list[Entry] = []
        self.queries: list[tuple[Query, _Reply]] = []
        self.forgets: list[str] = []
        self.batch = _Reply(parts=True)  # the answer to the outbox, once sent
        self.requests = 0  # requests assigned to this worker (``ClosingWorkers._worker_of``)
        # seconds the worker reported deciding entries, and from sending a message to its
        # entries' last part (the two apart: time in the pipe, or the worker busy before it)
        self.busy_s = 0.0
        self.answer_s = 0.0
        self._sent: collections.deque[_Reply] = collections.deque()
        self._late = False  # an answer of this step did not come within WAIT_S
        self._lock = threading.Lock()
        self._lock.acquire()  # released by _start: the handshake comes before every message
        threading.Thread(target=self._start, args=(payload,), daemon=True).start()

    def _start(self, payload: bytes) -> None:
        try:
            self.conn.send_bytes(payload)
            if self.conn.recv() == READY:
                self.ready.set()
            else:
                self._died()
        except (EOFError, OSError, ValueError):
            self._died()
        finally:
            self._lock.release()

    def flush(self) -> None:
        """Send the outbox, the queries and the requests to forget (nothing when all are
        empty). The worker answers with one message for the outbox, then one per query."""
        if not self.outbox and not self.queries and not self.forgets:
            return
        message = (self.forgets, self.outbox, [query for query, _ in self.queries])
        replies = [self.batch, *(reply for _, reply in self.queries)]
        self.outbox, self.queries, self.forgets = [], [], []
        self.batch = _Reply(parts=True)
        with self._lock:
            self._late = False
            self._drain()  # the answers already there (a worker blocked on a full pipe would
            # never read ours)
            if self.alive:
                try:
                    self.conn.send(message)
                    self._sent.extend(replies)
                    sent_at = time.perf_counter()
                    for reply in replies:
                        reply.sent, reply.sent_at = True, sent_at
                    return
                except (OSError, ValueError):
                    self._died()
            for reply in replies:
                reply.received = True  # value None: inline

    def answer(self, reply: _Reply) -> Any:
        """``reply``'s value (sending the outbox first if it is still there); None when it
        does not come within :data:`WAIT_S` (or, once one of this step did not, at once)."""
        return reply.value if self._wait(reply, None) else None

    def answer_part(self, reply: _Reply, index: int) -> tuple[bool, Any]:
        """``(True, decision)`` for entry ``index`` of a multi-part ``reply`` once its part is
        there (without waiting for the later parts); ``(False, None)`` when it does not come
        in time (as :meth:`answer`) or the worker stopped before sending it."""
        if not self._wait(reply, index) or index >= len(reply.value):
            return False, None
        return True, reply.value[index]

    def _wait(self, reply: _Reply, index: int | None) -> bool:
        """Receive until ``reply`` (with ``index``: its part holding entry ``index``) is
        there; False when it does not come within the step's wait."""
        if not reply.received and not reply.sent:
            self.flush()
        deadline = time.monotonic() + (0.0 if self._late else WAIT_S)
        with self._lock:
            while not reply.received and (index is None or len(reply.value) <= index):
                if not self._ready_to_receive(max(0.0, deadline - time.monotonic())):
                    self._late = True
                    return False
                self._receive_one()
        return True

    def _ready_to_receive(self, timeout_s: float) -> bool:
        """An answer is there to receive (or the worker died: then every one is None)."""
        if not self.alive:
            return True
        try:
            return self.conn.poll(timeout_s)
        except (EOFError, OSError):
            self._died()
            return True

    def _drain(self) -> None:
        while self._sent and self._ready_to_receive(0.0):
            self._receive_one()

    def _receive_one(self) -> None:
        """Receive one message, for the oldest reply still waiting (a part of it, when it
        comes in parts and this is not the last one)."""
        if not self._sent:
            return
        reply = self._sent[0]
        message = None
        try:
            if self.alive:
                message = self.conn.recv()
        except (EOFError, OSError):
            self._died()
        if reply.parts and message is not None:
            decisions, last, seconds = message
            reply.value.extend(decisions)
            self.busy_s += seconds
            if not last:
                return
            self.answer_s += time.perf_counter() - reply.sent_at
        elif not reply.parts:
            reply.value = message
        self._sent.popleft()
        reply.received = True

    def _died(self) -> None:
        if self.alive:
            log.warning("closing worker %s stopped; deciding inline", self.process.pid)
        self.alive = False

    def close(self) -> None:
        """Ask the worker to exit (killed when it does not within 5 s, or when it is still
        starting and holds the pipe that long)."""
        if self._lock.acquire(timeout=5):
            try:
                with contextlib.suppress(OSError, ValueError):
                    self.conn.send(None)
            finally:
                self._lock.release()
        else:
            self.process.kill()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.alive = False
        self.conn.close()


class ClosingWorkers:
    """Worker processes that make the budget closer's decisions ahead (module docstring).

    ``processes``: how many; a request always goes to the same one (its mirror lives there).
    Used from the engine thread only."""

    def __init__(
        self, tokenizer: TokenizerInfo, processes: int, *, chunk_s: float | None = None
    ) -> None:
        """chunk_s: the workers' :data:`CHUNK_S` (None: that default)."""
        payload = tokenizer.backend_view("espalier.engine.closing_remote.payload", _payload)
        chunk = CHUNK_S if chunk_s is None else chunk_s
        self._workers = [_Worker(payload, chunk) for _ in range(max(1, processes))]
        self._synced: dict[str, int] = {}  # request id -> output tokens its mirror accepted
        self._assigned: dict[str, _Worker] = {}  # request id -> the worker with its mirror

    def wait_ready(self, timeout_s: float = 60.0) -> bool:
        """Block until every worker has started (or ``timeout_s`` passed); True when all did.
        Not needed for correctness: until a worker is ready its requests are decided inline."""
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            worker.ready.wait(max(0.0, deadline - time.monotonic()))
        return all(worker.ready.is_set() and worker.alive for worker in self._workers)

    def takes(self, request: Request) -> bool:
        """Whether ``request``'s decisions can be made here (a grammar of REMOTE_BACKENDS)."""
        compiled = request.compiled
        return compiled is not None and compiled.backend in REMOTE_BACKENDS

    def open(self, request: Request) -> None:
        """Have the worker build ``request``'s mirror now, with the next :meth:`flush` (the
        grammar compiles there while the request is still outside the closing window)."""
        request_id = request.request_id
        worker = self._worker_of(request_id)
        if request_id in self._synced or not worker.ready.is_set() or not worker.alive:
            return
        compiled = request.compiled
        assert compiled is not None
        output = list(request.output_ids)
        self._synced[request_id] = len(output)
        opening = (compiled.backend, compiled.spec)
        entry = Entry(request_id, opening, output, len(output), None, [], [], 0, (0, 0), _NONE)
        worker.outbox.append(entry)  # its answer (no decisions) is not waited for

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
        if not worker.ready.is_set() or not worker.alive:
            return _inline
        synced = self._synced.get(request_id)
        output = request.output_ids
        opening = None
        if synced is None or synced > len(output):
            opening, synced = (compiled.backend, compiled.spec), 0
        self._synced[request_id] = len(output)
        entry = Entry(
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
            arrived, decisions = worker.answer_part(batch, index)
            if not arrived:  # late (the mirror is fine), or a dead worker
                return None
            if decisions is None:  # no mirror there (any more): build it with the next one
                self._synced.pop(request_id, None)
            return decisions

        return fetch

    def query(self, request_id: str, path: list[int], token: int) -> Callable[[], Outcome | None]:
        """Queue the decision for ``token`` appended after ``path`` (tree tokens below the root
        of ``request_id``'s last submitted tree; ``token`` is off the tree: the bonus token)
        for the next :meth:`flush`; returns what fetches it (None: decide inline)."""
        if request_id not in self._synced:
            return _inline
        worker = self._worker_of(request_id)
        if not worker.alive:
            return _inline
        reply = _Reply()
        worker.queries.append(((request_id, path, token), reply))
        return functools.partial(worker.answer, reply)

    def flush(self) -> None:
        """Send what :meth:`submit`, :meth:`query` and :meth:`forget` queued (one message per
        worker)."""
        for worker in self._workers:
            worker.flush()

    def forget(self, request_id: str) -> None:
        """The request finished: its mirror is dropped with the next message."""
        worker = self._assigned.pop(request_id, None)
        if worker is None:
            return
        worker.requests -= 1
        if self._synced.pop(request_id, None) is not None:
            worker.forgets.append(request_id)

    def busy(self) -> tuple[float, float]:
        """``(deciding, answering)``: seconds the workers reported making tree decisions, and
        seconds from sending a message to its last part, summed over workers and messages
        (differences over a step tell whether the workers were slow or the answers late)."""
        return (
            sum(worker.busy_s for worker in self._workers),
            sum(worker.answer_s for worker in self._workers),
        )

    def receive_all(self) -> None:
        """Block until every answer already sent for has come back (for a benchmark that
        times one step alone: the mirrors opened before it are then built)."""
        for worker in self._workers:
            with worker._lock:
                while worker._sent and worker.alive:
                    worker._receive_one()

    def close(self) -> None:
        for worker in self._workers:
            worker.close()

    def _worker_of(self, request_id: str) -> _Worker:
        """The request's worker: on first use, the live one with the fewest requests (a step's
        decisions wait for the busiest worker; hashing ids split the benchmark's 32 requests
        14 / 18 between two)."""
        worker = self._assigned.get(request_id)
        if worker is None:
            live = [w for w in self._workers if w.alive] or self._workers
            worker = min(live, key=lambda w: w.requests)
            worker.requests += 1
            self._assigned[request_id] = worker
        return worker


_NONE: frozenset[int] = frozenset()


def _inline() -> None:
    """No decisions from a worker (it has not started, or it stopped): decide inline."""
    return None


def _payload(tokenizer: TokenizerInfo) -> bytes:
    """What a worker needs to build ``tokenizer`` again, pickled (once per tokenizer)."""
    hf, stops = tokenizer.hf, tokenizer.stop_token_ids
    return pickle.dumps((hf, tokenizer.vocab_size, stops, tokenizer.name), protocol=5)


class _Mirrors:
    """The worker's side: per request a matcher that follows the engine's (module docstring)."""

    def __init__(self, tokenizer: TokenizerInfo) -> None:
        from espalier.engine.closing import BudgetCloser

        self.tokenizer = tokenizer
        self.closer: BudgetCloser = BudgetCloser(tokenizer)
        self._compiled: dict[tuple[str, Any], CompiledGrammar] = {}
        self._matchers: dict[str, tuple[GrammarMatcher, int]] = {}
        # per request, its last tree's entry and decisions (for the queries after it)
        self._last: dict[str, tuple[Entry, list[Outcome | None]]] = {}

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)
            self._last.pop(request_id, None)

    def answer(self, query: Query) -> Outcome | None:
        """The decision for a query's token, after the path of the request's last tree; None
        when the path is not one the engine goes along (off the tree, a closing or a stop on
        it) or there is no mirror."""
        request_id, path, token = query
        last, mirror = self._last.get(request_id), self._matchers.get(request_id)
        if last is None or mirror is None:
            return None
        entry, outcomes = last
        memo, tokens, parents, here, limits, stops = entry[4:]
        if memo is None:
            return None
        nodes = path_nodes(child_index(tokens, parents), path)
        if nodes is None:
            return None
        for node, step in zip(nodes, path):
            outcome = outcomes[node]
            if outcome is None or outcome[0] is not None or step in stops:
                return None
            memo = outcome[1]
        try:
            matcher = mirror[0].fork()
            if matcher.accept_tokens(path) != len(path) or matcher.is_terminated():
                return None
            check = here + len(path)
            budget = min(limits[0] - check, limits[1] - check)
            return self.closer.decide(memo, matcher, token, check, budget, token in stops)
        except Exception:
            log.debug("closing worker: no decision for %s", request_id, exc_info=True)
            return None

    def decide(self, entry: Entry) -> list[Outcome | None] | None:
        """The node decisions for one entry; None when there is no mirror for its request."""
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
            if not tokens or memo is None:
                return None
            outcomes = decide_tree(
                self.closer, memo, matcher.fork(), tokens, parents, here, limits, stops
            )
            self._last[request_id] = (entry, outcomes)
            return outcomes
        except Exception:
            log.debug("closing worker: no decisions for %s", request_id, exc_info=True)
            self._matchers.pop(request_id, None)
            self._last.pop(request_id, None)
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


def _warm_backends(tokenizer: TokenizerInfo) -> None:
    """Bind REMOTE_BACKENDS to the tokenizer before the worker says it is ready: the first
    compile would otherwise build their vocabulary views (1.44 s for llguidance, 0.29 s for
    xgrammar with Gemma's 262k ids here) while the engine waits for an answer."""
    from espalier.constrained.backends import get_backend
    from espalier.constrained.errors import GrammarError

    for name in REMOTE_BACKENDS:
        try:
            get_backend(name, tokenizer, None)
        except GrammarError:  # not installed: no request of it can come
            log.debug("closing worker: backend %s unavailable", name, exc_info=True)


def serve(conn: Connection, chunk_s: float = CHUNK_S) -> None:
    """The worker's loop: a tokenizer first, then ``(forgets, entries, queries)`` messages,
    each answered with the entries' decisions, in parts (``(decisions, last, seconds)``, a
    part sent once its decisions took ``chunk_s``, :data:`CHUNK_S`; ``seconds``: making
    them), then each query's decision, until None or the engine's end of the pipe closes."""
    from espalier.constrained.tokenizer import TokenizerInfo

    hf, vocab_size, stops, name = pickle.loads(conn.recv_bytes())
    tokenizer = TokenizerInfo(hf, vocab_size=vocab_size, stop_token_ids=stops, name=name)
    mirrors = _Mirrors(tokenizer)
    _warm_backends(tokenizer)
    conn.send(READY)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the engine's end closed (or its process died)
            return
        if message is None:
            return
        forgets, entries, queries = message
        mirrors.forget(forgets)
        part: list[list[Outcome | None] | None] = []
        start = time.perf_counter()
        for count, entry in enumerate(entries, 1):
            part.append(mirrors.decide(entry))
            if count < len(entries) and time.perf_counter() - start >= chunk_s:
                conn.send((part, False, time.perf_counter() - start))
                part, start = [], time.perf_counter()
        conn.send((part, True, time.perf_counter() - start))
        for query in queries:  # one message each: the engine takes them one by one
            conn.send(mirrors.answer(query))


if __name__ == "__main__":
    # the package's copy of this module, not ``__main__``: the engine pickles its ``Entry``
    from espalier.engine.closing_remote import serve as _serve

    _serve(Connection(int(sys.argv[1])), float(sys.argv[2]) if len(sys.argv) > 2 else CHUNK_S)
