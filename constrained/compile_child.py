"""The wire protocol of compile child processes, and the loop a child runs (standard library only).

A child (``python -m espalier.constrained.<backend>_child``) builds one backend's grammars where
the parent can kill it (``constrained/compile_pool.py``). It imports only the standard library,
this module and its grammar library: the parent's torch, threads and caches stay out of it.

Protocol on stdin / stdout, little-endian:

- start: ``u64 memory_limit`` (bytes, 0 = none), then one frame: the backend's setup payload
  (its vocabulary in the library's own serialized form);
- each request: one frame (the backend's request payload);
- each answer: one tag byte and one frame: ``K`` and the compiled grammar in the library's own
  serialized form, ``E`` and the library's error text (UTF-8), or ``M`` and the text of a Python
  ``MemoryError``. Past the limit a native library may abort the process instead: the parent
  sees the pipe close.

A frame is ``u64 n`` then ``n`` bytes.

A child ends when its stdin closes: between requests at the read, and during a build through a
watcher thread (the parent died or gave up; the libraries release the GIL while they build).
"""

from __future__ import annotations

import os
import resource
import select
import struct
import threading
from collections.abc import Callable
from typing import BinaryIO

U64 = struct.Struct("<Q")

Handler = Callable[[bytes], bytes]
"""Builds one answer payload from one request payload; raises ValueError / TypeError /
RuntimeError when the library refuses the grammar."""


def read_exact(stream: BinaryIO, n: int) -> bytes | None:
    """``n`` bytes from ``stream``, or None at its end."""
    data = bytearray()
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def read_frame(stream: BinaryIO) -> bytes | None:
    """One length-prefixed frame, or None at the stream's end."""
    head = read_exact(stream, U64.size)
    return None if head is None else read_exact(stream, U64.unpack(head)[0])


def write_answer(stream: BinaryIO, tag: bytes, payload: bytes) -> None:
    stream.write(tag + U64.pack(len(payload)) + payload)
    stream.flush()


def serve(stdin: BinaryIO, stdout: BinaryIO, setup: Callable[[bytes], Handler]) -> None:
    """Cap the address space, build the handler from the setup frame, answer until EOF."""
    head = read_exact(stdin, U64.size)
    if head is None:
        return
    limit = U64.unpack(head)[0]
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    payload = read_frame(stdin)
    if payload is None:
        return
    handle = setup(payload)
    del payload
    threading.Thread(target=_exit_when_closed, args=(stdin.fileno(),), daemon=True).start()
    while (request := read_frame(stdin)) is not None:
        try:
            answer = handle(request)
        except MemoryError as exc:
            write_answer(stdout, b"M", str(exc).encode("utf-8"))
            continue
        except (ValueError, TypeError, RuntimeError) as exc:  # the library refused the grammar
            write_answer(stdout, b"E", str(exc).encode("utf-8"))
            continue
        write_answer(stdout, b"K", answer)
        del answer


def _exit_when_closed(fd: int) -> None:
    """Exit the process once every writer of ``fd`` (a pipe) is gone; reads nothing."""
    poller = select.poll()
    poller.register(fd, 0)  # POLLHUP and POLLERR are always reported
    while True:
        for _, events in poller.poll():
            if events & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                os._exit(0)
