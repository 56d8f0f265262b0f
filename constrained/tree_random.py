"""Draft trees for tests and benchmarks: EAGLE-like trees grown around a grammar-valid instance.

Not used when serving. A tree is grown best-first from the root (like an EAGLE drafter keeping its
top-scoring nodes): each expanded node gets up to ``topk`` children; the first child of a node on
the instance path continues the instance (its end is followed by a stop token, so paths can
terminate), the others are a mix of tokens the grammar allows at that node, stop tokens, and
uniformly random ids (which may exceed the tokenizer vocabulary when the model's is larger).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.base import GrammarMatcher
from espalier.constrained.tree import DraftTree


def sample_instance(
    matcher: GrammarMatcher, rng: np.random.Generator, max_tokens: int = 48
) -> list[int]:
    """A random grammar-valid token sequence from ``matcher``'s state (state restored).

    Picks allowed non-stop tokens; once the grammar can terminate, a coin flip or ``max_tokens``
    ends the sequence with a stop token (also when nothing else is allowed).
    """
    row = bm.allocate(1, matcher.vocab_size, fill=0)
    stops = set(getattr(getattr(matcher, "tokenizer", None), "stop_token_ids", ()))
    tokens: list[int] = []
    for _ in range(4 * max_tokens):
        matcher.fill_bitmask(row, 0)
        allowed = np.flatnonzero(bm.unpack_allowed(row[0], matcher.vocab_size))
        others = [int(t) for t in allowed[:4096] if int(t) not in stops]
        done = len(tokens) >= max_tokens or rng.random() < 0.15
        if not others or (matcher.can_terminate() and done):
            ending = [int(t) for t in allowed if int(t) in stops]
            if ending:
                tokens.append(ending[0])  # not accepted: the matcher stays before it
            break
        token = others[int(rng.integers(len(others)))]
        if not matcher.accept(token):
            break
        tokens.append(token)
    matcher.rollback(len(tokens) - (1 if tokens and tokens[-1] in stops else 0))
    return tokens


def grow_tree(
    fresh: Callable[[], GrammarMatcher],
    prefix: Sequence[int],
    instance: Sequence[int],
    num_nodes: int,
    rng: np.random.Generator,
    *,
    topk: int = 4,
    max_depth: int = 16,
    p_allowed: float = 0.5,
    p_stop: float = 0.05,
) -> DraftTree:
    """An EAGLE-like tree of at most ``num_nodes`` nodes (see the module docstring).

    ``fresh()`` makes a matcher at the start state; ``prefix`` is replayed first (the root's
    state); ``instance`` is the continuation the first children follow.
    """
    probe = fresh()
    vocab = probe.vocab_size
    stops = list(getattr(getattr(probe, "tokenizer", None), "stop_token_ids", ()))
    row = bm.allocate(1, vocab, fill=0)
    tokens = [0]
    parents = [-1]
    depth = [0]
    on_path = [0]  # index into the instance of the node's next token, -1 = off the path
    valid = [True]
    heap: list[tuple[float, int]] = [(0.0, 0)]
    score = [0.0]
    while heap and len(tokens) < num_nodes:
        _, node = heapq.heappop(heap)
        if depth[node] >= max_depth:
            continue
        allowed = np.zeros(0, dtype=np.int64)
        if valid[node]:
            allowed = _allowed_after(fresh, prefix, _path(tokens, parents, node), row)
        chosen: list[tuple[int, float, int, bool]] = []  # token, prob, on_path, valid
        k = on_path[node]
        if 0 <= k < len(instance):
            chosen.append((int(instance[k]), 0.7, k + 1, True))
        for _ in range(topk * 3):
            if len(chosen) >= topk:
                break
            draw = rng.random()
            if draw < p_stop and stops:
                token = int(stops[int(rng.integers(len(stops)))])
                prob = 0.05
            elif draw < p_stop + p_allowed and allowed.size:
                token = int(allowed[int(rng.integers(len(allowed)))])
                prob = float(rng.uniform(0.05, 0.25))
            else:
                token = int(rng.integers(vocab))
                prob = 0.02
            if any(token == c[0] for c in chosen):
                continue
            chosen.append((token, prob, -1, valid[node] and _contains(allowed, token)))
        for token, prob, path_index, is_valid in chosen:
            if len(tokens) >= num_nodes:
                break
            tokens.append(token)
            parents.append(node)
            depth.append(depth[node] + 1)
            on_path.append(path_index)
            valid.append(is_valid)
            score.append(score[node] + math.log(prob))
            heapq.heappush(heap, (-score[-1], len(tokens) - 1))
    return DraftTree.from_parents(tokens, parents)


def _path(tokens: list[int], parents: list[int], node: int) -> list[int]:
    out: list[int] = []
    while node > 0:
        out.append(tokens[node])
        node = parents[node]
    out.reverse()
    return out


def _allowed_after(
    fresh: Callable[[], GrammarMatcher], prefix: Sequence[int], path: list[int], row: torch.Tensor
) -> np.ndarray:
    """Sorted int64 ids the grammar allows after ``prefix + path`` (empty if the path fails)."""
    matcher = fresh()
    for token in [*prefix, *path]:
        if not matcher.accept(token):
            return np.zeros(0, dtype=np.int64)
    matcher.fill_bitmask(row, 0)
    return np.flatnonzero(bm.unpack_allowed(row[0], matcher.vocab_size))


def _contains(sorted_ids: np.ndarray, token: int) -> bool:
    at = int(np.searchsorted(sorted_ids, token))
    return at < sorted_ids.size and int(sorted_ids[at]) == token
