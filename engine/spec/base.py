"""The drafter protocol: a drafter proposes, per request, a draft tree after the verified tokens.

Drafters are batched (a model drafter runs one forward for the whole batch) and may keep
per-request state (an n-gram index, a draft KV cache), dropped by ``release``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from espalier.engine.spec.tree_builder import Draft


@dataclass(frozen=True)
class DraftInput:
    """One request's drafting job.

    context: every verified token (prompt + output); the last one is the tree's root.
    extra: tokens already placed in the tree below the root (a grammar-forced chain): the
        drafter drafts after ``context + extra`` and its draft is grafted at the chain's end.
    budget: most draft nodes to return (the root not counted).
    """

    request_id: str
    context: Sequence[int]
    extra: Sequence[int]
    budget: int


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft trees. Each returned :class:`Draft` is rooted at the last token of
    ``context + extra``, has at most ``budget`` draft nodes, and scores as log-probabilities."""

    name: str

    def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]: ...

    def release(self, request_id: str) -> None:
        """Forget a finished (or preempted) request's state."""
        ...
