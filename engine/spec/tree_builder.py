"""Draft trees under construction: a deduplicating trie, reranking, and the tensors verify needs.

A :class:`Draft` is a tree in parent-pointer form with nodes in topological order
(``parents[i] < i``). Node 0 is the root: the last verified token, whose K/V is not in the cache
yet. Every other node is a proposed next token after the path root→parent. ``scores[i]`` is the
drafter's cumulative log-probability of the path root→i (0 for the root; a grammar-forced node
keeps its parent's score: it costs nothing); reranking keeps the best-scoring nodes, and since a
score never exceeds its parent's, the kept set is closed under ancestors.

The same tree in first-child / next-sibling form (``constrained.tree.DraftTree``, the encoding the
tree-mask walk and the verification kernels read) comes from :func:`sibling_links`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


class NodeSource(enum.IntEnum):
    """Which drafter proposed a node (the first one wins when drafts merge)."""

    ROOT = 0
    FORCED = 1
    NGRAM = 2
    MODEL = 3


@dataclass
class Draft:
    """One request's draft tree (see the module docstring).

    tokens, parents, sources: python lists of length N (N >= 1, node 0 = root, parents[0] = -1).
    scores: cumulative log-probability per node (float, <= 0).
    """

    tokens: list[int]
    parents: list[int]
    scores: list[float]
    sources: list[int]

    @classmethod
    def root_only(cls, root_token: int) -> Draft:
        return cls([root_token], [-1], [0.0], [NodeSource.ROOT])

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @property
    def num_draft_tokens(self) -> int:
        """Proposed tokens (every node but the root)."""
        return len(self.tokens) - 1

    def depths(self) -> list[int]:
        """Depth per node (root = 0)."""
        depth = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            depth[i] = depth[self.parents[i]] + 1
        return depth

    def path(self, node: int) -> list[int]:
        """Node indices from the root's first child down to ``node`` (empty for the root)."""
        out: list[int] = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path(node)]

    def leaves(self) -> list[int]:
        has_child = [False] * len(self.parents)
        for p in self.parents[1:]:
            has_child[p] = True
        return [i for i, c in enumerate(has_child) if not c]

    def validate(self) -> None:
        """Raise ValueError unless the tree is well formed (topological, no duplicate children)."""
        n = len(self.tokens)
        if n < 1 or self.parents[0] != -1:
            raise ValueError("a draft needs a root with parent -1")
        if not (len(self.parents) == len(self.scores) == len(self.sources) == n):
            raise ValueError("draft fields differ in length")
        seen: set[tuple[int, int]] = set()
        for i in range(1, n):
            p = self.parents[i]
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: nodes must follow their parent")
            key = (p, self.tokens[i])
            if key in seen:
                raise ValueError(f"node {i} duplicates a sibling's token {self.tokens[i]}")
            seen.add(key)


@dataclass
class TreeBuilder:
    """A trie rooted at the last verified token: adding an existing (parent, token) returns the
    existing node and keeps the better score, so merged drafts share identical prefixes."""

    root_token: int
    tokens: list[int] = field(init=False)
    parents: list[int] = field(init=False)
    scores: list[float] = field(init=False)
    sources: list[int] = field(init=False)
    _children: dict[tuple[int, int], int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.tokens, self.parents = [self.root_token], [-1]
        self.scores, self.sources = [0.0], [int(NodeSource.ROOT)]

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def child(self, parent: int, token: int) -> int | None:
        return self._children.get((parent, token))

    def add(self, parent: int, token: int, score: float, source: NodeSource) -> int:
        """The node for ``token`` under ``parent`` (created if new). Scores are clamped to the
        parent's so that the ancestor-closure of reranking holds."""
        score = min(score, self.scores[parent])
        node = self._children.get((parent, token))
        if node is not None:
            if score > self.scores[node]:
                self.scores[node] = score
            return node
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.sources.append(int(source))
        self._children[(parent, token)] = node
        return node

    def add_path(
        self,
        parent: int,
        tokens: Sequence[int],
        scores: Sequence[float] | None,
        source: NodeSource,
    ) -> list[int]:
        """Add a chain under ``parent``; ``scores`` None = each node keeps its parent's score."""
        nodes = []
        for j, token in enumerate(tokens):
            score = self.scores[parent] if scores is None else scores[j]
            parent = self.add(parent, token, score, source)
            nodes.append(parent)
        return nodes

    def graft(self, at: int, draft: Draft) -> list[int]:
        """Add ``draft``'s non-root nodes under node ``at`` (scores offset by ``at``'s score).
        Returns the builder node of every draft node (index 0 -> ``at``)."""
        mapping = [at] * draft.num_nodes
        base = self.scores[at]
        for i in range(1, draft.num_nodes):
            mapping[i] = self.add(
                mapping[draft.parents[i]],
                draft.tokens[i],
                base + draft.scores[i],
                NodeSource(draft.sources[i]),
            )
        return mapping

    def build(self, max_draft_tokens: int | None = None) -> Draft:
        draft = Draft(list(self.tokens), list(self.parents), list(self.scores), list(self.sources))
        if max_draft_tokens is not None and draft.num_draft_tokens > max_draft_tokens:
            draft = select_top(draft, max_draft_tokens)
        return draft


def select_top(draft: Draft, max_draft_tokens: int) -> Draft:
    """Keep the root and the ``max_draft_tokens`` best-scoring other nodes (ties: shallower, then
    earlier), preserving topological order. The kept set is closed under ancestors because a
    node's score never exceeds its parent's and an ancestor is always shallower."""
    if draft.num_draft_tokens <= max_draft_tokens:
        return draft
    depth = draft.depths()
    order = sorted(range(1, draft.num_nodes), key=lambda i: (-draft.scores[i], depth[i], i))
    keep = sorted([0, *order[:max_draft_tokens]])
    remap = {old: new for new, old in enumerate(keep)}
    return Draft(
        tokens=[draft.tokens[i] for i in keep],
        parents=[-1] + [remap[draft.parents[i]] for i in keep[1:]],
        scores=[draft.scores[i] for i in keep],
        sources=[draft.sources[i] for i in keep],
    )


def sibling_links(parents: Sequence[int]) -> tuple[list[int], list[int]]:
    """``(first_child, next_sibling)`` per node (-1 = none), siblings in node order."""
    n = len(parents)
    first_child, next_sibling = [-1] * n, [-1] * n
    last_child = [-1] * n
    for i in range(1, n):
        p = parents[i]
        if last_child[p] < 0:
            first_child[p] = i
        else:
            next_sibling[last_child[p]] = i
        last_child[p] = i
    return first_child, next_sibling


def ancestor_matrix(parents: Sequence[int]) -> torch.Tensor:
    """bool ``[N, N]`` (CPU): row i is True at i and at each of its ancestors."""
    n = len(parents)
    mask = torch.zeros((n, n), dtype=torch.bool)
    mask[0, 0] = True
    rows = mask.numpy()
    for i in range(1, n):
        rows[i] = rows[parents[i]]
        rows[i, i] = True
    return mask


def tree_attention_mask(parents: Sequence[int], context_len: int) -> torch.Tensor:
    """bool ``[N, context_len + N]`` (CPU): every node sees the whole context, its ancestors and
    itself (the runner's ``SeqInput.custom_mask`` for a tree fed after ``context_len`` entries)."""
    n = len(parents)
    mask = torch.ones((n, context_len + n), dtype=torch.bool)
    mask[:, context_len:] = ancestor_matrix(parents)
    return mask
