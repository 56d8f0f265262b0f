"""llguidance's native closing-path search (``GrammarMatcher.native_closing``).

A request's matcher keeps a *closing base*: a C-API matcher at a prefix of its history that is
never advanced (any thread may clone it; forks share it). Each search clones it, consumes the
rest of the history and the decided token, and runs ``engine/closing``'s greedy search in C
(``native/llg_close.c``, ``native/close.py``); when the history has run
:data:`~espalier.constrained.backends.llguidance.native.close.REBASE_AFTER` tokens past the
base, the search hands back a new base at the history's end. A rollback below the base drops
it (as the tree walk's twin is dropped).

Each matcher also keeps its *own* C-API matcher (``Matcher.closing_own``, not shared with
forks): the state a job's stitch tries are checked on, advanced by each job to the history's end
and handed back, so a decision whose kept path still fits needs no clone.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from espalier.constrained.backends.llguidance.native import close as native_close

if TYPE_CHECKING:
    from espalier.constrained.backends.llguidance.native.capi import NativeTokenizerSlot
    from espalier.constrained.base import ClosingRules, NativeClosing

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


def closing_of(
    matcher: Any, token: int | None, limit: int, keys: int, tries: Sequence[Sequence[int]] = ()
) -> LlgClosing | None:
    """``Matcher.native_closing``: a search from ``matcher``'s state (its stitch ``tries``
    first), or None while it has no C-API base (the native tokenizer not built yet, or the
    grammar refused there)."""
    if matcher.native.is_error():
        return None
    base = matcher.closing_base
    if base is None:
        start = matcher.compiled.native_start()
        if start is None:
            return None
        base = matcher.closing_base = (start, 0)
    length = len(matcher.history)
    own = matcher.closing_own
    since = own[1] if own is not None else base[1]
    job = native_close.CloseJob(
        base=base[0],
        sync=matcher.history[since:],
        length=length,
        token=token,
        limit=limit,
        stop_depth=matcher._stop_depth,
        keys=keys,
        rebase=length - base[1] >= native_close.REBASE_AFTER,
        own=own[0] if own is not None else None,
        tries=tries,
    )
    return LlgClosing(matcher, job)


def run_closing(
    rules: ClosingRules, searches: Sequence[NativeClosing], threads: int
) -> list[object]:
    """``NativeClosing.kind`` of :class:`LlgClosing`: one native call per tokenizer."""
    outcomes: list[object] = [None] * len(searches)
    groups: dict[int, list[int]] = {}
    owners: set[int] = set()
    jobs: list[LlgClosing] = []
    for i, search in enumerate(searches):
        assert isinstance(search, LlgClosing)
        if search.job.own is not None and id(search.matcher) in owners:
            search = _without_own(search)  # its own is another job's in this call
        owners.add(id(search.matcher))
        jobs.append(search)
        groups.setdefault(id(search.matcher.compiled.native_slot), []).append(i)
    for members in groups.values():
        mine = [jobs[i] for i in members]
        tables = _tables_for(rules, mine[0].matcher)
        results = native_close.run_jobs(tables, [s.job for s in mine], threads)
        for i, search, result in zip(members, mine, results):
            outcomes[i] = result.outcome
            _install(search, result)
    return outcomes


def _without_own(search: LlgClosing) -> LlgClosing:
    """``search`` from the base instead of its matcher's own."""
    matcher, job = search.matcher, search.job
    base = matcher.closing_base
    assert base is not None
    sync = matcher.history[base[1] :]
    return LlgClosing(matcher, job._replace(own=None, sync=sync))


def _install(search: Any, result: native_close.JobResult) -> None:
    """The new base and own matcher at the job's history end, unless the matcher moved on
    differently (searches run on the matcher's thread); a failed job drops its own."""
    matcher, job = search.matcher, search.job
    kept = matcher.closing_own
    if kept is not None and job.own is not None and kept[0] is job.own:
        matcher.closing_own = None  # advanced in C: recorded again below where it is known
    if len(matcher.history) != job.length:
        return
    if result.base is not None:
        matcher.closing_base = (result.base, job.length)
    if result.own is not None:
        matcher.closing_own = (result.own, job.length)


def _tables_for(rules: ClosingRules, matcher: Any) -> native_close.CloseTables:
    slot: NativeTokenizerSlot = matcher.compiled.native_slot
    key = (id(rules), id(slot))
    with _tables_lock:
        kept = _tables.get(key)
        if kept is not None and kept[0] is rules and kept[1] is slot:
            return kept[2]
        tokenizer = matcher.compiled.tokenizer
        tables = native_close.CloseTables(
            rules,
            slot.tables,
            tokenizer.tokenizer_vocab_size,
            tokenizer.vocab_size,
            tokenizer.stop_token_ids[0],  # llguidance's EOS (Matcher._eos)
        )
        if len(_tables) >= 64:
            _tables.clear()
        _tables[key] = (rules, slot, tables)  # holds both: their ids are not reused meanwhile
        return tables
