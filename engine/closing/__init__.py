"""Finishing within the token budget: a constrained output that max_tokens would cut is closed.

A constrained request promises output that matches its grammar, and ``max_tokens`` bounds its
length. A model that loops (greedy repetition inside a string or an array: small models do)
would reach max_tokens mid-value and return text that matches nothing. So before a sampled
token is accepted, the engine checks that a *closing path* still fits after it (at every token
of the last :data:`EVERY_TOKEN` of the budget, and before them at checks spaced by the slack
the last path left, so that a path longer than that, a deep nest, is seen in time): a short
token sequence that completes the grammar from the state after the token, plus one stop token.
When it does not, the engine emits the closing path of the current state and a stop token
instead, and the request ends there (``STOP``).
Outputs that finish on their own are untouched, token for token.

:class:`ClosingPaths` finds a closing path greedily on a fork of the matcher: the tokens the
grammar forces where it forces some (``forced_tokens``: required keys, ``":"``), else the first
of a few closers, a separator and minimal JSON values that the grammar accepts (``"``, ``}``,
``]``, ``,``, ``0``, ``null``, ..., then ``{`` and ``[``: a value that may end is ended before
it is lengthened), else the lowest allowed token id that is not whitespace;
at most ``limit`` tokens. Where that walk finds none, a bounded search that chooses object keys
and backtracks tries (``engine/closing/backtrack.py``); None when neither finds one that short
(then nothing changes: the output may be cut, as without this policy).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

import numpy as np

from espalier.constrained import bitmask as bm
from espalier.constrained.base import FALLBACK, ClosingPolicy, ClosingRules
from espalier.engine.closing.ahead import Lookahead, max_depth, native_tree, tree_decisions
from espalier.engine.closing.batch import answer_all, as_answer

if TYPE_CHECKING:
    import torch

    from espalier.constrained.base import GrammarMatcher
    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.engine.request import Request

log = logging.getLogger(__name__)
K = TypeVar("K")
R = TypeVar("R")

CLOSING_WINDOW = 64  # the unit of SEARCH_LIMIT
# Checks are spaced out while more than EVERY_TOKEN tokens are left (see _next_check): a
# token is assumed to lengthen the closing path by at most GROWTH_PER_TOKEN tokens, plus MARGIN.
# (A token that grows it faster there can only leave a path longer than SEARCH_LIMIT unseen.)
GROWTH_PER_TOKEN = 2
MARGIN = 4
SEARCH_LIMIT = 4 * CLOSING_WINDOW  # the longest search (far from the end: look again later)
# tokens before the budget's end in which every token is checked (and, in a draft tree, decided
# ahead on a mask thread): a path as long as a search finds is seen at the token that needs it
EVERY_TOKEN = SEARCH_LIMIT + 2
# a search choosing one token this many times in a row gives up (a loop); closers ("}", "]")
# are exempt: each one ends a container, and a deep nest needs one per level
REPEAT_LIMIT = 16
# a check whose searches found no closing path looks again this many tokens later (a bounded
# search gave up from a date-time field's start where it found a path from the next field on)
RETRY_AFTER = 16
# failed fallback runs (backtracking, novel walk: tens to hundreds of ms of Python each) a request
# makes at its checks; past them its checks search greedily only (natively where they can): ten
# requests no path closes ran them every RETRY_AFTER tokens and held the engine for seconds
FALLBACK_RUNS = 2
START_PATHS = 256  # compiled grammars whose start state's closing path is kept (then cleared)
FIRST_DECISIONS = 4096  # first-token decisions kept (then cleared): see BudgetCloser._first_key
# tried in order where nothing is forced: closers first, a separator, then minimal values
LOWEST_ALLOWED = 64  # where no candidate is accepted: the lowest allowed ids tried
CANDIDATE_TEXTS = ('"', "}", "]", ",", "0", "null", "false", '""', "[]", "{}", ":", "{", "[")


START_BUDGET_S = 2.0
"""Time a grammar's start path search may take (on a matcher thread, once per grammar): past it
the grammar's requests are not closed. rfc.lark on xgrammar fills a mask in 0.12 s past its
start: the search's bounded steps took minutes, and two such requests held both matcher threads
of a 2-core server, so no new grammar got a matcher (a held-out sweep)."""


class Costly:
    """``ClosingPaths.start_path``'s answer where the search ran past :data:`START_BUDGET_S`."""


COSTLY = Costly()


class _PastBudget(Exception):
    pass


class _Budgeted:
    """A matcher whose grammar calls raise :class:`_PastBudget` past ``deadline``
    (``time.monotonic``); its forks share the deadline. Only the start path's search uses one:
    every other search is bounded by counts alone, so its outcome is a function of the state."""

    def __init__(self, inner: GrammarMatcher, deadline: float) -> None:
        self._inner = inner
        self._deadline = deadline

    def _check(self) -> None:
        if time.monotonic() > self._deadline:
            raise _PastBudget

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def fork(self) -> GrammarMatcher:
        self._check()
        return cast("GrammarMatcher", _Budgeted(self._inner.fork(), self._deadline))

    def fill_bitmask(self, *args: Any, **kwargs: Any) -> Any:
        self._check()
        return self._inner.fill_bitmask(*args, **kwargs)

    def accept(self, token: int) -> bool:
        self._check()
        return self._inner.accept(token)

    def accept_tokens(self, tokens: Sequence[int]) -> int:
        self._check()
        return self._inner.accept_tokens(tokens)

    def forced_tokens(self, limit: int) -> list[int]:
        self._check()
        return self._inner.forced_tokens(limit)

    def completes(self, tokens: Sequence[int]) -> bool:
        self._check()
        return self._inner.completes(tokens)


@dataclass(frozen=True)
class SearchCall:
    """A closing-path search a decision needs: from ``matcher``'s state after ``token`` (None:
    from there), at most ``limit`` tokens (``ClosingPaths.search_after``)."""

    matcher: GrammarMatcher
    token: int | None
    limit: int
    fallback: bool = True  # where the greedy search finds none, the fallbacks (``or_fallback``)


class ClosingPaths:
    """Closing paths for one tokenizer (``candidates``: single-token ids of CANDIDATE_TEXTS)."""

    def __init__(self, tokenizer: TokenizerInfo) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.stops = frozenset(tokenizer.stop_token_ids)
        self._token_bytes = tokenizer.token_bytes
        self._encode = tokenizer.encode_text
        self.candidates: list[int] = []
        for text in CANDIDATE_TEXTS:
            ids = tokenizer.encode_text(text)
            if len(ids) == 1 and ids[0] not in self.candidates:
                self.candidates.append(ids[0])
        closing = [tokenizer.encode_text(text) for text in ("}", "]")]
        self.closers = frozenset(ids[0] for ids in closing if len(ids) == 1)
        quote = tokenizer.encode_text('"')
        self.quote = quote[0] if len(quote) == 1 else None
        self._closers_first = [t for t in self.candidates if t in self.closers]
        self._rows = threading.local()  # a scratch bitmask row per thread (lookaheads)
        # whitespace-only ids: a pass over the whole vocabulary (18-20 ms for Gemma's 262k ids
        # here), made at engine start and once per tokenizer, never in a step
        self.blank: frozenset[int] = tokenizer.backend_view(
            "espalier.engine.closing.blank_ids", _blank_ids
        )
        # the same tries for backends that search natively (GrammarMatcher.native_closing)
        self.rules = ClosingRules(
            tuple(self.candidates),
            tuple(self._closers_first),
            self.quote,
            self.closers,
            self.blank,
            REPEAT_LIMIT,
            LOWEST_ALLOWED,
            ClosingPolicy(SEARCH_LIMIT, MARGIN, GROWTH_PER_TOKEN, EVERY_TOKEN),
        )
        from espalier.engine.closing.backtrack import Backtracking  # it imports this module

        self.fallback = Backtracking(self, tokenizer)  # where the greedy search finds none
        from espalier.engine.closing.novel import NovelWalk

        self.novel = NovelWalk(self, tokenizer)  # where that finds none either
        # each compiled grammar's start-path search (at most START_PATHS, then cleared)
        self._start: PerGrammar[tuple[()], Future[list[int] | Costly | None]] = PerGrammar(
            START_PATHS
        )
        self._start_lock = threading.Lock()

    def start_path(self, compiled: object, matcher: GrammarMatcher) -> list[int] | Costly | None:
        """The closing path from the start state of ``compiled`` (``matcher``: a matcher of it
        at that state, not changed), at most :data:`SEARCH_LIMIT` tokens; None: none found;
        :data:`COSTLY`: the search ran past :data:`START_BUDGET_S` (then the grammar's requests
        are not closed: ``BudgetCloser._memo_of``).

        Searched once per compiled grammar and kept (a function of the grammar alone);
        thread-safe: a caller that finds the search running waits for it rather than searching
        again. The grammar service searches it where it makes a request's matcher (a matcher
        thread, ``GrammarService.closing_paths``), so a new grammar's search (up to ~100 ms
        where the greedy walk fails and the fallback backtracks) never runs in an engine step.
        A search that raises is not kept: the next caller searches again."""
        with self._start_lock:
            kept = self._start.find(compiled, ())
            search = kept if kept is not None else Future()
            if kept is None:
                self._start.put(compiled, (), search)
        if kept is None:
            try:
                search.set_result(self._search_start(matcher))
            except BaseException as exc:
                with self._start_lock:
                    self._start.discard(compiled, (), search)
                search.set_exception(exc)
        return search.result()

    def _search_start(self, matcher: GrammarMatcher) -> list[int] | Costly | None:
        budgeted = cast("GrammarMatcher", _Budgeted(matcher, time.monotonic() + START_BUDGET_S))
        try:
            return self.find(budgeted, SEARCH_LIMIT)
        except _PastBudget:
            log.info(
                "closing off for a grammar: its start path search ran past %s s", START_BUDGET_S
            )
            return COSTLY

    def find(self, matcher: GrammarMatcher, limit: int) -> list[int] | None:
        """Tokens (at most ``limit``) after which ``matcher`` can terminate; None if not found.

        ``matcher`` itself is not changed (the search runs on a fork)."""
        if limit < 0:
            return None
        return self.search_after(matcher, None, limit)[1]

    def search_after(
        self, matcher: GrammarMatcher, token: int | None, limit: int, fallback: bool = True
    ) -> tuple[bool, list[int] | None]:
        """:meth:`search` from ``matcher``'s state after ``token`` (None: from here; ``matcher``
        is not changed): whether ``matcher`` accepts ``token``, and the path (None: none within
        ``limit``). Natively where the matcher's backend can (``native_closing``: the same
        choices, the GIL released), else on a fork; where that greedy search finds none,
        :meth:`or_fallback` (unless ``fallback`` is False)."""
        native = matcher.native_closing(token, limit)
        if native is not None:
            outcome = native.kind(self.rules, [native], 1)[0]
            if outcome is not FALLBACK:
                return self.or_fallback(matcher, token, limit, as_answer(outcome), fallback)
        answer = self.python_search_after(matcher, token, limit)
        return self.or_fallback(matcher, token, limit, answer, fallback)

    def python_search_after(
        self, matcher: GrammarMatcher, token: int | None, limit: int
    ) -> tuple[bool, list[int] | None]:
        """The greedy :meth:`search` after ``token``, in Python, on a fork (no fallback)."""
        probe = matcher.fork()
        if token is not None and not probe.accept(token):
            return False, None
        return True, self.search(probe, limit)

    def or_fallback(
        self,
        matcher: GrammarMatcher,
        token: int | None,
        limit: int,
        answer: tuple[bool, list[int] | None],
        fallback: bool = True,
    ) -> tuple[bool, list[int] | None]:
        """``answer`` (the greedy search's, native or not), or, where it found no path from the
        current state (``token`` None: a grammar's start path, or the path a decision closes
        with now), the greedy path found longer and respelled (:meth:`respelled`), the bounded
        search that chooses object keys and backtracks
        (``engine/closing/backtrack.py``), then the walk that prefers unseen rows
        (``engine/closing/novel.py``): the one place every search's answer passes, so the
        native batch (``batch.answer_all``) and the inline searches fall back alike.

        A search *after* a token does not fall back: a decision whose greedy search finds no
        path after the token closes with the path it knows for the current state, so the
        fallback (tens of ms of Python) runs only where a request would otherwise be cut
        unclosed, not once per token of a grammar the greedy search cannot close. ``fallback``
        False (a request past :data:`FALLBACK_RUNS`): ``answer`` as it is."""
        accepted, path = answer
        if not fallback or not accepted or path is not None or limit < 0 or token is not None:
            return answer
        path = self.respelled(matcher, limit)
        if path is None:
            path = self.fallback.find(matcher, [], limit)
        if path is None:  # last: the walk out of an open run (``engine/closing/novel.py``)
            path = self.novel.find(matcher, limit)
        return True, path

    def respelled(self, matcher: GrammarMatcher, limit: int) -> list[int] | None:
        """The greedy path from ``matcher``'s state (not changed) found past ``limit`` (up to
        :data:`SEARCH_LIMIT`), in the tokenizer's own tokens, when that is ``limit`` tokens at
        most and still completes the grammar; else None. The greedy walk takes one
        single-character candidate at a time (``{`` ``"`` ``k`` ``"`` ``:``), where the
        tokenizer merges them (``{"`` ``k`` ``":{"``): 30 nested objects closed in 182 tokens
        that way, in 70 respelled (a budget of 90 ended unclosed)."""
        if limit >= SEARCH_LIMIT:
            return None
        long = self.search_after(matcher, None, SEARCH_LIMIT, fallback=False)[1]
        if long is None:
            return None
        try:
            text = b"".join(self._token_bytes[t] for t in long).decode("utf-8")
        except UnicodeDecodeError:  # a character split by the walk's tokens: not respelled
            return None
        ids = self._encode(text)
        return ids if len(ids) <= limit and matcher.completes(ids) else None

    def search(self, probe: GrammarMatcher, limit: int) -> list[int] | None:
        """:meth:`find` on ``probe`` itself (a fork the caller owns): advances it along the path.

        Where it has chosen the same token :data:`REPEAT_LIMIT` - 1 times in a row (a closer
        excepted), the greedy choice may be going round in a loop that would only end at
        ``limit``: it takes the first other token the grammar accepts instead, once (a
        date-time's fraction of a second, ``.000…``, is left by ``+``); a second such run gives
        up (None: ``0`` after ``0`` in a string whose format needs an ``@`` first)."""
        if limit < 0:
            return None
        path: list[int] = []
        repeats = 0
        escaped = False
        while not probe.can_terminate():
            if len(path) >= limit:
                return None
            forced = probe.forced_tokens(limit - len(path))
            taken = probe.accept_tokens(forced) if forced else 0
            if taken:
                path.extend(forced[:taken])
                repeats = 0
                continue
            avoid = None
            if repeats >= REPEAT_LIMIT - 1 and path[-1] not in self.closers:
                if escaped:
                    return None
                avoid, escaped = path[-1], True
            chosen = self._first_accepted(probe, avoid)
            if chosen is None:
                return None
            repeats = repeats + 1 if path and path[-1] == chosen else 1
            path.append(chosen)
        return path

    def answer(self, decision: Generator[SearchCall, tuple[bool, list[int] | None], R]) -> R:
        """Run ``decision`` (``BudgetCloser.decision``, ``ahead.tree_decisions``), making its
        searches one by one."""
        try:
            call = next(decision)
            while True:
                answer = self.search_after(call.matcher, call.token, call.limit, call.fallback)
                call = decision.send(answer)
        except StopIteration as done:
            outcome: R = done.value
            return outcome

    def stitch(
        self, matcher: GrammarMatcher, token: int, path: list[int], limit: int
    ) -> list[int] | None:
        """A closing path for the state after ``token`` from ``matcher``'s (not changed), made
        from ``path`` (one that closed ``matcher``'s state, or an earlier one): all of it, a
        suffix of it (the token closed a value of its own: ``"`` ending a string), or a closer
        then all of it (the token opened one). One ``completes`` check per try, at most 7.
        None: no such path within ``limit`` (or ``token`` is rejected)."""
        # each try is made only when reached: the first one completes most often
        for k in range(min(len(path), 3) + 1):
            if len(path) - k <= limit and matcher.completes([token, *path[k:]]):
                return path[k:]
        if path and len(path) < limit:
            for closer in self.candidates[:3]:
                if matcher.completes([token, closer, *path]):
                    return [closer, *path]
        return None

    def _first_accepted(self, probe: GrammarMatcher, avoid: int | None = None) -> int | None:
        for token in self.candidates:
            if token == avoid:
                continue
            if token == self.quote:
                closer = self._empty_closer(probe, avoid)
                if closer is not None:
                    return closer
            # a check first: most candidates are refused, and a refused ``accept`` costs more
            if probe.accepted_prefix([token]) and probe.accept(token):
                return token
        row = self._row()
        probe.fill_bitmask(row, 0)
        # whitespace last: it makes no progress (a grammar with bounded whitespace allows a few
        # such tokens, each one a token of the budget spent for nothing)
        lowest = _lowest_allowed(row[0].numpy(), LOWEST_ALLOWED)
        allowed = [t for t in lowest if t not in self.stops and t != avoid]
        blank = self.blank
        for token in [t for t in allowed if t not in blank] + [t for t in allowed if t in blank]:
            if probe.accept(token):
                return token
        return None

    def _empty_closer(self, probe: GrammarMatcher, avoid: int | None) -> int | None:
        """The closer that ends an empty container at ``probe``'s state (``{`` then ``}``,
        ``[`` then ``]``), accepted on ``probe``: one token, where the ``"`` tried first would
        open a key or a string that must be closed again (``{"":""}``). A closer the grammar
        takes as string content is told apart: ``"`` is still allowed after it (a closer that
        ends a container leaves a value that no ``"`` may follow); both checks are one
        ``accepted_prefix``, no fork. None, ``probe`` unchanged: no such closer."""
        for closer in self._closers_first:
            if closer == avoid:
                continue
            taken = probe.accepted_prefix([closer, self.quote])  # type: ignore[list-item]
            if taken == 0:
                continue
            if taken == 2:
                return None  # content of a string: so is any other closer
            accepted = probe.accept(closer)
            assert accepted, "accepted_prefix took it"
            return closer
        return None

    def _row(self) -> torch.Tensor:
        row: torch.Tensor | None = getattr(self._rows, "row", None)
        if row is None:
            row = self._rows.row = bm.allocate(1, self.vocab_size, fill=0)
        return row


def _blank_ids(tokenizer: TokenizerInfo) -> frozenset[int]:
    """Ids whose bytes are whitespace only (not empty)."""
    return frozenset(i for i, b in enumerate(tokenizer.token_bytes) if b and not b.strip())


def _lowest_allowed(row: np.ndarray, count: int) -> list[int]:
    """The ``count`` lowest token ids allowed by ``row`` (int32 ``[W]``, tail bits past V
    clear), ascending; reads only the nonzero words instead of unpacking all ``32 * W`` bits."""
    tokens: list[int] = []
    for word in np.flatnonzero(row).tolist():
        bits = int(row[word]) & 0xFFFFFFFF
        while bits and len(tokens) < count:
            low = bits & -bits
            tokens.append(32 * word + low.bit_length() - 1)
            bits ^= low
        if len(tokens) >= count:
            break
    return tokens


@dataclass(frozen=True)
class Memo:
    """What the policy keeps about one request between tokens (immutable: a lookahead works on
    snapshots).

    known: the closing path found by the last check (it completes the grammar from the
        matcher's state after that check's token, within the budget then) and the output length
        it belongs to (for another length it is stale: only a seed for the next check's tries);
        None when there is none.
    next_check: the output length before which no check is needed (spacing, see MARGIN).
    unclosable: no budget was left for a closing path (no more checks). Where the searches
        find none, the next check is :data:`RETRY_AFTER` tokens later instead.
    fallbacks: the checks whose fallback searches ran and found no path; from
        :data:`FALLBACK_RUNS` on, checks search greedily only (a count along the tokens, so
        decisions stay a function of them).
    """

    known: tuple[int, list[int]] | None = None
    next_check: int = 0
    unclosable: bool = False
    fallbacks: int = 0


NO_MEMO = Memo()

FirstKey = tuple[int, int, bool]
"""``BudgetCloser._first_key``: (token, budget, exempt), per compiled grammar."""


class PerGrammar(Generic[K, R]):
    """Values that are a function of a compiled grammar and a key (first-token decisions,
    start-path searches), made once: at most ``limit`` kept, then all cleared. An entry refers
    to its grammar weakly (kept entries must not keep evicted grammars alive: an outlines-core
    index is hundreds of MB); one whose grammar is gone is never found again, even where a new
    grammar takes the same id. Not locked: callers on several threads hold a lock of their own
    around it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: dict[tuple[int, K], tuple[weakref.ref[object], R]] = {}

    def find(self, compiled: object, key: K) -> R | None:
        """The kept value (None: none; for values that are never None themselves)."""
        kept = self._items.get((id(compiled), key))
        return kept[1] if kept is not None and kept[0]() is compiled else None

    def put(self, compiled: object, key: K, value: R) -> None:
        if len(self._items) >= self.limit:
            self._items.clear()
        self._items[(id(compiled), key)] = (weakref.ref(compiled), value)

    def discard(self, compiled: object, key: K, value: R) -> None:
        """Drop the entry when it is still ``value`` (not one put since)."""
        kept = self._items.get((id(compiled), key))
        if kept is not None and kept[0]() is compiled and kept[1] is value:
            del self._items[(id(compiled), key)]

    def get_or_make(self, compiled: object, key: K, make: Callable[[], R]) -> R:
        kept = self._items.get((id(compiled), key))
        if kept is not None and kept[0]() is compiled:
            return kept[1]
        value = make()
        self.put(compiled, key, value)
        return value


Decision = Generator[SearchCall, tuple[bool, "list[int] | None"], tuple["list[int] | None", Memo]]
"""``BudgetCloser.decision``: yields searches, is sent their outcomes, returns the decision."""


class BudgetCloser:
    """The engine's side of the policy: when to close a request, and appending the closing.

    ``enabled=False``: never closes (``EngineConfig.close_within_budget``). The decisions for a
    speculative step's draft tree can be computed ahead on a mask thread (:meth:`lookahead`,
    ``engine/closing/ahead.py``); :meth:`instead` then takes them instead of recomputing.
    ``paths``: the :class:`ClosingPaths` to search with (the grammar service's, which searches
    each grammar's start path where it makes the matchers); None: one of its own.
    """

    def __init__(
        self,
        tokenizer: TokenizerInfo,
        *,
        enabled: bool = True,
        threads: int = 1,
        paths: ClosingPaths | None = None,
    ) -> None:
        self.paths = (paths or ClosingPaths(tokenizer)) if enabled else None
        self.stop_token = tokenizer.stop_token_ids[0]
        self._tokenizer_stops = frozenset(tokenizer.stop_token_ids)
        self._memo: dict[str, Memo] = {}
        self._ahead: dict[str, Lookahead] = {}
        self.threads = max(1, threads)  # native threads of a batch of searches (prepare)
        # decisions made by ``prepare``: (here, token, exempt, memo they start from, outcome)
        self._ready: dict[str, tuple[int, int, bool, Memo, tuple[list[int] | None, Memo]]] = {}
        self._first: PerGrammar[FirstKey, tuple[list[int] | None, Memo]] = PerGrammar(
            FIRST_DECISIONS
        )

    def _memo_of(self, request: Request, max_model_len: int) -> Memo:
        """The request's memo; before its first token, the closing path of its grammar's start
        state (one search per compiled grammar, not one per request): the first token's check
        then tries it like any kept path (none at all when the token is its first). Where that
        search (its fallbacks included) found none, the first check is :data:`RETRY_AFTER`
        tokens later, as after any check that finds none: at the first token it would search
        the same state again (tens of ms of fallbacks per request of a grammar no path closes).
        Where it ran past its time budget (``COSTLY``: masks of 0.1 s and more), the request is
        not closed at all: each check's search could take as long, on the engine's thread.
        A function of the grammar alone, so decisions stay a function of the tokens."""
        memo = self._memo.get(request.request_id)
        if memo is not None:
            return memo
        memo = NO_MEMO
        compiled, matcher = request.compiled, request.matcher
        fresh = not request.output_ids and not request.sampling.ignore_eos
        if fresh and self.paths is not None and compiled is not None and matcher is not None:
            path = self.paths.start_path(compiled, matcher)
            budget = _budget(request, 0, max_model_len)
            if isinstance(path, Costly):
                memo = Memo(None, 0, True)  # no checks: each search could cost as much
            elif path is None:
                memo = Memo(None, 1 + RETRY_AFTER, False)
            elif len(path) <= budget - 1:
                memo = Memo((0, path), 0, False)
        self._memo[request.request_id] = memo
        return memo

    def _first_key(
        self, request: Request, here: int, token: int, budget: int, exempt: bool
    ) -> FirstKey | None:
        """The key, under its compiled grammar, of a request's first decision (nothing output
        yet; ignore_eos excluded: its memo is not the start path's), else None. Its matcher is
        then at its grammar's start state and its memo is that state's path (:meth:`_memo_of`),
        so the decision is a function of the compiled grammar, ``token``, ``budget`` and
        ``exempt`` alone: it is made once per key and shared by every request of the grammar
        that starts with ``token`` (a burst of one schema's requests searches once per distinct
        first token where each searched on its own new lexer)."""
        if here or request.compiled is None or request.sampling.ignore_eos:
            return None
        return token, budget, exempt

    def known(self, request_id: str) -> tuple[int, list[int]] | None:
        """The closing path kept for ``request_id`` and the output length it belongs to."""
        return self._memo.get(request_id, NO_MEMO).known

    def pass_through(self, request: Request, tokens: Sequence[int], max_model_len: int) -> int:
        """How many of ``tokens`` (the request's next ones, none a stop token) :meth:`instead`
        lets through without grammar work, one after the other; the memo is updated for them
        exactly as those calls would (so a run appended at once closes as one by one does).
        Stops at the first token that needs a check; with a lookahead (decided ahead), at the
        first token it has no decision for or that it closes at."""
        if self.paths is None or request.matcher is None:
            return len(tokens)
        request_id = request.request_id
        memo = start = self._memo_of(request, max_model_len)
        here = len(request.output_ids)
        ahead = self._ahead.get(request_id)
        if ahead is not None:
            passed = 0
            for i, token in enumerate(tokens):
                outcome = ahead.take(here + i, token, unless_closing=True)
                if outcome is None or outcome[0] is not None:
                    break  # off the tree, or a closing: for ``instead``
                memo = outcome[1]
                passed += 1
            if memo is not start:
                self._memo[request_id] = memo
            return passed
        budget = _budget(request, here, max_model_len)
        exempt = request.sampling.ignore_eos
        passed = 0
        for i, token in enumerate(tokens):
            after = _without_check(memo, token, here + i, budget - i, exempt)
            if after is None:
                break
            memo = after
            passed += 1
        if memo is not start:
            self._memo[request_id] = memo
        return passed

    def instead(
        self, request: Request, token: int, stops: set[int], max_model_len: int
    ) -> list[int] | None:
        """The closing path to emit instead of ``token`` (not yet appended) when after ``token``
        the grammar could not be completed within the request's budget; else None.

        The outcome is a function of the request's tokens alone (so speculative and plain
        decoding close identically); a lookahead's outcome for this token is taken when there
        is one (it is the same function's value, computed earlier)."""
        matcher = request.matcher
        if self.paths is None or matcher is None:
            return None
        request_id = request.request_id
        here = len(request.output_ids)
        ahead = self._ahead.get(request_id)
        if ahead is not None:
            outcome = ahead.take(here, token)
            if outcome is not None:
                self._memo[request_id] = outcome[1]
                return outcome[0]
            del self._ahead[request_id]  # off the precomputed tree: decide inline from here
        budget = _budget(request, here, max_model_len)
        memo = self._memo_of(request, max_model_len)
        exempt = request.sampling.ignore_eos or token in stops
        ready = self._ready.pop(request_id, None)
        if ready is not None and ready[:3] == (here, token, exempt) and ready[3] is memo:
            path, after = ready[4]  # the same decision, made in ``prepare``'s batch
        else:
            key = self._first_key(request, here, token, budget, exempt)
            if key is None:
                path, after = self.decide(memo, matcher, token, here, budget, exempt)
            else:
                path, after = self._first.get_or_make(
                    request.compiled,
                    key,
                    lambda: self.decide(memo, matcher, token, here, budget, exempt),
                )
        if after is not memo:
            self._memo[request_id] = after
        return path

    def prepare(
        self, items: Sequence[tuple[Request, int, int, set[int]]], max_model_len: int
    ) -> None:
        """Make ahead the decisions :meth:`instead` will need next for ``items`` (a request,
        the token it will decide on next, the output length it is checked at, with the
        request's matcher at that state already, and its stops), their
        searches in one native call per wave (``batch.answer_all``) instead of one by one: the
        step's first inline decisions (plain decoding's token, a speculative step's first token
        past its accepted run). ``instead`` takes such a decision only when it is asked for
        exactly that token, state and memo; a decision that raised is left to ``instead``."""
        if self.paths is None:
            return
        decisions: dict[str, Decision] = {}
        keys: dict[str, tuple[int, int, bool, Memo]] = {}
        firsts: dict[str, tuple[object, FirstKey]] = {}
        # a first decision another request of the batch makes under the same key is shared
        # (a burst of one schema's requests: one search per distinct first token)
        owners: dict[tuple[int, FirstKey], str] = {}
        sharers: dict[str, str] = {}
        for request, token, here, stops in items:
            matcher = request.matcher
            request_id = request.request_id
            if matcher is None or request_id in decisions:
                continue
            ahead = self._ahead.get(request_id)
            try:
                if ahead is not None and ahead.decides(here, token):
                    continue  # decided on the tree already
                memo = self._memo_of(request, max_model_len)  # may search (a new grammar)
            except Exception:  # its grammar: ``instead`` meets it again and ends it alone
                continue
            budget = _budget(request, here, max_model_len)  # ``here`` counts the pending run
            exempt = request.sampling.ignore_eos or token in stops
            if _without_check(memo, token, here, budget, exempt) is not None:
                continue  # no grammar work
            first_key = self._first_key(request, here, token, budget, exempt)
            if first_key is not None:
                first = self._first.find(request.compiled, first_key)
                if first is not None:
                    self._ready[request_id] = (here, token, exempt, memo, first)
                    continue
                owner = owners.setdefault((id(request.compiled), first_key), request_id)
                if owner != request_id:
                    sharers[request_id] = owner
                    keys[request_id] = (here, token, exempt, memo)
                    continue
                firsts[request_id] = (request.compiled, first_key)
            decisions[request_id] = self.decision(memo, matcher, token, here, budget, exempt)
            keys[request_id] = (here, token, exempt, memo)
        if len(decisions) < 2 and not sharers:
            return  # nothing to batch: ``instead`` decides as before
        outcomes = answer_all(self.paths, decisions, self.threads)
        for request_id, outcome in outcomes.items():
            if not isinstance(outcome, BaseException):
                self._ready[request_id] = (*keys[request_id], outcome)
                if request_id in firsts:
                    self._first.put(*firsts[request_id], outcome)
        for request_id, owner in sharers.items():
            shared = outcomes.get(owner)
            if shared is not None and not isinstance(shared, BaseException):
                self._ready[request_id] = (*keys[request_id], shared)

    def decide(
        self,
        memo: Memo,
        matcher: GrammarMatcher,
        token: int,
        here: int,
        budget: int,
        exempt: bool,
    ) -> tuple[list[int] | None, Memo]:
        """:meth:`instead`'s decision from ``memo`` and ``matcher`` (the state before ``token``,
        not changed: ``completes`` checks and forks): the closing path or None, and the memo
        after.

        A path already known to close the current state is reused: when ``token`` is its first
        token its rest closes the next state (no grammar work). Else the last path found (for
        this state, or stale: found some tokens ago) is tried after ``token``, then paths
        stitched from it (:meth:`ClosingPaths.stitch`), ``completes`` checks only (nothing is
        rolled back, so a search's probe is never one llguidance's stale masks could reach),
        before a new search.
        ``exempt``: ignore_eos or a stop token (no check)."""
        assert self.paths is not None
        return self.paths.answer(self.decision(memo, matcher, token, here, budget, exempt))

    def decision(
        self,
        memo: Memo,
        matcher: GrammarMatcher,
        token: int,
        here: int,
        budget: int,
        exempt: bool,
    ) -> Decision:
        """:meth:`decide` as steps: it yields each search it needs (a :class:`SearchCall`) and
        is sent the outcome (``ClosingPaths.search_after``'s); its value is the decision. So
        the searches of many decisions can be made in one native call
        (``engine/closing/batch.py``)."""
        assert self.paths is not None
        quick = _without_check(memo, token, here, budget, exempt)
        if quick is not None:
            return None, quick
        known = memo.known
        path = known[1] if known is not None and known[0] == here else None  # fits budget - 1
        seed = known[1] if known is not None else None  # only tried: it may be stale
        # after token: a path that leaves room for the stop token; the kept one and those
        # stitched from it are checked on the matcher itself (``completes`` changes nothing), a
        # probe is forked only for a search
        limit = budget - 2
        after = self.paths.stitch(matcher, token, seed, limit) if seed is not None else None
        if after is None:
            accepted, after = yield SearchCall(matcher, token, min(limit, SEARCH_LIMIT))
            if not accepted:
                return None, memo  # the grammar rejects token: not for this policy to decide
        if after is None and limit > SEARCH_LIMIT:  # not found that short: look again later
            slack = limit - SEARCH_LIMIT
            return None, replace(memo, next_check=_next_check(here, budget, slack))
        if after is not None:
            slack = limit - len(after) - MARGIN
            next_check = _next_check(here, budget, slack)
            return None, Memo((here + 1, after), next_check, False, memo.fallbacks)
        if path is None and budget - 1 >= 0:  # ``find``: the current state's own path
            fallback = memo.fallbacks < FALLBACK_RUNS
            path = (yield SearchCall(matcher, None, budget - 1, fallback))[1]
            if path is None:  # the searches are bounded: a later state may have one they find
                failed = memo.fallbacks + int(fallback)
                return None, replace(memo, next_check=here + 1 + RETRY_AFTER, fallbacks=failed)
        if path is None:
            return None, replace(memo, unclosable=True)
        return path, memo

    def lookahead(
        self, request: Request, tokens: Sequence[int], parents: Sequence[int], max_model_len: int
    ) -> Callable[[], None] | None:
        """A job that decides ahead for every node of ``request``'s draft tree (``tokens``,
        ``parents``: node 0 = the root, the last known token), for :meth:`instead` to take when
        the step's tokens are appended; None when there is nothing worth deciding ahead.

        Call it on the thread that owns the matcher, before anything else uses it in the step
        (the job runs on a fork made here); the job may run on any thread."""
        ahead = self._lookahead(request, tokens, parents, max_model_len)
        return ahead.run if ahead is not None else None

    def lookaheads(
        self,
        trees: Sequence[tuple[Request, Sequence[int], Sequence[int]]],
        max_model_len: int,
    ) -> Callable[..., None] | None:
        """One job deciding ahead for the draft trees of a step (``(request, tokens,
        parents)`` each, as :meth:`lookahead`, in the step's order: their nodes laid out one
        tree after the other), their searches in one native call per wave across the trees
        (``Lookahead.together``, on :attr:`threads` native threads); a tree whose lookahead
        cannot be made (its grammar raised) is decided inline; a finished request's tree gets
        none. The job takes the step masks' ``filled`` flags (bool ``[N]`` over those nodes;
        none: every node is decided)."""
        aheads = []
        first = 0
        for request, tokens, parents in trees:
            if request.is_finished:  # ended since its tree was launched: none
                first += len(tokens)
                continue
            try:
                ahead = self._lookahead(request, tokens, parents, max_model_len, first)
            except Exception:  # its grammar: decided inline, where the fault ends the request
                log.debug("closing lookahead not made", exc_info=True)
                ahead = None
            first += len(tokens)
            if ahead is not None:
                aheads.append(ahead)
        if not aheads:
            return None
        assert self.paths is not None
        return functools.partial(Lookahead.together, aheads, self.paths, self.threads)

    def _lookahead(
        self,
        request: Request,
        tokens: Sequence[int],
        parents: Sequence[int],
        max_model_len: int,
        first: int = 0,
    ) -> Lookahead | None:
        matcher = request.matcher
        if self.paths is None or matcher is None or request.sampling.ignore_eos:
            return None
        self._drop_ahead(request.request_id)
        if len(tokens) < 2:  # a root alone: nothing to decide ahead (its memo waits for use)
            return None
        memo = self._memo_of(request, max_model_len)
        here = len(request.output_ids)
        last = here + max_depth(parents) - 1  # output length at the deepest node's check
        budget = _budget(request, last, max_model_len)
        if memo.unclosable or budget > EVERY_TOKEN:
            return None
        if last < memo.next_check:  # no check is needed: ``pass_through`` lets all by
            return None
        stops = self._tokenizer_stops | set(request.sampling.stop_token_ids)
        tree, links = list(tokens), list(parents)
        limits = (request.sampling.max_tokens, max_model_len - len(request.prompt_ids))
        fork = matcher.fork()
        inputs = (memo, fork, tree, links, here, limits, stops)
        steps = functools.partial(tree_decisions, self, *inputs)
        native = functools.partial(native_tree, *inputs)
        ahead = Lookahead(tree, links, here, steps, self.paths, first, native, memo.fallbacks)
        self._ahead[request.request_id] = ahead
        return ahead

    def emit(
        self,
        request: Request,
        path: list[int],
        new_ids: list[int],
        text_ids: list[int],
        taken: int = 0,
    ) -> None:
        """Append ``path`` and a stop token to the request (the grammar accepts both: the path
        was found on a fork of its matcher); text tokens also go to ``text_ids``. ``taken``:
        how many of ``path`` the matcher has accepted already (a step's batch accept)."""
        matcher = request.matcher
        assert matcher is not None
        for k, token in enumerate([*path, self.stop_token]):
            accepted = k < taken or matcher.accept(token)
            assert accepted, "a closing path is checked on a fork of this matcher"
            request.output_ids.append(token)
            new_ids.append(token)
            if token != self.stop_token:
                text_ids.append(token)

    def forget(self, request_id: str) -> None:
        """The request finished: drop what is kept about it."""
        self._memo.pop(request_id, None)
        self._ready.pop(request_id, None)
        self._drop_ahead(request_id)

    def _drop_ahead(self, request_id: str) -> None:
        ahead = self._ahead.pop(request_id, None)
        if ahead is not None:
            ahead.cancel()


def _budget(request: Request, here: int, max_model_len: int) -> int:
    """Tokens left to a check at output length ``here``: within max_tokens and within the
    context after the prompt and ``here`` output tokens. A function of ``here``, not of the
    output appended so far: a speculative step decides past a run not appended yet."""
    return min(request.sampling.max_tokens - here, max_model_len - len(request.prompt_ids) - here)


def _without_check(memo: Memo, token: int, here: int, budget: int, exempt: bool) -> Memo | None:
    """The memo after ``token`` (appended at output length ``here`` with ``budget`` tokens
    left) when :meth:`BudgetCloser.decide` needs no grammar work for it; None when it does.

    Checks come at ``memo.next_check`` (the first at the first token; every token in the last
    SEARCH_LIMIT + 2): a closing path longer than that (a nest deeper than it) is seen while it
    still fits."""
    if exempt or memo.unclosable:
        return memo
    known = memo.known
    path = known[1] if known is not None and known[0] == here else None  # fits budget - 1
    if path and path[0] == token:
        return replace(memo, known=(here + 1, path[1:]))
    if here < memo.next_check:
        return memo  # far enough from the budget's end (a function of the tokens alone)
    return None


def _next_check(here: int, budget: int, slack: int) -> int:
    """The output length of the next check after one at ``here`` (``budget`` tokens left then)
    that left ``slack`` tokens to spare: spaced by the slack (at most GROWTH_PER_TOKEN more
    tokens of closing path per token) while more than :data:`EVERY_TOKEN` tokens are left,
    every token from there on: one token can lengthen the path by up to anything a search
    finds (a key whose value is an object of many required keys), and only a check at that
    very token can still close the output; a path no longer than the budget is found from
    there (the search's limit is the budget's)."""
    spaced = here + 1 + max(0, slack // (GROWTH_PER_TOKEN + 1))
    every = here + budget - EVERY_TOKEN  # the output length from which each token is checked
    return min(spaced, max(here + 1, every))
