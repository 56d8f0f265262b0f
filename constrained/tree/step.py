"""Step reuse: advance a matcher along the verified path and keep that node's row for next time.

The next step's root is the last token the grammar has seen; when verification ends on a tree
node whose row was filled, that row *is* the next root row (pass it as ``root_row`` to
``GrammarMatcher.fill_tree``) and the grammar need not be asked again.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from espalier.constrained.base import GrammarMatcher
from espalier.constrained.tree import DraftTree
from espalier.constrained.tree.masks import TreeMasks


def advance(
    matcher: GrammarMatcher,
    tree: DraftTree,
    masks: TreeMasks,
    out: torch.Tensor | np.ndarray,
    accepted_nodes: Sequence[int],
    bonus_token: int | None = None,
) -> np.ndarray | None:
    """Accept the tokens of ``accepted_nodes`` (then ``bonus_token``); return the new root row.

    Args:
        accepted_nodes: the verified path below the root, in order (each a child of the previous,
            the first a child of node 0), every one ``filled`` in ``masks``.
        bonus_token: the token sampled after the path, if any. When it is a filled child of the
            last node that child's row is reused; otherwise the token is accepted and ``None``
            returned (the next step must fill its root row).

    Returns:
        a copy (int32 ``[words]``) of the row of the last node the matcher is now at, or ``None``.
        Raises ``ValueError`` if the path is not a filled path or the grammar rejects a token.
    """
    rows = out.numpy() if isinstance(out, torch.Tensor) else out
    parents = tree.parents
    node = 0
    nodes = list(accepted_nodes)
    if bonus_token is not None:
        child = next(
            (
                c
                for c in tree.children(nodes[-1] if nodes else 0)
                if tree.tokens[c] == bonus_token and masks.filled[c]
            ),
            None,
        )
        if child is not None:
            nodes.append(child)
            bonus_token = None
    accepted = 0
    for nxt in nodes:
        if parents[nxt] != node or not masks.filled[nxt]:
            matcher.rollback(accepted)
            raise ValueError(f"node {nxt} does not continue a filled path from node {node}")
        if not matcher.accept(int(tree.tokens[nxt])):
            matcher.rollback(accepted)
            raise ValueError(f"the grammar rejected the token of verified node {nxt}")
        accepted += 1
        node = nxt
    if bonus_token is not None:
        if not matcher.accept(bonus_token):
            matcher.rollback(accepted)
            raise ValueError(f"the grammar rejected the bonus token {bonus_token}")
        return None
    return rows[node].copy()
