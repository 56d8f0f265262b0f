"""The child process that builds outlines-core ``Index`` objects under a memory limit.

Run as ``python -m espalier.constrained.backends.outlines_core.index_child`` by the
outlines-core backend's :class:`~espalier.constrained.compile_pool.ChildPool`; the protocol is
``constrained/compile_child.py``'s: the setup payload is the pickled ``outlines_core.Vocabulary``;
a request is ``I`` and a regex (UTF-8), answered by the pickled ``Index``, or ``R`` and a JSON
array ``[schema text, whitespace regex]``, answered by outlines-core's regex for the schema
(UTF-8; at most :data:`MAX_REGEX_BYTES`, else refused).

An Index build can take minutes and many GiB for an innocent-looking schema (a 563-byte one with
two ``format`` keywords took 312 s and 7 GiB of peak memory on the Gemma vocabulary before
outlines-core gave up on its DFA size). In the parent it could neither be interrupted nor
bounded. Here the kernel bounds it: the address space is capped (``RLIMIT_AS``) before the
vocabulary is loaded, and the parent kills the child when its caller's deadline passes. A
schema's regex is built here too: it doubles with each level of some nestings (25 levels of
``{"type": "array", "items": ..., "maxItems": 1}``, under 1.5 KB, asked for 3.6 GB at once and
aborted the process that built it).
"""

from __future__ import annotations

import json
import pickle
import sys
from typing import Any

from espalier.constrained.compile_child import Handler, serve

INDEX_REQUEST = b"I"
REGEX_REQUEST = b"R"
MAX_REGEX_BYTES = 64 << 20
"""A schema's regex past this is refused: its Index would not fit the memory limit anyway."""


def setup(vocabulary_bytes: bytes) -> Handler:
    import outlines_core

    vocabulary = pickle.loads(vocabulary_bytes)

    def build(request: bytes) -> bytes:
        kind, body = request[:1], request[1:].decode("utf-8")
        if kind == REGEX_REQUEST:
            source, whitespace = json.loads(body)
            regex: str = outlines_core.json_schema.build_regex_from_schema(source, whitespace)
            answer = regex.encode("utf-8")
            if len(answer) > MAX_REGEX_BYTES:
                raise ValueError(
                    f"outlines-core's regex for this schema is {len(answer)} bytes, over "
                    f"{MAX_REGEX_BYTES}"
                )
            return answer
        index: Any = outlines_core.Index(body, vocabulary)
        return pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL)

    return build


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer, setup)
