"""Many closing decisions at once, their searches in one native call per wave.

``BudgetCloser.decision`` is a decision as steps: it yields each closing-path search it needs.
:func:`answer_all` runs many such decisions side by side: each wave collects the search every
unfinished decision waits for, makes all of those the backends can run natively in one call per
kind (``GrammarMatcher.native_closing``: llguidance's C search, on up to ``threads`` native
threads, the GIL released), the rest one by one in Python (``ClosingPaths.search_after``), and
sends each decision its outcome. The outcomes are those of making each decision alone; each
one is handed over (``done``) as soon as its decision ends, not after the last wave.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Hashable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from espalier.constrained.base import FALLBACK

if TYPE_CHECKING:
    from espalier.engine.closing import ClosingPaths, SearchCall

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")
Answer = tuple[bool, "list[int] | None"]


def as_answer(outcome: object) -> tuple[bool, list[int] | None]:
    """A native search's outcome (not FALLBACK) as ``ClosingPaths.search_after`` answers:
    whether the token was accepted, and the path."""
    return outcome is not False, outcome if isinstance(outcome, list) else None


def answer_all(
    paths: ClosingPaths,
    decisions: Mapping[K, Generator[SearchCall, Answer, R]],
    threads: int,
    done: Callable[[K, R | BaseException], None] | None = None,
) -> dict[K, R | BaseException]:
    """Each decision's outcome by its key (``BudgetCloser.decision``s, or
    ``ahead.tree_decisions``), or the exception it raised (its grammar's: the others go on).
    ``done(key, outcome)``: called on this thread as each decision ends, before the next one
    is advanced (a lookahead's consumer takes a tree's decisions while others still search)."""
    results: dict[K, R | BaseException] = {}
    waiting: dict[K, tuple[Generator[SearchCall, Answer, R], SearchCall]] = {}

    def advance(
        key: K, decision: Generator[SearchCall, Answer, R], answer: Answer | BaseException | None
    ) -> None:
        outcome: R | BaseException
        try:
            if isinstance(answer, BaseException):
                decision.close()
                outcome = answer
            else:
                waiting[key] = (
                    decision,
                    next(decision) if answer is None else decision.send(answer),
                )
                return
        except StopIteration as finished:
            outcome = finished.value
        except Exception as exc:  # its grammar's fault alone
            outcome = exc
        results[key] = outcome
        if done is not None:
            done(key, outcome)

    for key, decision in decisions.items():
        advance(key, decision, None)
    while waiting:
        answers = _search_all(paths, {key: call for key, (_, call) in waiting.items()}, threads)
        current, waiting = waiting, {}
        for key, (decision, _) in current.items():
            advance(key, decision, answers[key])
    return results


def _search_all(
    paths: ClosingPaths, calls: Mapping[K, SearchCall], threads: int
) -> dict[K, tuple[bool, list[int] | None] | BaseException]:
    """``paths.search_after`` of every call: the native ones in one call per kind, then
    ``paths.or_fallback`` where the greedy search found no path."""
    answers: dict[K, tuple[bool, list[int] | None] | BaseException] = {}
    kinds: dict[Any, list[tuple[K, Any]]] = {}
    python: list[K] = []
    for key, call in calls.items():
        try:
            native = call.matcher.native_closing(call.token, call.limit)
        except Exception as exc:
            answers[key] = exc
            continue
        if native is None:
            python.append(key)
        else:
            kinds.setdefault(native.kind, []).append((key, native))
    for kind, members in kinds.items():
        try:
            outcomes = kind(paths.rules, [native for _, native in members], threads)
        except Exception as exc:  # the native call as a whole: search those in Python
            log.debug("native closing batch failed; searching in Python", exc_info=exc)
            outcomes = [FALLBACK] * len(members)
        for (key, _), outcome in zip(members, outcomes):
            if outcome is FALLBACK:
                python.append(key)
            else:
                answers[key] = as_answer(outcome)
    for key in python:
        call = calls[key]
        try:
            answers[key] = paths.python_search_after(call.matcher, call.token, call.limit)
        except Exception as exc:
            answers[key] = exc
    for key, answer in answers.items():  # where the greedy search found none: the fallback
        if isinstance(answer, BaseException):
            continue
        call = calls[key]
        try:
            answers[key] = paths.or_fallback(
                call.matcher, call.token, call.limit, answer, call.fallback
            )
        except Exception as exc:
            answers[key] = exc
    return answers
