"""Bounded places to compile in, one set per backend: killable child processes, in-process lanes.

A backend's compile is native code that cannot be interrupted from Python. Run on a compile
thread, a slow one would be abandoned at its deadline and run on, holding a core and memory; a
few of them could take every compile thread (``constrained/cache.py``). So:

- :class:`ChildPool`: compiles that may run long (xgrammar, outlines-core) run in child processes
  (``constrained/compile_child.py``) started once with the vocabulary and kept warm. A compile
  waits for a free child up to its own deadline; at the deadline, or once every caller of the
  compile has left (:func:`cache.abandoned_check`: a cancelled request, an expired client
  deadline), the child is killed and its slot freed at once, so nothing runs on abandoned. The
  grammar comes back in the library's own serialized form. At most ``max_children`` per pool:
  one slow backend cannot take the others'.
- :class:`InProcessLane`: a backend whose compile the library itself bounds (llguidance: lazy
  lexer, its own size and fuel limits) compiles in-process, at most ``slots`` at a time.

Waits for a child or a slot are reported to the running compile (:func:`cache.waiting`), so a
compile's queue time and its run time are reported apart.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator

from espalier.constrained.cache import abandoned_check, compile_deadline, waiting
from espalier.constrained.compile_child import U64
from espalier.constrained.errors import CompileMemoryError, CompileTimeoutError, GrammarError

_CHUNK = 1 << 20
_POLL_S = 0.05  # how often a wait for a child looks whether its compile was abandoned


class ChildRefusedError(GrammarError):
    """The library in the child refused the grammar; ``str()`` is its error text."""

    reason = "INVALID_GRAMMAR"


class _Timeout(Exception):
    """The caller's deadline passed, or every caller left, before the child answered."""


class _Died(Exception):
    """The child's pipe closed before it answered."""


def memory_bounded_children(memory_limit: int, wanted: int) -> int:
    """``wanted`` children, fewer when the machine's available memory holds fewer children of
    ``memory_limit`` bytes each (at least 1)."""
    if memory_limit <= 0:
        return max(1, wanted)
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return max(1, wanted)
    return max(1, min(wanted, available // memory_limit))


class _Child:
    """One child process, started with the memory cap and the setup payload."""

    def __init__(self, module: str, memory_limit: int, setup: bytes) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # library warnings; an abort past the cap: the exit says it
        )
        try:
            self._send(U64.pack(memory_limit) + U64.pack(len(setup)))
            self._send(setup)
        except _Died:  # it ended at start (a limit too small to start the interpreter in)
            detail = self.exit_detail()
            self.kill()
            raise _Died(f"its child process ended at start, {detail}") from None

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def ask(
        self, request: bytes, deadline: float | None, abandoned: Callable[[], bool]
    ) -> tuple[bytes, bytes]:
        """``(tag, payload)`` of the child's answer to ``request``."""
        self._send(U64.pack(len(request)) + request)
        head = self._read(1 + U64.size, deadline, abandoned)
        return head[:1], self._read(U64.unpack(head[1:])[0], deadline, abandoned)

    def exit_detail(self) -> str:
        """How the child ended, once its pipe closed: ``"signal SIGABRT"``, ``"exit status 1"``."""
        code = self.process.wait()
        if code >= 0:
            return f"exit status {code}"
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
        self.process.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):  # a broken pipe's unflushed bytes
                    pipe.close()

    def _send(self, data: bytes) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        try:
            stdin.write(data)
            stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise _Died from exc

    def _read(self, n: int, deadline: float | None, abandoned: Callable[[], bool]) -> bytes:
        """``n`` bytes of the child's stdout (its raw pipe, so ``select`` sees every byte)."""
        stdout = self.process.stdout
        assert stdout is not None
        fd = stdout.fileno()
        data = bytearray(n)
        view = memoryview(data)
        got = 0
        while got < n:
            while True:
                if abandoned():
                    raise _Timeout
                left = _POLL_S if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise _Timeout
                if select.select([fd], [], [], min(left, _POLL_S))[0]:
                    break
            read = os.readv(fd, [view[got : got + _CHUNK]])
            if read == 0:
                raise _Died
            got += read
        return bytes(data)


class ChildPool:
    """At most ``max_children`` warm child processes of ``module`` for one backend (thread-safe).

    Args:
        backend: the backend's name (in errors).
        module: the child's module (run with ``python -m``).
        setup: the setup payload each child gets once (the vocabulary).
        memory_limit: each child's address-space cap in bytes (0: none).
        max_children: children alive at once, busy or idle; a compile past that waits.
        warm: children kept ready: started at once in the background, and again after a kill,
            so the next compile finds one without waiting for the library to load.
    """

    def __init__(
        self,
        backend: str,
        module: str,
        setup: bytes,
        *,
        memory_limit: int,
        max_children: int,
        warm: int = 1,
    ) -> None:
        self.backend = backend
        self.module = module
        self.memory_limit = memory_limit
        self.max_children = max(1, max_children)
        self.started = 0
        self.killed = 0
        self._setup = setup
        self._cond = threading.Condition()
        self._idle: list[_Child] = []
        self._children: set[_Child] = set()
        self._slots = 0  # children alive or starting
        self._warm = min(warm, self.max_children)
        self._warming = 0  # children starting in the background
        weakref.finalize(self, _kill_all, self._children)
        self._refill()

    def ask(self, request: bytes) -> bytes:
        """The child's ``K`` payload for ``request``. Raises :class:`ChildRefusedError` with the
        library's error text, :class:`CompileMemoryError` past the memory cap (or when the child
        died), :class:`CompileTimeoutError` when the running compile's deadline passed first."""
        running = compile_deadline()
        deadline = None if running is None else running[0]
        abandoned = abandoned_check()
        child = self._take(deadline, running, abandoned)
        try:
            tag, payload = child.ask(request, deadline, abandoned)
        except _Timeout:  # past the deadline, or nobody waits: the child is killed, its slot freed
            self._drop(child)
            self._refill()
            assert running is not None
            raise CompileTimeoutError(running[1]) from None
        except _Died:
            detail = child.exit_detail()
            self._drop(child)
            raise CompileMemoryError(self.backend, self.memory_limit, detail) from None
        except BaseException:
            self._drop(child)
            raise
        self._give_back(child)
        if tag == b"K":
            return payload
        text = payload.decode("utf-8", "replace")
        if tag == b"M":
            raise CompileMemoryError(self.backend, self.memory_limit, f"MemoryError {text}")
        raise ChildRefusedError(text)

    def live_pids(self) -> list[int]:
        """Process ids of the children still running (idle or building)."""
        with self._cond:
            return [child.pid for child in self._children if child.alive()]

    def busy(self) -> int:
        """Children building a grammar now."""
        with self._cond:
            return len(self._children) - len(self._idle)

    def close(self) -> None:
        """End every child (idle or building); later compiles start new ones."""
        with self._cond:
            children = set(self._children)
            self._children.clear()
            self._idle.clear()
            self._slots -= len(children)
            self._cond.notify_all()
        _kill_all(children)

    # -- slots ----------------------------------------------------------------------------------

    def _take(
        self,
        deadline: float | None,
        running: tuple[float, float] | None,
        abandoned: Callable[[], bool],
    ) -> _Child:
        with waiting(), self._cond:
            while True:
                while self._idle:
                    child = self._idle.pop()
                    if child.alive():
                        return child
                    self._forget(child)
                if self._slots < self.max_children and self._warming == 0:
                    self._slots += 1
                    break  # start one here (a child warming up will be the next one's)
                left = _POLL_S if deadline is None else deadline - time.monotonic()
                if left <= 0 or abandoned():
                    assert running is not None
                    raise CompileTimeoutError(running[1])
                self._cond.wait(min(left, _POLL_S))
        return self._start()

    def _start(self) -> _Child:
        """A new child in a slot already counted; frees the slot when it cannot start."""
        try:
            child = _Child(self.module, self.memory_limit, self._setup)
        except BaseException as exc:
            with self._cond:
                self._slots -= 1
                self._cond.notify()
            if isinstance(exc, _Died):
                raise CompileMemoryError(self.backend, self.memory_limit, str(exc)) from None
            raise
        with self._cond:
            self.started += 1
            self._children.add(child)
        return child

    def _refill(self) -> None:
        """Start children in the background until ``warm`` are idle or starting."""
        with self._cond:
            wanted = self._warm - len(self._idle) - self._warming
            wanted = min(wanted, self.max_children - self._slots)
            self._slots += max(wanted, 0)
            self._warming += max(wanted, 0)
        for _ in range(wanted):
            threading.Thread(target=self._prestart, name="espalier-child", daemon=True).start()

    def _prestart(self) -> None:
        child = None
        with contextlib.suppress(Exception):  # the next compile starts one and says why it fails
            child = self._start()
        with self._cond:
            self._warming -= 1
            if child is not None and child in self._children:
                self._idle.append(child)
            self._cond.notify_all()

    def _give_back(self, child: _Child) -> None:
        with self._cond:
            if child in self._children:
                self._idle.append(child)
                self._cond.notify()

    def _drop(self, child: _Child) -> None:
        with self._cond:
            if child in self._children:
                self._forget(child)
                self.killed += 1
        child.kill()

    def _forget(self, child: _Child) -> None:
        """Free ``child``'s slot (called with the lock held)."""
        self._children.discard(child)
        self._slots -= 1
        self._cond.notify()


class InProcessLane:
    """At most ``slots`` in-process compiles of one backend at a time (thread-safe)."""

    def __init__(self, slots: int) -> None:
        self._free = threading.Semaphore(max(1, slots))

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Hold a slot; waits up to the running compile's deadline, or until every caller of
        it left (CompileTimeoutError; the compile itself, once running, is not interrupted)."""
        running = compile_deadline()
        abandoned = abandoned_check()
        with waiting():
            while True:
                left = _POLL_S if running is None else running[0] - time.monotonic()
                if left <= 0 or abandoned():
                    assert running is not None
                    raise CompileTimeoutError(running[1])
                if self._free.acquire(timeout=min(left, _POLL_S)):
                    break
        try:
            yield
        finally:
            self._free.release()


def _kill_all(children: set[_Child]) -> None:
    for child in list(children):
        child.kill()
