"""Appends deferred into the next step, so a step's host work overlaps the next forward.

A step ends with the engine appending each request's new tokens (``Engine._append``): grammar
accepts, the budget closer's decisions (``engine/closing.py``), stops, detokenization. At
batch 32 on the H200 that was 3.0-4.6 ms per speculative step for constrained requests against
0.5-0.7 unconstrained (``bench/gpu_timeline.py``, run 50), on the engine thread between the
GPU's forwards. None of it is needed to *launch* the next forward: the scheduler and the
drafters need only the tokens (grammar-forced chains aside), the grammar is needed by the
next step's mask fills, which start after the launch (``SpecConfig.launch_first``).

So, when the strategy supports it (``StepStrategy.defers_appends``), a request that surely goes
on after its new tokens (no stop token among them, below max_tokens and the model's length)
only has them added to ``output_ids`` (:meth:`Engine._defer`); the rest of the append runs in
the next step right after its forward is launched and before its mask fills start
(``settle``, passed to ``StepStrategy.execute``): request by request, each one just before
its mask fill is released to the mask threads (``MaskBuilder.submit``'s ``prepare``), so the
fills of the requests settled first run while the engine thread settles the others. Requests
whose drafters read the grammar (forced chains) are settled before drafting instead.
A fill that llguidance's native walk can make from the request's C-API twin, as if the deferred
tokens were accepted (``constrained.traverse.walker_after``), does not wait: it starts with the
first ones, and its request is settled once the step's masks are ready
(``decoder.SETTLE_AFTER_MASKS``), so the settles' Python does not hold the GIL the fills'
Python waits for.

Settling either appends exactly the tokens already added (the request goes on) or finishes
the request (the closer closed it, the grammar terminated, a stop string matched): then the
next step's work for it is dropped, and its chunk says where it ended, as without deferral.
Chunks come out one step later; the tokens and finish reasons are the same.

Off by default (``SpecConfig.defer_appends``): on the H200 at batch 32 (8B shape, oracle
drafts, ``bench/gpu_timeline.py`` runs 52-57) it did not move the constrained/unconstrained
speculative ratio (0.770 mean of 18 passes on, 0.770 of 12 off, standard deviation 0.05). The
timeline's clock shows why: settling before the fills makes the masks ready 10-12 ms after
the forward's call (p50) instead of 8-9, when the GPU is done at about 11; and the settled
appends are the same Python as before, on the same GIL, so the step's host time barely
shrinks. Fills started ahead with the settles after the masks (run 69, session 13) made
the masks ready earlier (p50 6.6-8.5 ms) but not the step: the settles then delay the
verification instead (verified p50 12.7-17.5 ms, against 12.3-15.6 off), and the ratio did
not improve (on 0.603 in the cold first pass, then 0.750; settles first 0.619, 0.756; off
0.774, 0.841). It is kept as an option,
tested (``tests/engine/test_engine_deferred.py``), for hosts where the forward is long
against the appends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from espalier.engine.request import Request
    from espalier.engine.step import SeqOutcome


@dataclass(frozen=True)
class Deferred:
    """One deferred append: the step's ``outcome`` for ``request``, whose tokens sit in
    ``request.output_ids[start:]`` without the rest of the append."""

    request: Request
    outcome: SeqOutcome
    start: int


class DeferredAppends:
    """The appends deferred from the last step, in the order they were made (one per
    request at most)."""

    def __init__(self) -> None:
        self._items: dict[str, Deferred] = {}

    def __bool__(self) -> bool:
        return bool(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, request: Request, outcome: SeqOutcome, start: int) -> None:
        assert request.request_id not in self._items, "one deferred append per request"
        self._items[request.request_id] = Deferred(request, outcome, start)

    def take(self, which: Callable[[Request], bool] | None = None) -> list[Deferred]:
        """Remove and return the items whose request ``which`` selects (default: all)."""
        if which is None:
            taken = list(self._items.values())
            self._items.clear()
            return taken
        taken = [d for d in self._items.values() if which(d.request)]
        for item in taken:
            del self._items[item.request.request_id]
        return taken

    def take_for(self, request: Request) -> list[Deferred]:
        """Remove and return ``request``'s item ([] when it has none)."""
        item = self._items.pop(request.request_id, None)
        return [] if item is None else [item]

    def tokens(self, request: Request) -> list[int]:
        """``request``'s deferred tokens (in its ``output_ids``; [] when it has no item)."""
        item = self._items.get(request.request_id)
        return [] if item is None else request.output_ids[item.start :]


@dataclass(frozen=True)
class Settler:
    """What a strategy gets as ``settle`` (``engine/step.py``'s ``Settle``): the engine's
    settle of one request (None: all), and the deferred tokens of each."""

    settle: Callable[[Request | None], None]
    appends: DeferredAppends

    def __call__(self, request: Request | None) -> None:
        self.settle(request)

    def unsettled(self, request: Request) -> list[int]:
        return self.appends.tokens(request)
