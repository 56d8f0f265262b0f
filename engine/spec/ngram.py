"""N-gram (prompt-lookup) drafter: no model, continuations copied from earlier in the sequence.

The last ``n`` tokens of prompt + output (largest ``n`` first, down to ``min_n``) are looked up in
an incremental index of every earlier ``n``-gram; the tokens that followed each earlier occurrence
(most recent first, up to ``max_matches``) become paths of the draft tree, merged into a trie.
A node's score is ``log(matches through it / matches used) + depth * log(depth_decay)``: paths
that many occurrences agree on, and shallow nodes, rank first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from espalier.engine.spec.base import DraftInput
from espalier.engine.spec.tree_builder import Draft, NodeSource, TreeBuilder


@dataclass(frozen=True)
class NgramConfig:
    """min_n/max_n: n-gram lengths tried (longest first); max_matches: occurrences used per step;
    max_depth: continuation length copied per occurrence."""

    min_n: int = 2
    max_n: int = 4
    max_matches: int = 4
    max_depth: int = 8
    depth_decay: float = 0.9

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n or self.max_matches < 1 or self.max_depth < 1:
            raise ValueError(f"invalid n-gram config {self}")


@dataclass
class NgramIndex:
    """End positions of every n-gram (``min_n <= n <= max_n``) of a growing token list.

    ``ends[key]`` lists, oldest first, each index ``e`` such that ``tokens[e-n+1 : e+1] == key``.
    """

    min_n: int
    max_n: int
    tokens: list[int] = field(default_factory=list)
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                key = tuple(self.tokens[end - n + 1 : end + 1])
                self.ends.setdefault(key, []).append(end)

    def sync(self, tokens: Sequence[int]) -> None:
        """Make the index cover exactly ``tokens`` (which usually extends what it has)."""
        have = len(self.tokens)
        if have > len(tokens) or (have and self.tokens[-1] != tokens[have - 1]):
            self.tokens, self.ends = [], {}
            have = 0
        self.extend(tokens[have:])


class NgramDrafter:
    """Stateless per call except for one index per request (kept by the caller's state dict)."""

    name = "ngram"

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()
        self._indexes: dict[str, NgramIndex] = {}

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        return [self.propose_one(i.request_id, i.context, i.extra, i.budget) for i in inputs]

    def propose_one(
        self, request_id: str, context: Sequence[int], extra: Sequence[int], budget: int
    ) -> Draft:
        """Tree after ``context + extra`` (``extra``: tokens already in the tree above the graft
        point, e.g. a forced chain). Root token = the last of ``context + extra``; at most
        ``budget`` draft nodes."""
        cfg = self.config
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = NgramIndex(cfg.min_n, cfg.max_n)
        index.sync(context)
        full = list(context) + list(extra) if extra else index.tokens
        builder = TreeBuilder(full[-1])
        if budget <= 0:
            return builder.build()
        starts = self._matches(index, full)
        if not starts:
            return builder.build()
        counts: dict[int, int] = {}
        paths: list[list[int]] = []
        for start in starts:
            continuation = full[start : start + cfg.max_depth]
            nodes = builder.add_path(0, continuation, [0.0] * len(continuation), NodeSource.NGRAM)
            paths.append(nodes)
            for node in nodes:
                counts[node] = counts.get(node, 0) + 1
        decay = math.log(cfg.depth_decay)
        for nodes in paths:
            for depth, node in enumerate(nodes, start=1):
                builder.scores[node] = math.log(counts[node] / len(starts)) + depth * decay
        return builder.build(budget)

    def _matches(self, index: NgramIndex, full: list[int]) -> list[int]:
        """Start indices (into ``full``) of continuations, most recent occurrence first."""
        cfg = self.config
        last = len(full) - 1
        for n in range(min(cfg.max_n, len(full) - 1), cfg.min_n - 1, -1):
            key = tuple(full[-n:])
            ends = [e for e in index.ends.get(key, ()) if e < last]
            if len(full) > len(index.tokens):  # occurrences inside ``extra`` are not indexed
                ends += [
                    e
                    for e in range(len(index.tokens), last)
                    if e - n + 1 >= 0 and tuple(full[e - n + 1 : e + 1]) == key
                ]
            if ends:
                ends = sorted(set(ends), reverse=True)[: cfg.max_matches]
                return [e + 1 for e in ends]
        return []
