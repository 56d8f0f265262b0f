"""The slow obvious twin of :func:`fill_tree_bitmask`: replay every path on a fresh matcher.

Used by the tests and by ``bench/tree.py`` to count mismatches of the fast paths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.base import GrammarMatcher
from espalier.constrained.traverse import TreeMasks
from espalier.constrained.tree import DraftTree


@dataclass(frozen=True)
class Mismatch:
    """One disagreement between a fast tree fill and the replay oracle."""

    node: int
    what: str  # "valid", "terminated", "row" or "filled-invalid"
    path: tuple[int, ...]

    def __str__(self) -> str:
        return f"node {self.node} ({self.what}) path={list(self.path)}"


def replay_tree(
    fresh: Callable[[], GrammarMatcher], prefix: list[int], tree: DraftTree
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each node: (valid, terminated, row) by replaying ``prefix + path(i)`` from scratch.

    A path is valid when each of its tokens is allowed by the mask before it and accepted (a
    backend's mask may be stricter than ``accept``, e.g. llguidance allows only tokenizations the
    tokenizer can produce; what the model may sample is what the mask allows).
    Returns bool ``[n]``, bool ``[n]`` and int32 ``[n, words]`` (rows of invalid nodes are 0).
    """
    n = tree.num_nodes
    probe = fresh()
    rows = bm.allocate(n, probe.vocab_size, fill=0)
    valid = np.zeros(n, dtype=bool)
    terminated = np.zeros(n, dtype=bool)
    parents = tree.parents.tolist()
    for node in tree.preorder:  # parents first: a node's mask check reads its parent's replay
        parent = parents[node]
        token = int(tree.tokens[node])
        if parent >= 0 and not (valid[parent] and bm.is_allowed(rows[parent].numpy(), token)):
            continue
        matcher = fresh()
        for token in prefix:
            if not matcher.accept(token):
                raise ValueError(f"the prefix token {token} is rejected by the grammar")
        if all(matcher.accept(token) for token in tree.path(node)):
            valid[node] = True
            terminated[node] = matcher.is_terminated()
            matcher.fill_bitmask(rows, node)
    return valid, terminated, rows.numpy()


def compare(
    masks: TreeMasks,
    out: torch.Tensor | np.ndarray,
    tree: DraftTree,
    oracle: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> list[Mismatch]:
    """Every disagreement of ``masks``/``out`` with the oracle.

    Exact when the walk finished; after ``budget_hit`` only filled/valid nodes are checked (an
    unreached node is allowed to be unknown, never wrong).
    """
    valid, terminated, rows = oracle
    got = out.numpy() if isinstance(out, torch.Tensor) else out
    problems: list[Mismatch] = []
    for node in range(tree.num_nodes):
        path = tuple(tree.path(node))
        if masks.filled[node] and not masks.valid[node]:
            problems.append(Mismatch(node, "filled-invalid", path))
        if masks.budget_hit:
            if masks.valid[node] and not valid[node]:
                problems.append(Mismatch(node, "valid", path))
        elif masks.valid[node] != valid[node] or masks.filled[node] != valid[node]:
            problems.append(Mismatch(node, "valid", path))
        if masks.filled[node] and valid[node]:
            if masks.terminated[node] != terminated[node]:
                problems.append(Mismatch(node, "terminated", path))
            if not np.array_equal(got[node], rows[node]):
                problems.append(Mismatch(node, "row", path))
        if not got[node].any():
            problems.append(Mismatch(node, "zero-row", path))
    return problems
