"""Random draft trees in the DraftTree encoding, for kernel tests."""

from __future__ import annotations

import itertools
import random

import torch


def random_tree(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int], list[int]]:
    """(first_child, next_sibling, tokens) of a random n-node tree; children in shuffled order."""
    parent = [-1] + [rng.randrange(i) for i in range(1, n)]
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[parent[i]].append(i)
    first_child, next_sibling = [-1] * n, [-1] * n
    for kids in children:
        rng.shuffle(kids)
    for i, kids in enumerate(children):
        if kids:
            first_child[i] = kids[0]
        for a, b in itertools.pairwise(kids):
            next_sibling[a] = b
    tokens = [rng.randrange(vocab) for _ in range(n)]
    return first_child, next_sibling, tokens


def batch_of_trees(
    rng: random.Random, sizes: list[int], vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Stacked trees of the given sizes: (first_child, next_sibling, tokens, offsets)."""
    fc: list[int] = []
    ns: list[int] = []
    tok: list[int] = []
    offsets = [0]
    for n in sizes:
        a, b, c = random_tree(rng, n, vocab)
        fc += a
        ns += b
        tok += c
        offsets.append(offsets[-1] + n)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return as_long(fc), as_long(ns), as_long(tok), offsets
