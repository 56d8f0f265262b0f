"""Closing decisions for a speculative step's draft tree, computed ahead on a mask thread.

The budget closer (``engine/closing/``) decides, before each constrained token is appended in
the last :data:`~espalier.engine.closing.EVERY_TOKEN` tokens of a request, whether a closing
path still fits after it. Near the end of a budget that is a greedy search on matcher forks for
many tokens, on the main thread, after verification: at batch 32 the largest host cost that only
constrained requests pay. The decision is a function of the tokens alone, and a speculative
step's candidates are known before verification (its draft tree), so :class:`Lookahead` makes
every node's decision ahead (the same ``BudgetCloser.decide``, from the memo and a matcher fork
taken when the step starts, along each root-to-node path) on a mask-thread-pool thread while the
target's forward runs. When the step's tokens are appended, ``BudgetCloser.instead`` takes the
decision of the tree node each token reaches; a token off the tree (the bonus token, or a
rejected branch) and everything after it is decided inline as before. So outputs are exactly
those of deciding inline. A node the step's masks left unfilled (a token the grammar rejects
there, or past the fill's budget) is never decided ahead: verification accepts only filled
nodes, so its token can never be taken (and were it taken, it would be decided inline).

Hand-off: the job runs once, on whichever thread starts it; ``take`` on the main thread waits
for a running job and runs one not yet started itself (as ``PendingMasks.result`` does with the
fills left). A job that fails (a grammar error) leaves no decisions: inline again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    import numpy as np

    from espalier.constrained.base import ClosingTree, GrammarMatcher, NativeClosing, NodeDecision
    from espalier.engine.closing import BudgetCloser, ClosingPaths, Memo, SearchCall

log = logging.getLogger(__name__)

Outcome = tuple["list[int] | None", "Memo"]
"""A node's decision: the closing path to emit instead of its token (None: none) and the memo
after it."""

TreeSteps = Generator["SearchCall", tuple[bool, "list[int] | None"], "list[Outcome | None]"]
"""A tree's decisions as steps (:func:`tree_decisions`): yields searches, returns outcomes."""

Filled: TypeAlias = "Sequence[bool] | np.ndarray"
"""The nodes of a tree to decide: bool ``[n]`` (the step masks' ``filled`` flags)."""

NativeTree: TypeAlias = "tuple[NativeClosing, ClosingTree]"
"""A tree's decisions as one native job (``NativeClosing.trees``)."""

_PENDING, _RUNNING, _DONE, _CANCELLED = range(4)


def child_index(tokens: Sequence[int], parents: Sequence[int]) -> dict[tuple[int, int], int]:
    """``(parent node, token) -> node`` for the tree (node 0 = root, ``parents[i] < i``)."""
    return {(parents[i], tokens[i]): i for i in range(1, len(tokens))}


def max_depth(parents: Sequence[int]) -> int:
    """Depth of the deepest node (``parents[i] < i``; root 0 has depth 0)."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return max(depth)


class Lookahead:
    """One request's decisions along its draft tree (see the module docstring).

    tokens, parents: the tree (node 0 = root). here: output length when the step started (the
    first appended token's check sees it). steps: makes the decisions as steps given the nodes
    to decide (None: all; else :data:`Filled`, this tree's), one outcome per node (None for
    the root, for nodes not to decide and for nodes below a closing or a stop):
    :func:`tree_decisions` on a matcher fork, its searches made in waves across a step's trees
    by :meth:`together` (``paths``'); when it raises, every token is decided inline. first: the
    tree's root's index among the step's nodes (where its flags start in :meth:`together`'s
    ``filled``). native: the same decisions as one native job (:func:`native_tree`; None, or
    a job that comes back ``FALLBACK``: ``steps`` makes them), so a backend that decides
    whole trees natively (llguidance: ``llg_close.c``) holds no GIL for them. fallbacks: the
    root memo's ``Memo.fallbacks``, which a native job keeps (it comes back ``FALLBACK``
    wherever a fallback search would run).
    """

    def __init__(
        self,
        tokens: list[int],
        parents: list[int],
        here: int,
        steps: Callable[[Filled | None], TreeSteps],
        paths: ClosingPaths,
        first: int = 0,
        native: Callable[[Filled | None], NativeTree | None] | None = None,
        fallbacks: int = 0,
    ) -> None:
        self._steps: Callable[[Filled | None], TreeSteps] | None = steps
        self._fallbacks = fallbacks  # the root memo's (native decisions never change it)
        self._native = native
        self._first = first
        self._paths = paths
        self._tokens = tokens
        self._outcomes: list[Outcome | None] = [None] * len(tokens)
        self._child = child_index(tokens, parents)
        self._state = _PENDING
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._node = 0  # the node the appended tokens have reached
        self._here = here  # the output length of the next check

    def run(self) -> None:
        """Decide for every node (the job; a no-op once started elsewhere or cancelled)."""
        Lookahead.together([self], self._paths, 1)

    @staticmethod
    def together(
        aheads: Sequence[Lookahead],
        paths: ClosingPaths,
        threads: int,
        filled: np.ndarray | None = None,
    ) -> None:
        """Run the lookaheads not started yet side by side (``batch.answer_all``): each wave's
        searches, across the trees, in one native call on up to ``threads`` native threads.
        Each tree's decisions are handed over as soon as they are made (its consumer, waiting
        in :meth:`take`, goes on while the trees left still search). filled: bool ``[N]`` over
        every node of the step (``MaskBuilder.submit``'s ``after``; None: decide every node)."""
        from espalier.engine.closing.batch import answer_all

        claimed: dict[int, TreeSteps] = {}
        natives: dict[int, NativeTree] = {}
        for k, ahead in enumerate(aheads):
            mine = None if filled is None else ahead._mine(filled)
            steps = ahead.claim(mine)
            if steps is None:
                continue
            claimed[k] = steps
            native = ahead._native_tree(mine)
            if native is not None:
                natives[k] = native
        for k, outcomes in decide_natively(paths, natives, threads).items():
            claimed.pop(k).close()
            kept = aheads[k]._fallbacks
            if kept:  # native memos start at 0 (most requests never fall back)
                outcomes = [
                    o if o is None else (o[0], replace(o[1], fallbacks=kept)) for o in outcomes
                ]
            aheads[k].finish(outcomes)
        finished: set[int] = set()

        def done(k: int, outcomes: list[Outcome | None] | BaseException) -> None:
            finished.add(k)
            aheads[k].finish(outcomes)

        try:
            answer_all(paths, claimed, threads, done)
        except Exception as exc:  # not expected (answer_all keeps each tree's faults apart)
            for k in claimed.keys() - finished:
                aheads[k].finish(exc)

    def _native_tree(self, filled: Filled | None) -> NativeTree | None:
        """The tree's decisions as a native job (its matcher's backend decides whole trees),
        or None: they are made in Python."""
        if self._native is None:
            return None
        try:
            return self._native(filled)
        except Exception:  # its grammar: the Python decisions raise it again, then inline
            log.debug("native closing tree not made", exc_info=True)
            return None

    def claim(self, filled: Filled | None = None) -> TreeSteps | None:
        """The decisions' steps (for the nodes ``filled``: None, all), for the caller to run
        and :meth:`finish`; None when the job started elsewhere or was cancelled."""
        with self._lock:
            if self._state != _PENDING:
                return None
            self._state = _RUNNING
        assert self._steps is not None
        steps, self._steps = self._steps, None
        try:
            return steps(filled)
        except Exception as exc:
            self.finish(exc)
            return None

    def _mine(self, filled: np.ndarray) -> np.ndarray:
        """This tree's slice of the step's ``filled`` flags."""
        return filled[self._first : self._first + len(self._tokens)]

    def finish(self, outcomes: list[Outcome | None] | BaseException) -> None:
        """The claimed job's outcomes (an exception: none, decide inline)."""
        if isinstance(outcomes, BaseException):
            log.debug("closing lookahead failed; deciding inline", exc_info=outcomes)
        elif len(outcomes) == len(self._tokens):
            self._outcomes = outcomes
        with self._lock:
            self._state = _DONE
        self._done.set()

    def cancel(self) -> None:
        """Not needed any more: a job not yet started will not run."""
        with self._lock:
            if self._state == _PENDING:
                self._state = _CANCELLED
                self._steps = None
                self._done.set()

    def take(self, here: int, token: int, *, unless_closing: bool = False) -> Outcome | None:
        """The decision for ``token`` appended at output length ``here``, when it continues the
        tree path taken so far; None: decide inline (and from then on). ``unless_closing``: a
        decision to close is returned without moving along the tree (the caller leaves the
        token to :meth:`BudgetCloser.instead`, which takes it again)."""
        found = self._find(here, token)
        if found is None:
            return None
        if not (unless_closing and found[1][0] is not None):
            self._node = found[0]
            self._here += 1
        return found[1]

    def decides(self, here: int, token: int) -> bool:
        """Whether :meth:`take` has a decision for ``token`` at ``here`` (nothing moves; waits
        for the job, or runs it, as ``take`` would)."""
        return self._find(here, token) is not None

    def _find(self, here: int, token: int) -> tuple[int, Outcome] | None:
        if here != self._here:
            return None
        if self._state != _DONE:  # once done, the outcomes never change (no lock needed)
            self.run()  # not started yet: run it here (as PendingMasks.result takes fills)
            self._done.wait()
        child = self._child.get((self._node, token))
        if child is None:
            return None
        outcome = self._outcomes[child]
        return None if outcome is None else (child, outcome)


def tree_decisions(
    closer: BudgetCloser,
    memo: Memo,
    matcher: GrammarMatcher,
    tokens: Sequence[int],
    parents: Sequence[int],
    here: int,
    limits: tuple[int, int],
    stops: frozenset[int] | set[int],
    filled: Filled | None = None,
) -> TreeSteps:
    """``closer.decide`` for every node of a draft tree, depth first from the root, as steps
    (``BudgetCloser.decision``'s: each search is yielded).

    memo, matcher: the request's memo and a matcher at the root (it has accepted the root
    token; advanced and forked here: the caller gives up its own). tokens, parents: the tree
    (node 0 = root). here: output length when the step starts (the first appended token's
    check sees it). limits: ``(max_tokens, room)``: a check at output length ``h`` has budget
    ``min(max_tokens - h, room - h)``. stops: the request's stop tokens (never checked).
    filled: the nodes to decide (:data:`Filled`: verification accepts no other; None: all).
    A node is decided and descended below only when the engine would go on after it (no
    closing, not a stop, the grammar accepts it and is not terminated) and it is to be decided;
    the nodes not reached get None."""
    outcomes: list[Outcome | None] = [None] * len(tokens)
    children: list[list[int]] = [[] for _ in tokens]
    for i in range(1, len(tokens)):
        children[parents[i]].append(i)
    max_tokens, room = limits
    decision = closer.decision
    stack: list[tuple[int, int, GrammarMatcher, Memo]] = [(0, 0, matcher, memo)]
    while stack:
        node, depth, at, memo_at = stack.pop()
        check = here + depth  # output length when the children's tokens are checked
        budget = min(max_tokens - check, room - check)
        kids = children[node]
        for k, child in enumerate(kids):
            if filled is not None and not filled[child]:
                continue  # verification never accepts it (nor a node below it)
            token = tokens[child]
            exempt = token in stops
            path, after = yield from decision(memo_at, at, token, check, budget, exempt)
            outcomes[child] = (path, after)
            if path is not None or exempt or not children[child] or budget <= 1:
                continue
            # the last child advances the node's own matcher (no one needs it after)
            below = at if k == len(kids) - 1 else at.fork()
            if below.accept(token) and not below.is_terminated():
                stack.append((child, depth + 1, below, after))
    return outcomes


def native_tree(
    memo: Memo,
    matcher: GrammarMatcher,
    tokens: Sequence[int],
    parents: Sequence[int],
    here: int,
    limits: tuple[int, int],
    stops: frozenset[int] | set[int],
    filled: Filled | None = None,
) -> NativeTree | None:
    """:func:`tree_decisions`'s inputs as a native job from ``matcher`` (at the root; not
    changed), or None where its backend decides no trees natively."""
    search = matcher.native_closing(None, 0)
    if search is None:
        return None
    from espalier.constrained.base import ClosingTree

    tree = ClosingTree(
        tokens,
        parents,
        filled,
        frozenset(stops),
        here,
        limits[0],
        limits[1],
        memo.known,
        memo.next_check,
        memo.unclosable,
    )
    return search, tree


def decide_natively(
    paths: ClosingPaths, trees: dict[int, NativeTree], threads: int
) -> dict[int, list[Outcome | None]]:
    """The trees' decisions made natively (``NativeClosing.trees``: one call per kind, on up to
    ``threads`` native threads, the GIL released), by key; a tree that came back ``FALLBACK``
    (or whose call failed) is left out: the caller decides it in Python."""
    kinds: dict[Any, list[tuple[int, NativeTree]]] = {}
    for key, native in trees.items():
        kinds.setdefault(native[0].trees, []).append((key, native))
    decided: dict[int, list[Outcome | None]] = {}
    for kind, members in kinds.items():
        try:
            outcomes = kind(paths.rules, [native for _, native in members], threads)
        except Exception:  # not expected (a tree's own faults come back as FALLBACK)
            log.debug("native closing trees failed; deciding in Python", exc_info=True)
            continue
        for (key, _), outcome in zip(members, outcomes):
            if isinstance(outcome, list):
                decided[key] = _outcomes(outcome)
    return decided


def _outcomes(decisions: list[NodeDecision | None]) -> list[Outcome | None]:
    """Native decisions (``NativeClosing.trees``) as :func:`tree_decisions`' outcomes."""
    from espalier.engine.closing import Memo

    return [None if d is None else (d[0], Memo(d[1], d[2], d[3])) for d in decisions]
