"""A speculative draft tree in the first-child / next-sibling encoding sglang and xgrammar use.

Node 0 is the last verified token (the root); its row in a tree bitmask holds the tokens allowed
*after* it, i.e. at the current matcher state. Every other node ``i`` carries a draft token
``tokens[i]``; its row holds the tokens allowed after the path root→i. ``-1`` means "none".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

NONE = -1


class MalformedTreeError(ValueError):
    """The arrays do not encode one tree rooted at node 0 (names the offending node)."""


def _as_int64(name: str, values: Any) -> np.ndarray:
    if hasattr(values, "detach"):  # a torch tensor: must live on the CPU
        if values.device.type != "cpu":
            raise MalformedTreeError(f"{name} must be on the CPU, got {values.device}")
        values = values.detach().numpy()
    array = np.ascontiguousarray(values, dtype=np.int64)
    if array.ndim != 1:
        raise MalformedTreeError(f"{name} must be 1-D, got shape {array.shape}")
    return array


@dataclass(frozen=True, eq=False)
class DraftTree:
    """One request's draft tree.

    Attributes:
        tokens: int64 ``[n]``, CPU. ``tokens[0]`` is the last verified token (not interpreted).
        first_child: int64 ``[n]``; index of node i's first child or -1.
        next_sibling: int64 ``[n]``; index of node i's next sibling or -1.

    Construction converts torch CPU tensors or sequences to contiguous int64 numpy arrays (no copy
    when they already are). Call :meth:`validate` on trees from untrusted producers.
    """

    tokens: np.ndarray
    first_child: np.ndarray
    next_sibling: np.ndarray

    def __init__(self, tokens: Any, first_child: Any, next_sibling: Any) -> None:
        object.__setattr__(self, "tokens", _as_int64("tokens", tokens))
        object.__setattr__(self, "first_child", _as_int64("first_child", first_child))
        object.__setattr__(self, "next_sibling", _as_int64("next_sibling", next_sibling))

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_parents(cls, tokens: Sequence[int], parents: Sequence[int]) -> DraftTree:
        """Build from a parent list (``parents[0] == -1``); siblings keep their index order."""
        n = len(tokens)
        if len(parents) != n:
            raise MalformedTreeError(f"{n} tokens but {len(parents)} parents")
        if n == 0 or parents[0] != NONE:
            raise MalformedTreeError("node 0 is the root and must have parent -1")
        first_child = [NONE] * n
        next_sibling = [NONE] * n
        last_child = [NONE] * n
        for node in range(1, n):
            parent = int(parents[node])
            if not 0 <= parent < n or parent == node:
                raise MalformedTreeError(f"node {node} has parent {parent}, not a node index")
            if last_child[parent] == NONE:
                first_child[parent] = node
            else:
                next_sibling[last_child[parent]] = node
            last_child[parent] = node
        tree = cls(list(tokens), first_child, next_sibling)
        tree.validate()
        return tree

    # -- checks ---------------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    def validate(self) -> None:
        """Raise :class:`MalformedTreeError` unless the arrays encode one tree rooted at node 0.

        Rejects: mismatched shapes, an empty tree, links outside ``[-1, n)``, a root with siblings
        or with a parent, a node with two parents, nodes unreachable from the root (including
        cycles), and negative draft tokens (node 0's token is not checked).
        """
        n = self.tokens.shape[0]
        if self.first_child.shape != (n,) or self.next_sibling.shape != (n,):
            raise MalformedTreeError(
                f"shape mismatch: tokens {self.tokens.shape}, first_child "
                f"{self.first_child.shape}, next_sibling {self.next_sibling.shape}"
            )
        if n == 0:
            raise MalformedTreeError("a draft tree needs at least the root node")
        for name, links in (("first_child", self.first_child), ("next_sibling", self.next_sibling)):
            bad = np.flatnonzero((links < NONE) | (links >= n))
            if bad.size:
                node = int(bad[0])
                raise MalformedTreeError(
                    f"{name}[{node}] = {int(links[node])} is outside [-1, {n})"
                )
        if self.next_sibling[0] != NONE:
            raise MalformedTreeError(f"the root (node 0) has a sibling {int(self.next_sibling[0])}")
        if n > 1 and (self.tokens[1:] < 0).any():
            node = int(np.flatnonzero(self.tokens[1:] < 0)[0]) + 1
            raise MalformedTreeError(f"node {node} has a negative draft token {self.tokens[node]}")
        incoming = np.bincount(
            np.concatenate([self.first_child, self.next_sibling])[
                np.concatenate([self.first_child, self.next_sibling]) >= 0
            ],
            minlength=n,
        )
        if incoming[0]:
            raise MalformedTreeError("the root (node 0) is linked as a child or sibling")
        twice = np.flatnonzero(incoming > 1)
        if twice.size:
            raise MalformedTreeError(f"node {int(twice[0])} is linked from more than one node")
        seen = np.zeros(n, dtype=bool)
        seen[0] = True
        count = 1
        stack = [int(self.first_child[0])]
        first_child = self.first_child.tolist()
        next_sibling = self.next_sibling.tolist()
        while stack:
            node = stack.pop()
            if node == NONE:
                continue
            if seen[node]:  # unreachable with indegree <= 1, kept as a guard against cycles
                raise MalformedTreeError(f"cycle through node {node}")
            seen[node] = True
            count += 1
            stack.append(next_sibling[node])
            stack.append(first_child[node])
        if count != n:
            missing = int(np.flatnonzero(~seen)[0])
            raise MalformedTreeError(
                f"node {missing} is not reachable from the root ({n - count} unreachable"
                " nodes; a cycle or a detached subtree)"
            )

    # -- derived views (computed once, CPU) -----------------------------------------------------

    @cached_property
    def preorder(self) -> list[int]:
        """Nodes in the order a DFS visits them: a node, its first child's subtree, then siblings.

        This is xgrammar's traversal order; the first-child path (the drafter's top-1) comes first.
        """
        first_child = self.first_child.tolist()
        next_sibling = self.next_sibling.tolist()
        order: list[int] = []
        stack = [0]
        while stack:
            node = stack.pop()
            while node != NONE:
                order.append(node)
                sibling = next_sibling[node]
                if sibling != NONE:
                    stack.append(sibling)
                node = first_child[node]
        return order

    @cached_property
    def parents(self) -> np.ndarray:
        """int64 ``[n]``: each node's parent, -1 for the root."""
        parents = [NONE] * self.num_nodes
        first_child = self.first_child.tolist()
        next_sibling = self.next_sibling.tolist()
        for node in self.preorder:
            child = first_child[node]
            while child != NONE:
                parents[child] = node
                child = next_sibling[child]
        return np.asarray(parents, dtype=np.int64)

    @cached_property
    def depths(self) -> np.ndarray:
        """int64 ``[n]``: number of draft tokens on the path root→i (root 0)."""
        depths = np.zeros(self.num_nodes, dtype=np.int64)
        parents = self.parents.tolist()
        for node in self.preorder[1:]:
            depths[node] = depths[parents[node]] + 1
        return depths

    def children(self, node: int) -> list[int]:
        """Children of ``node`` in sibling order."""
        out: list[int] = []
        child = int(self.first_child[node])
        while child != NONE:
            out.append(child)
            child = int(self.next_sibling[child])
        return out

    def path(self, node: int) -> list[int]:
        """Draft tokens on the path root→node, excluding the root's token."""
        parents = self.parents
        tokens: list[int] = []
        while node > 0:
            tokens.append(int(self.tokens[node]))
            node = int(parents[node])
        tokens.reverse()
        return tokens

    def paths(self) -> list[list[int]]:
        """``path(i)`` for every node."""
        return [self.path(node) for node in range(self.num_nodes)]

    def draw(self, label: Callable[[int], str] | None = None) -> str:
        """ASCII drawing, one line per node in preorder: ``index:label`` with box-drawing edges.

        ``label(token)`` renders a token (default: the id). The root shows as ``0:<root>``.
        """
        render = label or str
        lines = ["0:<root>"]

        def walk(node: int, prefix: str) -> None:
            kids = self.children(node)
            for k, child in enumerate(kids):
                last = k == len(kids) - 1
                lines.append(
                    f"{prefix}{'└─' if last else '├─'}{child}:{render(int(self.tokens[child]))}"
                )
                walk(child, prefix + ("  " if last else "│ "))

        walk(0, "")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"DraftTree(n={self.num_nodes}, tokens={self.tokens.tolist()[:8]}...)"
