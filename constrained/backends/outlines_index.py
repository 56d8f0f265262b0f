"""outlines-core ``Index`` builds in child processes: capped in memory, killed at the deadline.

An Index build is native code that cannot be interrupted from Python, and some take minutes and
many GiB (``constrained/outlines_index_child.py`` has the numbers). On a compile thread of a
:class:`~espalier.constrained.cache.CompileCache` it would be abandoned at its timeout and run on,
and a few of them could take the server's memory. :class:`IndexBuilder` runs each build in a child
process instead:

- the child's address space is capped (``BackendOptions.outlines_memory_limit``): a build past
  it ends the child, and the caller gets :class:`CompileMemoryError`;
- under a cache, the child is killed when the compile's deadline passes
  (:func:`~espalier.constrained.cache.compile_deadline`), so nothing runs on abandoned;
- the built Index comes back pickled (outlines-core serializes it; 0.7 s each way for a 250 MB
  Index on this machine, against 11 s to build it) and children that answered are kept for the
  next build (the vocabulary is sent once per child).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

from espalier.constrained.cache import compile_deadline
from espalier.constrained.errors import (
    CompileMemoryError,
    CompileTimeoutError,
    InvalidGrammarError,
)

CHILD_MODULE = "espalier.constrained.outlines_index_child"
_U64 = struct.Struct("<Q")
_CHUNK = 1 << 20


class _Timeout(Exception):
    """The caller's deadline passed before the child answered."""


class _Died(Exception):
    """The child's pipe closed before it answered."""


class _Child:
    """One child process: started with the memory cap and the vocabulary, then asked builds."""

    def __init__(self, memory_limit: int, vocabulary: bytes) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", CHILD_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # Rust's abort message past the cap: the exit says it
        )
        try:
            self._send(_U64.pack(memory_limit) + _U64.pack(len(vocabulary)))
            self._send(vocabulary)
        except _Died:  # it ended at start (a limit too small to start the interpreter in)
            detail = self.exit_detail()
            self.kill()
            raise _Died(f"its child process ended at start, {detail}") from None

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def ask(self, regex: str, deadline: float | None) -> tuple[bytes, bytes]:
        """``(tag, payload)`` of the child's answer for ``regex`` (module protocol)."""
        data = regex.encode("utf-8")
        self._send(_U64.pack(len(data)) + data)
        head = self._read(1 + _U64.size, deadline)
        return head[:1], self._read(_U64.unpack(head[1:])[0], deadline)

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

    def close(self) -> None:
        """End an idle child: at the end of its stdin it exits."""
        self._close_pipes()
        try:
            self.process.wait(5.0)
        except subprocess.TimeoutExpired:
            self.kill()

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

    def _read(self, n: int, deadline: float | None) -> bytes:
        """``n`` bytes of the child's stdout (its raw pipe, so ``select`` sees every byte)."""
        stdout = self.process.stdout
        assert stdout is not None
        fd = stdout.fileno()
        data = bytearray(n)
        view = memoryview(data)
        got = 0
        while got < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise _Timeout
            read = os.readv(fd, [view[got : got + _CHUNK]])
            if read == 0:
                raise _Died
            got += read
        return bytes(data)


class IndexBuilder:
    """Builds ``outlines_core.Index`` objects in child processes (thread-safe).

    Args:
        vocabulary: the backend's ``outlines_core.Vocabulary`` (pickled once, sent to each child).
        memory_limit: each child's address-space cap in bytes.
        max_idle: children kept for later builds after they answered.
    """

    backend = "outlines_core"

    def __init__(self, vocabulary: Any, memory_limit: int, max_idle: int = 2) -> None:
        self.memory_limit = memory_limit
        self.max_idle = max_idle
        self.started = 0
        self.killed = 0
        self._vocabulary = pickle.dumps(vocabulary, protocol=pickle.HIGHEST_PROTOCOL)
        self._lock = threading.Lock()
        self._idle: list[_Child] = []
        self._children: set[_Child] = set()
        weakref.finalize(self, _kill_all, self._children)

    def build(self, regex: str, kind: str) -> Any:
        """The Index of ``regex``; raises :class:`InvalidGrammarError` when outlines-core refuses
        it (``kind`` names the grammar kind in the error), :class:`CompileMemoryError` past the
        memory cap, :class:`CompileTimeoutError` when a cache's deadline passed first."""
        running = compile_deadline()
        try:
            child = self._take()
        except _Died as died:
            raise CompileMemoryError(self.backend, self.memory_limit, str(died)) from None
        try:
            tag, payload = child.ask(regex, None if running is None else running[0])
        except _Timeout:
            self._drop(child)
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
            return pickle.loads(payload)
        text = payload.decode("utf-8", "replace")
        if tag == b"M":
            raise CompileMemoryError(self.backend, self.memory_limit, f"MemoryError {text}")
        raise InvalidGrammarError(kind, text)

    def live_pids(self) -> list[int]:
        """Process ids of the children still running (idle or building)."""
        with self._lock:
            return [child.pid for child in self._children if child.alive()]

    def close(self) -> None:
        """End every child (idle ones exit, building ones are killed)."""
        with self._lock:
            children = list(self._children)
            self._children.clear()
            self._idle.clear()
        _kill_all(set(children))

    def _take(self) -> _Child:
        with self._lock:
            while self._idle:
                child = self._idle.pop()
                if child.alive():
                    return child
                self._children.discard(child)
            self.started += 1
        child = _Child(self.memory_limit, self._vocabulary)
        with self._lock:
            self._children.add(child)
        return child

    def _give_back(self, child: _Child) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(child)
                return
            self._children.discard(child)
        child.close()

    def _drop(self, child: _Child) -> None:
        with self._lock:
            self._children.discard(child)
            self.killed += 1
        child.kill()


def _kill_all(children: set[_Child]) -> None:
    for child in list(children):
        child.kill()
