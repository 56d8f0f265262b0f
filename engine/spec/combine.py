"""Merge the drafts of several drafters and grammar-forced chains into one tree per request.

Per request, in order:

1. ``forced`` on and constrained: the chain the grammar forces at the root goes in first;
2. every other drafter the request asked for drafts after ``context + chain`` (batched across the
   requests that use it); each draft is grafted at the chain's end into one trie, so identical
   prefixes from different drafters become one node (the better score is kept);
3. the trie is reranked to the request's node budget (forced nodes score like their parent, so
   they survive reranking before any drafted node below them);
4. ``forced`` on: chains are grafted below the best leaves whose path leads into a forced state.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from espalier.constrained.batch import BatchFiller
from espalier.engine.spec.base import Drafter, DraftInput
from espalier.engine.spec.forced import ForcedConfig, caught_up, extend_leaves, root_chain
from espalier.engine.spec.tree_builder import Draft, NodeSource, TreeBuilder

log = logging.getLogger(__name__)
T = TypeVar("T")

if TYPE_CHECKING:
    from espalier.constrained.base import GrammarMatcher

FORCED = "forced"


@dataclass(frozen=True)
class ProposalItem:
    """One request's share of a drafting step.

    context: every verified token (last = root). matcher: the request's grammar at the root
    (it has accepted the root), None when unconstrained. methods: drafter names, may include
    ``"forced"``. budget: most draft nodes. max_drafted: most nodes the drafters may add
    (grammar-forced chains do not count against it); None = the whole budget. behind: the
    tokens at the end of ``context`` the matcher has not accepted yet (the engine's
    ``grammar_after_launch``: they are accepted while the step's forward runs).
    """

    request_id: str
    context: Sequence[int]
    matcher: GrammarMatcher | None
    methods: tuple[str, ...]
    budget: int
    max_drafted: int | None = None
    behind: Sequence[int] = ()


@dataclass
class Proposer:
    """Runs the drafters a batch asks for and merges their trees (see the module docstring)."""

    drafters: Mapping[str, Drafter]
    forced: ForcedConfig = field(default_factory=ForcedConfig)
    # the forced chains' catch-up accepts (engine thread only); threads: the mask threads'
    accepts: BatchFiller = field(default_factory=lambda: BatchFiller(1))

    def _forced_grammars(self, items: Sequence[ProposalItem]) -> list[GrammarMatcher | None]:
        """Per item, the matcher its forced chains are drafted from: the request's, or a fork
        of it caught up with ``behind`` (None: unconstrained, or a catch-up that failed); the
        step's forks are caught up together (``forced.caught_up``)."""
        grammars = [item.matcher for item in items]
        late: list[int] = []
        matchers: list[GrammarMatcher] = []
        for i, item in enumerate(items):
            if FORCED in item.methods and item.matcher is not None and item.behind:
                late.append(i)
                matchers.append(item.matcher)
        if late:
            behind = [items[i].behind for i in late]
            none: list[GrammarMatcher | None] = [None] * len(late)
            forks = _guarded(functools.partial(caught_up, self.accepts, matchers, behind), none)
            for i, fork in zip(late, forks):
                grammars[i] = fork
        return grammars

    def release(self, request_id: str) -> None:
        for drafter in self.drafters.values():
            drafter.release(request_id)

    def propose(self, items: Sequence[ProposalItem]) -> list[Draft]:
        builders = [TreeBuilder(item.context[-1]) for item in items]
        anchors = [0] * len(items)
        chains: list[list[int]] = [[] for _ in items]
        grammars = self._forced_grammars(items)
        for i, item in enumerate(items):
            if FORCED in item.methods and item.budget > 0:
                limit = min(item.budget, self.forced.max_chain)
                none: list[int] = []
                chains[i] = _guarded(functools.partial(root_chain, grammars[i], limit), none)
                if chains[i]:
                    nodes = builders[i].add_path(0, chains[i], None, NodeSource.FORCED)
                    anchors[i] = nodes[-1]
        room = [_drafted_room(item, len(chain)) for item, chain in zip(items, chains)]
        for name, drafter in self.drafters.items():
            users = [i for i, item in enumerate(items) if name in item.methods and room[i] > 0]
            if not users:
                continue
            inputs = [
                DraftInput(items[i].request_id, items[i].context, chains[i], room[i]) for i in users
            ]
            for i, draft in zip(users, drafter.propose(inputs)):
                builders[i].graft(anchors[i], draft)
        drafts = [builder.build(max(item.budget, 0)) for item, builder in zip(items, builders)]
        forced = [FORCED in item.methods for item in items]
        if any(g is not None and f for g, f in zip(grammars, forced)):
            probed = [g if f else None for g, f in zip(grammars, forced)]
            budgets = [item.budget for item in items]
            extend = functools.partial(extend_leaves, self.accepts, drafts, probed, budgets)
            drafts = _guarded(functools.partial(extend, self.forced), drafts)
        return drafts


def _guarded(make: Callable[[], T], fallback: T) -> T:
    """``make()``, or ``fallback`` when the request's grammar raises: drafts are only a guess,
    and the request's mask fill meets the same fault and ends that request alone."""
    try:
        return make()
    except Exception:
        log.debug("forced drafting failed; drafting without the grammar", exc_info=True)
        return fallback


def _drafted_room(item: ProposalItem, chain: int) -> int:
    """Nodes the drafters may add for ``item`` after its forced chain of ``chain`` tokens."""
    room = item.budget - chain
    return room if item.max_drafted is None else min(room, item.max_drafted)
