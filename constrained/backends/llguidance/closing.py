"""llguidance's native closing-path search (``GrammarMatcher.native_closing``).

A request's matcher keeps a *closing base*: a C-API matcher at a prefix of its history that is
never advanced (any thread may clone it; forks share it). Each search clones it, consumes the
rest of the history and the decided token, and runs ``engine/closing``'s greedy search in C
(``native/llg_close.c``, ``native/close.py``); when the history has run
:data:`~espalier.constrained.backends.llguidance.native.close.REBASE_AFTER` tokens past the
base, the search hands back a new base at the history's end. A rollback below the base drops
it (as the tree walk's twin is dropped). Where the tree walk's twin is at the very state searched
from (a speculative step's lookahead, after the step's walk; the twin is not walked again before
the next step), the job clones the twin instead: nothing to replay, no base to hand back.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from espalier.constrained.backends.llguidance.native import close as native_close

if TYPE_CHECKING:
    from espalier.constrained.backends.llguidance.native.capi import NativeTokenizerSlot
    from espalier.constrained.base import ClosingRules, ClosingTree, NativeClosing, NodeDecision

_tables: dict[tuple[int, int], tuple[object, object, native_close.CloseTables]] = {}
_tables_lock = threading.Lock()


@dataclass(frozen=True)
class LlgClosing:
    """One search on an llguidance matcher (``NativeClosing``): ``job`` from ``matcher``."""

    matcher: Any  # backends/llguidance Matcher (the base is installed on it)
    job: native_close.CloseJob

    @property
    def kind(self) -> Any:
        return run_closing

    @property
    def trees(self) -> Any:
        return run_trees


def closing_of(matcher: Any, token: int | None, limit: int, keys: int) -> LlgClosing | None:
    """``Matcher.native_closing``: a search from ``matcher``'s state, or None while it has no
    C-API base (the native tokenizer not built yet, or the grammar refused there)."""
    if matcher.native.is_error():
        return None
    length = len(matcher.history)
    origin = matcher.origin
    twin = matcher.twin if origin is None else origin.twin
    if (
        twin is not None
        and twin.length == length
        and (origin is None or origin.history == matcher.history)
    ):
        # the tree walk's twin is at this very state (the step's walk caught it up, and
        # nothing walks it until the next step): clone it, nothing to replay or rebase
        job = native_close.CloseJob(
            twin.native, (), length, token, limit, matcher._stop_depth, keys, False
        )
        return LlgClosing(matcher, job)
    base = matcher.closing_base
    if base is None:
        start = matcher.compiled.native_start()
        if start is None:
            return None
        base = matcher.closing_base = (start, 0)
    job = native_close.CloseJob(
        base=base[0],
        sync=matcher.history[base[1] :],
        length=length,
        token=token,
        limit=limit,
        stop_depth=matcher._stop_depth,
        keys=keys,
        rebase=length - base[1] >= native_close.REBASE_AFTER,
    )
    return LlgClosing(matcher, job)


def run_closing(
    rules: ClosingRules, searches: Sequence[NativeClosing], threads: int
) -> list[object]:
    """``NativeClosing.kind`` of :class:`LlgClosing`: one native call per tokenizer."""
    outcomes: list[object] = [None] * len(searches)
    groups: dict[int, list[int]] = {}
    for i, search in enumerate(searches):
        assert isinstance(search, LlgClosing)
        groups.setdefault(id(search.matcher.compiled.native_slot), []).append(i)
    for members in groups.values():
        mine = [search for i in members if isinstance(search := searches[i], LlgClosing)]
        tables = _tables_for(rules, mine[0].matcher)
        found, bases = native_close.run_jobs(tables, [s.job for s in mine], threads)
        for i, search, outcome, base in zip(members, mine, found, bases):
            outcomes[i] = outcome
            if base is not None:
                _install(search, base)
    return outcomes


def run_trees(
    rules: ClosingRules, items: Sequence[tuple[NativeClosing, ClosingTree]], threads: int
) -> list[list[NodeDecision | None] | object]:
    """``NativeClosing.trees`` of :class:`LlgClosing`: one native call per tokenizer."""
    outcomes: list[list[NodeDecision | None] | object] = [None] * len(items)
    groups: dict[int, list[int]] = {}
    for i, (search, _) in enumerate(items):
        assert isinstance(search, LlgClosing)
        groups.setdefault(id(search.matcher.compiled.native_slot), []).append(i)
    for members in groups.values():
        jobs = []
        for i in members:
            search, tree = items[i]
            assert isinstance(search, LlgClosing)
            jobs.append((search.job, search.matcher._eos, tree))
        first = items[members[0]][0]
        assert isinstance(first, LlgClosing)
        tables = _tables_for(rules, first.matcher)
        found, bases = native_close.run_tree_jobs(tables, rules.policy, jobs, threads)
        for i, outcome, base in zip(members, found, bases):
            outcomes[i] = outcome
            if base is not None:
                _install(items[i][0], base)
    return outcomes


def _install(search: Any, base: Any) -> None:
    """A new base at the job's history end, on its matcher unless that moved on (searches run
    on the matcher's thread), and on the matcher it was forked from where that one's history
    is exactly the job's (a draft tree's job runs on a fork of the request's matcher, on
    another thread, while the request's matcher waits for the step's decisions)."""
    matcher, job = search.matcher, search.job
    if len(matcher.history) != job.length:
        return
    matcher.closing_base = (base, job.length)
    origin = matcher.origin
    if origin is not None and origin.history == matcher.history:
        origin.closing_base = (base, job.length)


def _tables_for(rules: ClosingRules, matcher: Any) -> native_close.CloseTables:
    slot: NativeTokenizerSlot = matcher.compiled.native_slot
    key = (id(rules), id(slot))
    with _tables_lock:
        kept = _tables.get(key)
        if kept is not None and kept[0] is rules and kept[1] is slot:
            return kept[2]
        tokenizer = matcher.compiled.tokenizer
        tables = native_close.CloseTables(
            rules, slot.tables, tokenizer.tokenizer_vocab_size, tokenizer.vocab_size
        )
        if len(_tables) >= 64:
            _tables.clear()
        _tables[key] = (rules, slot, tables)  # holds both: their ids are not reused meanwhile
        return tables
