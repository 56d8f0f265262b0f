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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from espalier.engine.spec.tree_builder import Draft, NodeSource, TreeBuilder

if TYPE_CHECKING:
    from espalier.constrained.base import GrammarMatcher
    from espalier.constrained.batch import BatchFiller

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForcedConfig:
    """max_chain: tokens per forced chain; max_leaf_extensions: leaves probed for a chain per
    tree and step (each probe replays the leaf's path: :func:`extend_leaves`)."""

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


@dataclass
class _Extension:
    """One draft's leaf probes across the rounds of :func:`extend_leaves`."""

    leaves: list[int]  # best first, at most max_leaf_extensions
    room: int  # node budget left
    builder: TreeBuilder | None = None  # made at the first chain
    failed: bool = False  # its grammar raised: the draft keeps no chain


def extend_leaves(
    batch: BatchFiller,
    drafts: Sequence[Draft],
    matchers: Sequence[GrammarMatcher | None],
    budgets: Sequence[int],
    config: ForcedConfig,
) -> list[Draft]:
    """Per request, ``drafts[j]`` with forced chains grafted below its best leaves while its
    node budget ``budgets[j]`` remains (``matchers[j]``: its grammar at the root; None: no
    chains). The matchers' states are unchanged on return.

    Up to ``config.max_leaf_extensions`` leaves a draft are probed, best first, in rounds:
    round k probes every draft's k-th leaf with the room its earlier chains left, so each
    draft gets the chains a leaf-by-leaf loop would give it. A probe replays the leaf's path
    on a fork where the backend's rollback is not exact (``exact_rollback``; a round's forks
    are made and advanced in one ``BatchFiller.accept_runs``, natively on llguidance), else on
    the matcher itself, rolled back. A path the grammar rejects gets no chain (the target will
    reject it anyway); a draft whose grammar raises keeps none (drafts are only a guess)."""
    state: dict[int, _Extension] = {}
    for j, (draft, matcher, budget) in enumerate(zip(drafts, matchers, budgets)):
        room = budget - draft.num_draft_tokens
        try:
            if matcher is None or room <= 0 or matcher.is_terminated():
                continue
        except Exception:
            log.debug("forced drafting failed; drafting without the grammar", exc_info=True)
            continue
        leaves = sorted((i for i in draft.leaves() if i > 0), key=lambda i: -draft.scores[i])
        if leaves:
            state[j] = _Extension(leaves[: config.max_leaf_extensions], room)
    for k in range(config.max_leaf_extensions):
        probes = {
            j: (drafts[j].path_tokens(e.leaves[k]), min(e.room, config.max_chain))
            for j, e in state.items()
            if not e.failed and e.room > 0 and k < len(e.leaves)
        }
        if not probes:
            break
        chains = _forced_after(batch, {j: matchers[j] for j in probes}, probes)
        for j, chain in chains.items():
            extension = state[j]
            if isinstance(chain, BaseException):
                log.debug("forced drafting failed; drafting without the grammar", exc_info=chain)
                extension.failed = True
                continue
            if not chain:
                continue
            if extension.builder is None:
                extension.builder = _builder_from(drafts[j])
            extension.builder.add_path(extension.leaves[k], chain, None, NodeSource.FORCED)
            extension.room -= len(chain)
    out = list(drafts)
    for j, extension in state.items():
        if extension.builder is not None and not extension.failed:
            out[j] = extension.builder.build()
    return out


def _forced_after(
    batch: BatchFiller,
    matchers: Mapping[int, GrammarMatcher | None],
    probes: Mapping[int, tuple[list[int], int]],
) -> dict[int, list[int] | BaseException]:
    """Per key, the chain forced after ``probes[key]``'s path (at most its limit) from
    ``matchers[key]`` ([] when the grammar rejects the path or ends on it), or what its
    grammar raised; the matchers' states are unchanged."""
    chains: dict[int, list[int] | BaseException] = {}
    keys: list[int] = []
    forks: list[GrammarMatcher] = []
    for key, matcher in matchers.items():
        assert matcher is not None
        path, limit = probes[key]
        try:
            if matcher.exact_rollback:
                chains[key] = _forced_in_place(matcher, path, limit)
            else:  # probing would roll the request back: probe a fork, dropped after
                forks.append(matcher.fork())
                keys.append(key)
        except Exception as exc:
            chains[key] = exc
    if not forks:
        return chains
    runs = [probes[key][0] for key in keys]
    counts, faults = batch.accept_runs(forks, runs)
    for k, (key, probe) in enumerate(zip(keys, forks)):
        if k in faults:
            chains[key] = faults[k]
            continue
        try:
            if counts[k] < len(runs[k]) or probe.is_terminated():
                chains[key] = []
            else:
                chains[key] = list(probe.forced_tokens(probes[key][1]))
        except Exception as exc:
            chains[key] = exc
    return chains


def _forced_in_place(matcher: GrammarMatcher, path: list[int], limit: int) -> list[int]:
    """The chain forced after ``path`` on ``matcher`` itself, rolled back token by token even
    when an accept raises (backends whose rollback is exact)."""
    accepted = 0
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
