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
    request's own accept meets the same fault). A step's catch-up costs one native call, not
    a clone and a replay per request (:func:`_forks_after`)."""
    out: list[GrammarMatcher | None] = []
    for fork in _forks_after(batch, matchers, [list(b) for b in behind]):
        if isinstance(fork, BaseException):
            log.debug(
                "forced drafting: catch-up failed; drafting without the grammar", exc_info=fork
            )
            fork = None
        out.append(fork)
    return out


def _forks_after(
    batch: BatchFiller, matchers: Sequence[GrammarMatcher], runs: Sequence[list[int]]
) -> list[GrammarMatcher | BaseException | None]:
    """Per matcher, a fork of it that has accepted ``runs[j]`` whole (None: its grammar rejects
    part of it), or what its grammar raised; the matchers do not move. The forks are advanced
    in one ``BatchFiller.accept_runs`` (llguidance makes their clones in the same call)."""
    result: list[GrammarMatcher | BaseException | None] = [None] * len(matchers)
    live: list[int] = []
    forks: list[GrammarMatcher] = []
    for j, matcher in enumerate(matchers):
        try:
            forks.append(matcher.fork())
        except Exception as exc:
            result[j] = exc
            continue
        live.append(j)
    if not forks:
        return result
    counts, faults = batch.accept_runs(forks, [runs[j] for j in live])
    for k, j in enumerate(live):
        if k in faults:
            result[j] = faults[k]
        elif counts[k] == len(runs[j]):
            result[j] = forks[k]
    return result


@dataclass
class _Extension:
    """One draft's leaf probes across the rounds of :func:`extend_leaves`."""

    matcher: GrammarMatcher  # its grammar at the root
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
            state[j] = _Extension(matcher, leaves[: config.max_leaf_extensions], room)
    for k in range(config.max_leaf_extensions):
        probes = {
            j: (e.matcher, drafts[j].path_tokens(e.leaves[k]), min(e.room, config.max_chain))
            for j, e in state.items()
            if not e.failed and e.room > 0 and k < len(e.leaves)
        }
        if not probes:
            break
        chains = _forced_after(batch, probes)
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
    batch: BatchFiller, probes: Mapping[int, tuple[GrammarMatcher, list[int], int]]
) -> dict[int, list[int] | BaseException]:
    """Per key, the chain forced after the probe's path (at most its limit) from its matcher
    ([] when the grammar rejects the path or ends on it), or what its grammar raised; the
    matchers' states are unchanged. Matchers whose rollback is not exact are probed on forks
    (:func:`_forks_after`, one call for the round), the others in place."""
    chains: dict[int, list[int] | BaseException] = {}
    forked: list[int] = []
    for key, (matcher, path, limit) in probes.items():
        try:
            if matcher.exact_rollback:
                chains[key] = _forced_in_place(matcher, path, limit)
            else:  # probing would roll the request back: probe a fork, dropped after
                forked.append(key)
        except Exception as exc:
            chains[key] = exc
    matchers = [probes[key][0] for key in forked]
    forks = _forks_after(batch, matchers, [probes[key][1] for key in forked])
    for key, probe in zip(forked, forks):
        if probe is None or isinstance(probe, BaseException):
            chains[key] = [] if probe is None else probe
            continue
        try:
            chains[key] = [] if probe.is_terminated() else list(probe.forced_tokens(probes[key][2]))
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
