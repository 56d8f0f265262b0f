"""Host-side inputs of a flashinfer paged-attention plan, built from one step's metadata.

flashinfer describes a batch by CSR arrays (int32; built on the CPU here, ``plan`` copies them to
the device): ``qo_indptr [B + 1]`` (packed query rows per sequence), ``kv_indptr [B + 1]`` (pages
per sequence), ``kv_indices`` (physical page ids, concatenated), ``last_page_len [B]`` (entries
used in each sequence's last page, 1..page_size). A page is one KV-cache block.

Masks: flashinfer's causal rule (query ``t`` of a sequence sees cache index ``j <= kv_len - q_len
+ t``) and its ``window_left = window - 1`` rule (on cache indices) equal the rule of
``attention/base.py`` whenever rope positions equal cache indices. A tree (custom mask, positions
by depth) does not, so for such a step each layer kind gets an explicit mask: the custom mask (or
causal rows for the other sequences), and on sliding-window layers also ``q_pos - k_pos <
window`` with ``k_pos`` the base rule's key position. Masks are flattened row-major per sequence
(``[q_len, kv_len]``) and concatenated, the layout ``plan(custom_mask=...)`` takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from espalier.engine.model.attention.base import AttentionMetadata


@dataclass(frozen=True)
class PagedLayout:
    """int32 CPU tensors: qo_indptr ``[B + 1]``, kv_indptr ``[B + 1]``, kv_indices ``[pages]``,
    last_page_len ``[B]``."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.last_page_len.shape[0])

    def to(self, device: torch.device) -> PagedLayout:
        """The same arrays on ``device`` (non-blocking copies)."""
        arrays = (self.qo_indptr, self.kv_indptr, self.kv_indices, self.last_page_len)
        return PagedLayout(*(t.to(device, non_blocking=True) for t in arrays))


def paged_layout(
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
) -> PagedLayout:
    """The CSR arrays of sequences with ``q_lens[b]`` new tokens and ``kv_lens[b]`` cache entries
    after the step (the new tokens included), stored in ``block_tables[b]``."""
    qo, kv, last = [0], [0], []
    indices: list[int] = []
    for q_len, kv_len, table in zip(q_lens, kv_lens, block_tables):
        pages = -(-kv_len // block_size)
        if len(table) < pages:
            raise ValueError(f"block table covers {len(table) * block_size} < {kv_len} entries")
        indices.extend(table[:pages])
        qo.append(qo[-1] + q_len)
        kv.append(kv[-1] + pages)
        last.append(kv_len - (pages - 1) * block_size)

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    return PagedLayout(t(qo), t(kv), t(indices), t(last))


def meta_layout(meta: AttentionMetadata) -> PagedLayout:
    """``paged_layout`` of a step's metadata."""
    q_lens = [meta.q_indptr[b + 1] - meta.q_indptr[b] for b in range(meta.num_seqs)]
    return paged_layout(q_lens, meta.kv_lens, meta.block_tables, meta.block_size)


def needs_explicit_mask(meta: AttentionMetadata, b: int, window: int | None) -> bool:
    """Whether sequence ``b`` on a layer with ``window`` differs from flashinfer's causal rule."""
    if meta.custom_masks[b] is not None:
        return True
    if window is None:
        return False
    start = meta.context_lens[b]
    return meta.positions_list[b] != list(range(start, meta.kv_lens[b]))


def explicit_mask(meta: AttentionMetadata, b: int, window: int | None) -> np.ndarray:
    """bool ``[q_len, kv_len]`` of sequence ``b``: the rule of ``attention/base.py``."""
    return sequence_mask(
        meta.context_lens[b], meta.kv_lens[b], meta.positions_list[b], meta.custom_masks[b], window
    )


def sequence_mask(
    context_len: int,
    kv_len: int,
    positions: Sequence[int],
    custom: torch.Tensor | None,
    window: int | None,
) -> np.ndarray:
    """bool ``[q_len, kv_len]`` of one sequence: ``custom`` (CPU or device bool) or causal, and
    on a sliding-window layer ``q_pos - k_pos < window`` (key positions: cache index for context
    entries, ``positions`` for the new ones)."""
    q_len = kv_len - context_len
    if custom is None:
        mask = np.arange(kv_len)[None, :] <= (context_len + np.arange(q_len))[:, None]
    else:
        mask = custom.detach().to("cpu", torch.bool).numpy()
    if window is not None:
        q_pos = np.asarray(positions, dtype=np.int64)
        k_pos = np.arange(kv_len, dtype=np.int64)
        k_pos[context_len:] = q_pos
        mask = mask & ((q_pos[:, None] - k_pos[None, :]) < window)
    return mask


def step_mask(meta: AttentionMetadata, window: int | None) -> list[np.ndarray] | None:
    """Per sequence, the flattened explicit mask of the whole step for layers with ``window``;
    None when flashinfer's causal rule (with ``window_left = window - 1``) is exact for all."""
    if not any(needs_explicit_mask(meta, b, window) for b in range(meta.num_seqs)):
        return None
    return [explicit_mask(meta, b, window).ravel() for b in range(meta.num_seqs)]


def pack_mask_segments(segments: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """flashinfer's packed custom mask: each sequence's flattened bool mask packed into whole
    bytes, bit ``i`` of a segment at byte ``i // 8``, bit ``i % 8`` (little bit order).
    Returns uint8 ``[bytes]`` and the int32 byte offset of each segment ``[B + 1]``."""
    packed = [np.packbits(seg.astype(bool), bitorder="little") for seg in segments]
    indptr = np.zeros(len(packed) + 1, dtype=np.int32)
    indptr[1:] = np.cumsum([len(p) for p in packed])
    return np.concatenate(packed), indptr
