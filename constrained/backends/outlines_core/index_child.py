"""The child process that builds outlines-core ``Index`` objects under a memory limit.

Run as ``python -m espalier.constrained.backends.outlines_core.index_child`` by the
outlines-core backend's :class:`~espalier.constrained.compile_pool.ChildPool`; the protocol is
``constrained/compile_child.py``'s: the setup payload is the pickled ``outlines_core.Vocabulary``,
a request is a regex (UTF-8), an answer the pickled ``Index``.

An Index build can take minutes and many GiB for an innocent-looking schema (a 563-byte one with
two ``format`` keywords took 312 s and 7 GiB of peak memory on the Gemma vocabulary before
outlines-core gave up on its DFA size). In the parent it could neither be interrupted nor
bounded. Here the kernel bounds it: the address space is capped (``RLIMIT_AS``) before the
vocabulary is loaded, and the parent kills the child when its caller's deadline passes.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

from espalier.constrained.compile_child import Handler, serve


def setup(vocabulary_bytes: bytes) -> Handler:
    import outlines_core

    vocabulary = pickle.loads(vocabulary_bytes)

    def build(request: bytes) -> bytes:
        index: Any = outlines_core.Index(request.decode("utf-8"), vocabulary)
        return pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL)

    return build


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer, setup)
