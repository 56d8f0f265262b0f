"""llguidance's native closing-path search (``GrammarMatcher.native_closing``).

Each search clones a C-API matcher, consumes the decided token and runs ``engine/closing``'s
greedy search in C (``native/llg_close.c``, ``native/close.py``). A matcher's search clones the
matcher itself. A lazy fork (``Matcher.fork``: the closing lookahead's, which runs on the mask
threads) has no C-API matcher of its own: its search clones the *closing base* it shares with
its source (a C-API matcher at a prefix of the history that is never advanced, so any thread may
clone it; the step's tree walk snapshots the source for it, ``Matcher.took_snapshot``) and
consumes the rest of the history first; when that rest has reached
:data:`~espalier.constrained.backends.llguidance.native.close.REBASE_AFTER` tokens, the search
hands back a new base at the history's end.
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
    """``Matcher.native_closing``: a search from ``matcher``'s state. A matcher with its own
    C-API matcher is cloned in the search (the caller waits for it, so nothing advances it
    meanwhile); a lazy fork's search starts from its closing base and replays the rest of its
    history, and hands back a new base once that is long."""
    length = len(matcher.history)
    if matcher.materialized:
        if matcher.mask_memo_stale:
            matcher.refresh_mask_memo()  # a clone carries the memo along
        native = matcher.native
        if native.is_error():
            return None
        job = native_close.CloseJob(
            native, (), length, token, limit, matcher._stop_depth, keys, False
        )
        return LlgClosing(matcher, job)
    base = matcher.closing_base
    origin = matcher.origin
    fresh = origin.closing_base if origin is not None else None
    if fresh is not None and fresh[1] == length and origin.history == matcher.history:
        base = fresh  # a walk's snapshot of the source at this very state, taken since the fork
    assert base is not None  # a lazy fork always has one
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
