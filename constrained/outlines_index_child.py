"""The child process that builds outlines-core ``Index`` objects under a memory limit.

Run as ``python -m espalier.constrained.outlines_index_child`` by
:class:`espalier.constrained.backends.outlines_index.IndexBuilder`; it imports only the standard
library and outlines-core (the parent's torch, threads and caches stay out of it).

An Index build can take minutes and many GiB for an innocent-looking schema (a 563-byte one with
two ``format`` keywords took 312 s and 7 GiB of peak memory on the Gemma vocabulary before
outlines-core gave up on its DFA size). In the parent it could neither be interrupted nor
bounded. Here the kernel bounds it: the address space is capped (``RLIMIT_AS``) before the
vocabulary is loaded, and the parent kills the child when its caller's deadline passes.

Protocol on stdin / stdout, little-endian:

- start: ``u64 memory_limit`` (bytes, 0 = none), ``u64 n``, ``n`` bytes of the pickled
  ``outlines_core.Vocabulary``;
- each request: ``u64 n``, ``n`` bytes of the regex (UTF-8);
- each answer: one tag byte, ``u64 n``, ``n`` bytes: ``K`` and the pickled ``Index``, ``E`` and
  the library's error text (UTF-8), or ``M`` and the text of a Python ``MemoryError``. Past the
  limit, outlines-core itself (Rust) aborts the process: the parent sees the pipe close instead.
"""

from __future__ import annotations

import pickle
import resource
import struct
import sys
from typing import BinaryIO

_U64 = struct.Struct("<Q")


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
    head = read_exact(stream, _U64.size)
    return None if head is None else read_exact(stream, _U64.unpack(head)[0])


def write_answer(stream: BinaryIO, tag: bytes, payload: bytes) -> None:
    stream.write(tag + _U64.pack(len(payload)) + payload)
    stream.flush()


def serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    """Cap the address space, load the vocabulary, then answer build requests until EOF."""
    head = read_exact(stdin, _U64.size)
    if head is None:
        return
    limit = _U64.unpack(head)[0]
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import outlines_core

    vocabulary_bytes = read_frame(stdin)
    if vocabulary_bytes is None:
        return
    vocabulary = pickle.loads(vocabulary_bytes)
    del vocabulary_bytes
    while (request := read_frame(stdin)) is not None:
        try:
            index = outlines_core.Index(request.decode("utf-8"), vocabulary)
            payload = pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL)
            del index
        except MemoryError as exc:
            write_answer(stdout, b"M", str(exc).encode("utf-8"))
            continue
        except (ValueError, TypeError, RuntimeError) as exc:  # the library refused the regex
            write_answer(stdout, b"E", str(exc).encode("utf-8"))
            continue
        write_answer(stdout, b"K", payload)
        del payload


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
