"""One request's grammar may not hold every step of its batch: matchers whose masks stay slow fail.

A step waits for its slowest row (plain decoding) or tree root (speculative: a tree's budget
cuts its nodes, never its root). Some grammars make each mask cost hundreds of times the usual
0.02-1 ms: an ambiguous one's parse grows with the text it has read (``s: s s | "a" | "b"``
on llguidance or xgrammar: 50 ms a mask after 100 tokens, 1-4 s after 250), and xgrammar takes
about 2 s for every other mask of lark-parser's ``csv.lark`` on the Gemma vocabulary. Without
a limit, one such request makes every request batched with it that slow.

:class:`FillCosts` times each matcher's fill where one fill is one matcher's (a fill made on
its own) and keeps a debt per matcher: a fill over :data:`SLOW_FILL_S` adds its time past that,
a fill under it halves the debt. A matcher whose debt passes :data:`DEBT_S` fails with
:class:`~espalier.constrained.errors.GrammarCostError` (the engine ends that request; the
server answers INVALID_ARGUMENT, reason GRAMMAR_TOO_COSTLY). So a grammar whose masks keep
growing ends a few dozen tokens past 50 ms a mask, one with 2-s masks at its first, and a load
spike or a cold lexer's first masks (isolated, and far under a second) end nothing.

Once a matcher has been slow (a debt), a single fill of it could still hold the batch for a
long time: its cost grows with the text, and one long token multiplies it (a 20-rule
ambiguous GBNF on xgrammar, Gemma vocabulary: a mask takes 1 s after 8 characters, 7.5 s after
16; a sweep saw 18-67 s). So such a matcher's fills run on a helper thread
(``tree/bounded.start_row_fill``) and are waited for only as long as :meth:`FillCosts.limit`
says, the time past which its charge would fail it anyway; then it fails at that time, not
when the fill returns. A first fill is not bounded: it would cost every
fill a thread hand-off, and a grammar's cost grows from fast to slow a fill at a time.

A library's plain batch call covers many matchers in one time: when its time per round of
its threads is over the limit, its kind is a suspect and the caller fills that kind's matchers
alone, at once on helper threads, each timed and bounded by :meth:`FillCosts.bound`, until
none of them is slow. A tree batch (llguidance's native walk) reports
each tree's time itself, so its trees are charged one by one, as trees filled alone are.
"""

from __future__ import annotations

from collections.abc import Iterable

from espalier.constrained.errors import GrammarCostError

SLOW_FILL_S = 0.05
"""A timed fill over this many seconds is slow."""

DEBT_S = 1.0
"""A matcher whose slow fills' time past :data:`SLOW_FILL_S` (halved at each fast fill) sums
past this fails."""


class FillCosts:
    """The debt of each matcher (keyed by identity), and the batch kinds under suspicion. Each
    matcher is charged by one thread at a time; :meth:`keep` runs between steps."""

    def __init__(self, slow_s: float | None = None, debt_s: float | None = None) -> None:
        """slow_s, debt_s: the limits (None: :data:`SLOW_FILL_S`, :data:`DEBT_S`)."""
        self.slow_s = SLOW_FILL_S if slow_s is None else slow_s
        self.debt_s = DEBT_S if debt_s is None else debt_s
        self._debts: dict[int, float] = {}
        self._suspects: set[object] = set()

    def charge(self, matcher: object, seconds: float) -> GrammarCostError | None:
        """Record one fill of ``matcher`` that took ``seconds`` (its own alone); the error to
        end its request with when this puts its debt past :attr:`debt_s`, else None."""
        key = id(matcher)
        debt = self._debts.get(key, 0.0)
        if seconds <= self.slow_s:
            if debt:
                self._debts[key] = debt / 2 if debt > 1e-4 else 0.0
            return None
        debt += seconds - self.slow_s
        if debt <= self.debt_s:
            self._debts[key] = debt
            return None
        self._debts.pop(key, None)
        return GrammarCostError(seconds, self.slow_s, debt)

    @property
    def watching(self) -> bool:
        """Whether any matcher has a debt (else :meth:`limit` is None for every one)."""
        return bool(self._debts)

    def limit(self, matcher: object, budget_s: float = 0.0) -> float | None:
        """For a matcher with a debt: the seconds past which one fill of it (charged as its
        time past ``budget_s``) would fail it, so it may be abandoned then; None without one
        (a fill that need not be bounded)."""
        if not self._debts.get(id(matcher)):
            return None
        return budget_s + self.bound(matcher)

    def bound(self, matcher: object) -> float:
        """The seconds past which one fill of ``matcher`` would fail it, debt or not (its
        :meth:`limit` where it has a debt)."""
        return self.slow_s + self.debt_s - self._debts.get(id(matcher), 0.0)

    def abandoned(self, matcher: object, seconds: float) -> GrammarCostError:
        """A bounded fill of ``matcher`` overran its :meth:`limit` (``seconds`` so far): the
        error to end its request with."""
        debt = self._debts.pop(id(matcher), 0.0) + seconds - self.slow_s
        return GrammarCostError(seconds, self.slow_s, debt, unfinished=True)

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
        """Forget the matchers not in ``matchers`` (a request out of the step starts again).
        Called every step: nothing to do (no debt kept, the usual case) costs one test."""
        if not self._debts:
            return
        live = {id(m) for m in matchers}
        for key in [k for k in self._debts if k not in live]:
            del self._debts[key]
