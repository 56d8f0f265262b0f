"""DraftTree: validation of malformed trees, derived views, construction helpers, drawing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from espalier.constrained.tree import DraftTree, MalformedTreeError
from tests.fixtures.tree_random import tree_from_paths

#  0:<root>
#  ├─1:10
#  │ ├─3:30
#  │ └─4:40
#  │   └─5:50
#  └─2:20
TOKENS = [0, 10, 20, 30, 40, 50]
FIRST_CHILD = [1, 3, -1, -1, 5, -1]
NEXT_SIBLING = [-1, 2, -1, 4, -1, -1]


def sample() -> DraftTree:
    return DraftTree(TOKENS, FIRST_CHILD, NEXT_SIBLING)


def test_views_of_a_small_tree() -> None:
    tree = sample()
    tree.validate()
    assert tree.num_nodes == 6
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 4]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 3]
    assert tree.preorder == [0, 1, 3, 4, 5, 2]
    assert tree.children(1) == [3, 4]
    assert tree.path(5) == [10, 40, 50]
    assert tree.paths()[0] == []
    assert tree.draw() == "\n".join(
        ["0:<root>", "├─1:10", "│ ├─3:30", "│ └─4:40", "│   └─5:50", "└─2:20"]
    )


def test_torch_and_numpy_inputs_become_int64_numpy() -> None:
    tree = DraftTree(
        torch.tensor(TOKENS, dtype=torch.int32),
        np.asarray(FIRST_CHILD, dtype=np.int32),
        torch.tensor(NEXT_SIBLING),
    )
    assert tree.tokens.dtype == np.int64 and tree.first_child.dtype == np.int64
    tree.validate()


def test_from_parents_and_from_paths_round_trip() -> None:
    tree = DraftTree.from_parents(TOKENS, [-1, 0, 0, 1, 1, 4])
    assert tree.first_child.tolist() == FIRST_CHILD
    assert tree.next_sibling.tolist() == NEXT_SIBLING
    trie = tree_from_paths(7, [[1, 2], [1, 3], [4]])
    assert trie.tokens.tolist() == [7, 1, 2, 3, 4]
    assert trie.draw() == "\n".join(["0:<root>", "├─1:1", "│ ├─2:2", "│ └─3:3", "└─4:4"])


def test_a_root_only_tree_is_valid() -> None:
    tree = DraftTree([5], [-1], [-1])
    tree.validate()
    assert tree.preorder == [0]


@pytest.mark.parametrize(
    ("tokens", "first_child", "next_sibling", "message"),
    [
        ([0, 1], [1, -1], [-1], "shape mismatch"),
        ([], [], [], "at least the root"),
        ([0, 1], [2, -1], [-1, -1], "outside"),
        ([0, 1], [1, -1], [-1, -2], "outside"),
        ([0, 1, 2], [1, -1, -1], [2, -1, -1], "root \\(node 0\\) has a sibling"),
        ([0, 1], [1, 0], [-1, -1], "root \\(node 0\\) is linked"),
        ([0, 1, 2], [1, 2, -1], [-1, 2, -1], "more than one node"),
        ([0, 1, 2], [1, -1, -1], [-1, -1, -1], "node 2 is not reachable"),
        ([0, 1, 2, 3], [1, -1, 3, 2], [-1, -1, -1, -1], "not reachable"),  # a detached cycle
        ([0, -5], [1, -1], [-1, -1], "negative draft token"),
    ],
)
def test_malformed_trees_are_rejected(
    tokens: list[int], first_child: list[int], next_sibling: list[int], message: str
) -> None:
    with pytest.raises(MalformedTreeError, match=message):
        DraftTree(tokens, first_child, next_sibling).validate()


def test_two_dimensional_or_gpu_inputs_are_rejected() -> None:
    with pytest.raises(MalformedTreeError, match="1-D"):
        DraftTree([[0]], [-1], [-1])
    with pytest.raises(MalformedTreeError, match="parent"):
        DraftTree.from_parents([0, 1], [-1, 1])
