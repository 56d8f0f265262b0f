"""One request's grammar may not hold every step of its batch: matchers whose masks stay slow fail.

A step waits for its slowest row (plain decoding) or tree root (speculative: a tree's budget
cuts its nodes, never its root). An ambiguous grammar's parse grows with the text it has read
(``s: s s | "a" | "b"`` on llguidance or xgrammar: 0.1 ms a mask at first, 1-4 s after 250
tokens), so without a limit one such request makes every request batched with it that slow.
:class:`FillCosts` times each matcher's fill where one fill is one matcher's (a fill made on
its own), and fails a matcher whose last :data:`SLOW_FILLS` timed fills each took over
:data:`SLOW_FILL_S` with :class:`~espalier.constrained.errors.GrammarCostError` (the engine ends
that request; the server answers RESOURCE_EXHAUSTED). A library's batch call covers many
matchers in one time; when one takes over the limit, its kind is a suspect and the caller
fills that kind's matchers one by one, timed, until none of them is slow.

The limit is two orders of magnitude over a normal mask (0.02-1 ms), and it takes several in a
row, so a load spike or one cold lexer does not end a request; a grammar whose cost keeps
growing reaches it within a few hundred tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

from espalier.constrained.errors import GrammarCostError

SLOW_FILL_S = 0.05
"""A timed fill over this many seconds is slow."""

SLOW_FILLS = 8
"""Slow fills in a row that fail a matcher."""


class FillCosts:
    """Slow fills in a row, per matcher (keyed by identity), and the batch kinds under suspicion.
    Each matcher is charged by one thread at a time; :meth:`keep` runs between steps."""

    def __init__(self, slow_s: float | None = None, fills: int | None = None) -> None:
        """slow_s, fills: the limit (None: :data:`SLOW_FILL_S`, :data:`SLOW_FILLS`)."""
        self.slow_s = SLOW_FILL_S if slow_s is None else slow_s
        self.fills = SLOW_FILLS if fills is None else fills
        self._runs: dict[int, int] = {}
        self._suspects: set[object] = set()

    def charge(self, matcher: object, seconds: float) -> GrammarCostError | None:
        """Record one fill of ``matcher`` that took ``seconds`` (its own alone); the error to
        end its request with when this makes :attr:`fills` slow ones in a row, else None."""
        key = id(matcher)
        if seconds <= self.slow_s:
            self._runs.pop(key, None)
            return None
        run = self._runs.get(key, 0) + 1
        if run < self.fills:
            self._runs[key] = run
            return None
        self._runs.pop(key, None)
        return GrammarCostError(seconds, self.slow_s, run)

    def batch_took(self, kind: object, seconds: float) -> None:
        """Record a fill of ``kind``'s matchers: a batch call's time, or the slowest of their
        fills one by one. Over the limit: a suspect (filled one by one next time); else not."""
        if seconds > self.slow_s:
            self._suspects.add(kind)
        else:
            self._suspects.discard(kind)

    def suspect(self, kind: object) -> bool:
        """Whether ``kind``'s matchers should be filled one by one, timed."""
        return kind in self._suspects

    def keep(self, matchers: Iterable[object]) -> None:
        """Forget the matchers not in ``matchers`` (a request out of the step starts again)."""
        live = {id(m) for m in matchers}
        for key in [k for k in self._runs if k not in live]:
            del self._runs[key]
