"""Grammar-forced chains: the tokens the grammar forces are free, near-certain drafts.

From the matcher's current state (the root: it has accepted every verified token) the grammar may
force a canonical token chain (``GrammarMatcher.forced_tokens``: e.g. ``{"name":"`` after ``{`` in a
schema with one required key). The chain goes into the tree first, at the root, and the other
drafters draft after its end; after the tree is reranked, chains are also grafted below leaves
whose path leads into a forced state. Forced nodes keep their parent's score (probability 1 under
the grammar), so reranking never drops them before a drafted node.

The target still verifies every forced node: the grammar may allow another tokenization of the
forced text, and greedy decoding takes whichever the target prefers, so losslessness never rests
on the chain.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from espalier.engine.spec.tree_builder import Draft, NodeSource, TreeBuilder

if TYPE_CHECKING:
    from espalier.constrained.base import GrammarMatcher
    from espalier.constrained.batch import BatchFiller

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForcedConfig:
    """max_chain: tokens per forced chain; max_leaf_extensions: leaves probed for a chain per step
    (each probe replays the leaf's path on the matcher and rolls it back)."""

    max_chain: int = 16
    max_leaf_extensions: int = 4


def root_chain(matcher: GrammarMatcher | None, limit: int) -> list[int]:
    """The chain forced from the matcher's current state (``[]`` without a grammar)."""
    if matcher is None or limit <= 0 or matcher.is_terminated():
        return []
    return list(matcher.forced_tokens(limit))


def caught_up(
    batch: BatchFiller, matchers: Sequence[GrammarMatcher], behind: Sequence[Sequence[int]]
) -> list[GrammarMatcher | None]:
    """Per request, a fork of ``matchers[j]`` that has accepted ``behind[j]``: verified tokens
    the request's matcher has not accepted yet (the engine's ``grammar_after_launch`` drafts
    before its accepts). Forced chains are then drafted from it as from the matcher itself.
    None where the fork rejects one of them or its grammar raises (no forced chains: the
    request's own accept meets the same fault). The forks accept in one batch call
    (``BatchFiller.accept_runs``; llguidance makes its forks' clones in it too): a step's
    catch-up costs one native call, not a clone and a replay per request."""
    result: list[GrammarMatcher | None] = [None] * len(matchers)
    live: list[int] = []
    forks: list[GrammarMatcher] = []
    for j, matcher in enumerate(matchers):
        try:
            forks.append(matcher.fork())
        except Exception:
            log.debug("forced drafting: fork failed; drafting without the grammar", exc_info=True)
            continue
        live.append(j)
    runs = [list(behind[j]) for j in live]
    counts, faults = batch.accept_runs(forks, runs)
    for k, j in enumerate(live):
        if k not in faults and counts[k] == len(runs[k]):
            result[j] = forks[k]
    return result


def extend_leaves(
    draft: Draft, matcher: GrammarMatcher, budget: int, config: ForcedConfig
) -> Draft:
    """Graft forced chains below the best leaves of ``draft`` while node budget remains.

    Each probed leaf's path is accepted on ``matcher`` and rolled back (state unchanged on return),
    or on a fork where the backend's rollback is not exact (``exact_rollback``).
    A path the grammar rejects gets no chain (the target will reject it anyway).
    """
    room = budget - draft.num_draft_tokens
    if room <= 0 or matcher.is_terminated():
        return draft
    leaves = sorted((i for i in draft.leaves() if i > 0), key=lambda i: -draft.scores[i])
    builder: TreeBuilder | None = None
    for leaf in leaves[: config.max_leaf_extensions]:
        if room <= 0:
            break
        path = draft.path_tokens(leaf)
        chain = _forced_after(matcher, path, min(room, config.max_chain))
        if not chain:
            continue
        if builder is None:
            builder = _builder_from(draft)
        builder.add_path(leaf, chain, None, NodeSource.FORCED)
        room -= len(chain)
    return draft if builder is None else builder.build()


def _forced_after(matcher: GrammarMatcher, path: list[int], limit: int) -> list[int]:
    if not matcher.exact_rollback:  # probing would roll the request back: probe a copy
        probe = matcher.fork()  # dropped after: the path in one call (native on llguidance)
        if probe.accept_tokens(path) < len(path) or probe.is_terminated():
            return []
        return list(probe.forced_tokens(limit))
    accepted = 0  # in place, rolled back token by token even when an accept raises
    try:
        for token in path:
            if not matcher.accept(token):
                return []
            accepted += 1
        if matcher.is_terminated():
            return []
        return list(matcher.forced_tokens(limit))
    finally:
        if accepted:
            matcher.rollback(accepted)


def _builder_from(draft: Draft) -> TreeBuilder:
    builder = TreeBuilder(draft.tokens[0])
    mapping = builder.graft(0, draft)
    assert mapping == list(range(draft.num_nodes)), "a valid draft maps onto itself"
    return builder
