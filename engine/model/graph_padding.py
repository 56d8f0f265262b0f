"""A step laid out as a captured CUDA-graph shape: ``bucket`` sequences of ``n`` rows each.

A graph replays a forward of exactly ``bucket * n`` new tokens (``engine/model/cuda_graphs.py``). A
step fits a shape when:

- ``n = 1`` (decode): every sequence feeds one token, causal, at its cache index;
- ``n > 1`` (tree): every sequence feeds a draft tree (custom mask, logits for every node) of
  at most ``n`` nodes, or one token (a root-only tree, or a plain decode sharing the step).

Padding, so that the real rows compute exactly what they compute in an eager step:

- A sequence of ``m < n`` tokens gets ``n - m`` dummy rows after its own: token 0 at its first
  token's position, K/V written into the reserved scratch block (slots ``scratch * bs + j``,
  ``m <= j < n``), attending through its first row's mask. Its ``kv_len`` stays ``context +
  m``: the dummies' entries are in no sequence's pages, so no real row sees them, and the
  dummies' own rows see only real entries (finite values). Trees of different sizes (requests
  near their ``max_tokens`` draft fewer nodes) replay one graph this way instead of running
  eagerly, whose launch costs about ten times a replay's host time
  (``docs/decisions/padded-tree-graphs.md``).
- ``bucket - B`` dummy sequences of ``n`` tokens in the scratch block, causal among themselves.

Dummy rows are dropped: ``rows`` / ``logits_rows`` index the real ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from espalier.engine.model.attention.paged_plan import PagedLayout, paged_layout, sequence_mask

if TYPE_CHECKING:
    from espalier.engine.model.runner import SeqInput

Window = int | None


def decode_shaped(s: SeqInput) -> bool:
    """One token, causal, at its cache index: a sequence of a decode shape (``n = 1``)."""
    return (
        s.q_len == 1
        and s.custom_mask is None
        and (s.positions is None or s.positions[0] == s.context_len)
    )


def tree_shaped(s: SeqInput) -> bool:
    """A draft tree (custom mask, logits for every node) or one token with logits: a sequence
    that a tree shape (``n >= q_len``) takes, padded."""
    return (s.custom_mask is not None and s.logits == "all") or (
        s.q_len == 1 and s.logits != "none"
    )


def step_tokens(batch: Sequence[SeqInput]) -> int | None:
    """The smallest ``n`` of a shape that fits the step: 1 for a decode step; for a step of
    tree-shaped sequences the most tokens of one of them, at least 2 (a tree shape's ``n`` is
    more than 1); None when no shape fits (prefill chunks: eager)."""
    if not batch:
        return None
    if all(decode_shaped(s) for s in batch):
        return 1
    if all(tree_shaped(s) for s in batch):
        return max(2, *(s.q_len for s in batch))
    return None


@dataclass(frozen=True)
class PaddedStep:
    """One step padded to ``bucket x n`` rows (host side, CPU).

    inputs: int64 ``[3, bucket * n]``: token ids, rope positions, cache slots.
    kv_lens / tables: per padded sequence, cache entries after the step and its pages.
    masks: per layer window, each padded sequence's bool ``[n, kv_len]`` mask flattened; None for
        a decode shape (flashinfer's causal rule).
    rows: the padded row of each of the batch's new tokens, in input order.
    logits_rows / logits_indptr: the rows that get logits, and sequence b's share of them
        (``logits_indptr[b]:logits_indptr[b + 1]``), as an eager step returns them.
    padded: dummy rows inside the batch's sequences (0: every tree has ``n`` nodes).
    """

    bucket: int
    n: int
    inputs: torch.Tensor
    kv_lens: list[int]
    tables: list[Sequence[int]]
    masks: dict[Window, list[np.ndarray]] | None
    rows: list[int]
    logits_rows: list[int]
    logits_indptr: list[int]
    padded: int

    def layout(self, block_size: int) -> PagedLayout:
        """The paged layout of the padded step (``n`` query rows per sequence)."""
        return paged_layout([self.n] * self.bucket, self.kv_lens, self.tables, block_size)


def _padded_tables(
    batch: Sequence[SeqInput], bucket: int, n: int, scratch_block: int
) -> tuple[list[int], list[Sequence[int]]]:
    """Per padded sequence, cache entries after the step and its pages (the batch's tables
    themselves, not copies: this runs on every replay): what a plan reads."""
    kv_lens = [s.context_len + s.q_len for s in batch] + [n] * (bucket - len(batch))
    tables = [s.block_table for s in batch] + [[scratch_block]] * (bucket - len(batch))
    return kv_lens, tables


def padded_layout(
    batch: Sequence[SeqInput], bucket: int, n: int, *, block_size: int, scratch_block: int
) -> PagedLayout:
    """The paged layout of ``batch`` padded to ``bucket x n`` rows, without the inputs (a plan
    made ahead needs only this)."""
    kv_lens, tables = _padded_tables(batch, bucket, n, scratch_block)
    return paged_layout([n] * bucket, kv_lens, tables, block_size)


def pad_step(
    batch: Sequence[SeqInput],
    bucket: int,
    n: int,
    *,
    block_size: int,
    scratch_block: int,
    windows: Sequence[Window],
) -> PaddedStep:
    """``batch`` (``len(batch) <= bucket``; each sequence at most ``n`` tokens, decode- or
    tree-shaped as ``n`` asks) padded to ``bucket x n`` rows (module docstring). ``windows``:
    the model's layer windows (masks are made per window; unused for ``n = 1``)."""
    assert len(batch) <= bucket and n <= block_size
    bs, base = block_size, scratch_block * block_size
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    kv_lens, tables = _padded_tables(batch, bucket, n, scratch_block)
    rows: list[int] = []
    logits_rows: list[int] = []
    indptr = [0]
    masks: dict[Window, list[np.ndarray]] | None = None if n == 1 else {w: [] for w in windows}
    padded = 0
    for b, s in enumerate(batch):
        m, ctx, table = s.q_len, s.context_len, s.block_table
        assert m <= n
        pos = list(range(ctx, ctx + m)) if s.positions is None else list(s.positions)
        pad = n - m
        padded += pad
        tokens.extend(s.token_ids)
        tokens.extend([0] * pad)
        positions.extend(pos + [pos[0]] * pad)
        slots.extend(table[i // bs] * bs + i % bs for i in range(ctx, ctx + m))
        slots.extend(base + j for j in range(m, n))
        first = b * n
        rows.extend(range(first, first + m))
        if s.logits == "all":
            logits_rows.extend(range(first, first + m))
        elif s.logits == "last":
            logits_rows.append(first + m - 1)
        indptr.append(len(logits_rows))
        if masks is not None:
            for window, segments in masks.items():
                mask = sequence_mask(ctx, ctx + m, pos, s.custom_mask, window)
                if pad:  # the dummies attend as the first row does
                    mask = np.concatenate([mask, np.repeat(mask[:1], pad, axis=0)])
                segments.append(mask.ravel())
    dummies = bucket - len(batch)
    tokens.extend([0] * (dummies * n))
    positions.extend(list(range(n)) * dummies)
    slots.extend([base + j for j in range(n)] * dummies)
    if masks is not None and dummies:
        causal = np.tril(np.ones((n, n), dtype=bool)).ravel()
        for segments in masks.values():
            segments.extend([causal] * dummies)
    inputs = torch.tensor([tokens, positions, slots], dtype=torch.int64)
    return PaddedStep(bucket, n, inputs, kv_lens, tables, masks, rows, logits_rows, indptr, padded)
