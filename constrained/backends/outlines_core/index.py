"""outlines-core ``Index`` builds in child processes: capped in memory, killed at the deadline.

An Index build is native code that cannot be interrupted from Python, and some take minutes and
many GiB (``index_child.py`` has the numbers). On a compile thread of a
:class:`~espalier.constrained.cache.CompileCache` it would be abandoned at its timeout and run on,
and a few of them could take the server's memory. :class:`IndexBuilder` runs each build in a child
process of a :class:`~espalier.constrained.compile_pool.ChildPool` instead:

- the child's address space is capped (``BackendOptions.outlines_memory_limit``): a build past
  it ends the child, and the caller gets :class:`CompileMemoryError`;
- under a cache, the child is killed when the compile's deadline passes, so nothing runs on
  abandoned;
- at most ``max_children`` children at once, fewer when the machine's available memory holds
  fewer capped children (four concurrent builds held 2.4 GB each in one test);
- the built Index comes back pickled (outlines-core serializes it; 0.7 s each way for a 250 MB
  Index on this machine, against 11 s to build it) and children that answered are kept for the
  next build (the vocabulary is sent once per child).
"""

from __future__ import annotations

import json
import pickle
from typing import Any

from espalier.constrained.backends.outlines_core.index_child import INDEX_REQUEST, REGEX_REQUEST
from espalier.constrained.compile_pool import ChildPool, ChildRefusedError, memory_bounded_children
from espalier.constrained.errors import InvalidGrammarError
from espalier.constrained.spec import BackendName

CHILD_MODULE = "espalier.constrained.backends.outlines_core.index_child"


class IndexBuilder:
    """Builds ``outlines_core.Index`` objects in child processes (thread-safe).

    Args:
        vocabulary: the backend's ``outlines_core.Vocabulary`` (pickled once, sent to each child).
        memory_limit: each child's address-space cap in bytes.
        max_children: children alive at once (lowered to what available memory holds).
    """

    backend = BackendName.OUTLINES_CORE

    def __init__(self, vocabulary: Any, memory_limit: int, max_children: int = 2) -> None:
        self.memory_limit = memory_limit
        self.pool = ChildPool(
            self.backend,
            CHILD_MODULE,
            pickle.dumps(vocabulary, protocol=pickle.HIGHEST_PROTOCOL),
            memory_limit=memory_limit,
            max_children=memory_bounded_children(memory_limit, max_children),
            warm=0,  # the vocabulary pickle is cheap to send; builds are rarely fast anyway
        )

    @property
    def started(self) -> int:
        return self.pool.started

    @property
    def killed(self) -> int:
        return self.pool.killed

    def build(self, regex: str, kind: str) -> Any:
        """The Index of ``regex``; raises :class:`InvalidGrammarError` when outlines-core refuses
        it (``kind`` names the grammar kind in the error), :class:`CompileMemoryError` past the
        memory cap, :class:`CompileTimeoutError` when a cache's deadline passed first."""
        return pickle.loads(self._ask(INDEX_REQUEST + regex.encode("utf-8"), kind))

    def schema_regex(self, source: str, whitespace: str, kind: str) -> str:
        """outlines-core's regex for the JSON schema text ``source``, built in a child (it may
        need more memory than the cap); raises as :meth:`build` does."""
        request = REGEX_REQUEST + json.dumps([source, whitespace]).encode("utf-8")
        return self._ask(request, kind).decode("utf-8")

    def _ask(self, request: bytes, kind: str) -> bytes:
        try:
            return self.pool.ask(request)
        except ChildRefusedError as refused:
            raise InvalidGrammarError(kind, str(refused)) from None

    def live_pids(self) -> list[int]:
        """Process ids of the children still running (idle or building)."""
        return self.pool.live_pids()

    def close(self) -> None:
        """End every child (idle ones and building ones)."""
        self.pool.close()
