"""Torch SDPA over the paged KV cache (CPU and CUDA).

Per step, ``prepare`` groups the sequences (similar ``q_len`` together, to bound padding) and
builds per group, on the device: the packed-row index of each padded query, the physical slot of
each padded key, and one bool mask per distinct sliding window. Per layer, ``attend`` gathers
each group's keys from the cache (the layer has written its new K/V there) and runs one SDPA call
per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from espalier.engine.config import ModelConfig
from espalier.engine.kv_cache import KVCache
from espalier.engine.model.attention.base import (
    AttentionMetadata,
    LayerSpec,
    int64_to_device,
)

_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_PAD_SLACK = 4096  # padded q*kv elements tolerated per group beyond 2x the exact work


@dataclass
class _Group:
    """Padded sub-batch. rows: int64 [G, Q] packed row per query (pad -> 0); valid rows flattened:
    ``out_src`` (index into G*Q) and ``out_dst`` (packed row). slots: int64 [G, K].
    masks: window (None = full) -> bool [G, 1, Q, K]."""

    rows: torch.Tensor
    out_src: torch.Tensor
    out_dst: torch.Tensor
    slots: torch.Tensor
    masks: dict[int | None, torch.Tensor]


class SdpaBackend:
    """``torch.nn.functional.scaled_dot_product_attention`` per padded group of sequences."""

    name = "sdpa"

    def __init__(self, model_config: ModelConfig) -> None:
        self.windows = sorted(
            {model_config.window(i) for i in range(model_config.num_layers)},
            key=lambda w: -1 if w is None else w,
        )

    def warm_up(self, block_size: int, max_rows: int) -> None:
        """Nothing to build: torch's own kernels."""

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.backend_state = [
            self._build_group(meta, members) for members in _group_sequences(meta)
        ]

    def attend(
        self, spec: LayerSpec, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        k_flat, v_flat = kv_cache.flat(spec.layer)
        groups: list[_Group] = meta.backend_state
        if (
            len(groups) == 1
            and groups[0].rows.shape[0] == 1
            and groups[0].out_src.numel() == q.shape[0]
        ):
            return self._attend(spec, q, k_flat, v_flat, groups[0])
        out = torch.empty_like(q)
        for group in groups:
            out.index_copy_(0, group.out_dst, self._attend(spec, q, k_flat, v_flat, group))
        return out

    def _attend(
        self,
        spec: LayerSpec,
        q: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        group: _Group,
    ) -> torch.Tensor:
        """Rows ``out_dst`` of the output, ``[n_valid, H, D]``."""
        g, q_len = group.rows.shape
        heads, dim = q.shape[1], q.shape[2]
        qg = q.index_select(0, group.rows.reshape(-1)).view(g, q_len, heads, dim).transpose(1, 2)
        kv_shape = (g, group.slots.shape[1], k_flat.shape[1], dim)
        kg = k_flat.index_select(0, group.slots.reshape(-1)).view(kv_shape).transpose(1, 2)
        vg = v_flat.index_select(0, group.slots.reshape(-1)).view(kv_shape).transpose(1, 2)
        mask = group.masks[spec.sliding_window]
        if qg.is_cuda:
            # not cuDNN: it builds an execution plan per new shape, and kv_len changes every step
            with sdpa_kernel(_CUDA_BACKENDS):
                out = F.scaled_dot_product_attention(
                    qg, kg, vg, attn_mask=mask, scale=spec.scale, enable_gqa=heads != kg.shape[1]
                )
        else:
            out = F.scaled_dot_product_attention(
                qg, kg, vg, attn_mask=mask, scale=spec.scale, enable_gqa=heads != kg.shape[1]
            )
        out = out.transpose(1, 2).reshape(g * q_len, heads, dim)
        return out.index_select(0, group.out_src)

    def _build_group(self, meta: AttentionMetadata, members: list[int]) -> _Group:
        bs, device = meta.block_size, meta.device
        q_lens = [meta.q_indptr[b + 1] - meta.q_indptr[b] for b in members]
        max_q = max(q_lens)
        max_kv = max(meta.kv_lens[b] for b in members)
        max_blocks = -(-max_kv // bs)
        rows: list[int] = []
        out_src: list[int] = []
        out_dst: list[int] = []
        tables: list[int] = []
        ctx: list[int] = []
        kv: list[int] = []
        new_pos_idx: list[int] = []
        new_pos: list[int] = []
        for g, (b, q_len) in enumerate(zip(members, q_lens)):
            start = meta.q_indptr[b]
            rows.extend(range(start, start + q_len))
            rows.extend([start] * (max_q - q_len))
            out_src.extend(range(g * max_q, g * max_q + q_len))
            out_dst.extend(range(start, start + q_len))
            table = meta.block_tables[b][:max_blocks]
            tables.extend(table + [0] * (max_blocks - len(table)))
            ctx.append(meta.context_lens[b])
            kv.append(meta.kv_lens[b])
            first = g * max_kv + meta.context_lens[b]
            new_pos_idx.extend(range(first, first + q_len))
            new_pos.extend(meta.positions_list[b])

        n = len(members)
        rows_t, table_t, ctx_t, kv_t, out_src_t, out_dst_t, new_pos_idx_t, new_pos_t = (
            int64_to_device([rows, tables, ctx, kv, out_src, out_dst, new_pos_idx, new_pos], device)
        )
        rows_t, table_t = rows_t.view(n, max_q), table_t.view(n, max_blocks)
        kv_idx = torch.arange(max_kv, device=device)
        slots = table_t.gather(1, (kv_idx // bs).expand(n, max_kv)) * bs + kv_idx % bs
        q_t = torch.arange(max_q, device=device)
        q_valid = q_t[None, :] < (kv_t - ctx_t)[:, None]  # [n, Q]
        q_cache_idx = ctx_t[:, None] + q_t[None, :]
        base = kv_idx[None, None, :] <= q_cache_idx[:, :, None]  # causal, [n, Q, K]
        base &= kv_idx[None, None, :] < kv_t[:, None, None]
        for g, b in enumerate(members):
            custom = meta.custom_masks[b]
            if custom is not None:
                q_len, kv_len = custom.shape
                base[g, :q_len, :kv_len] = custom.to(device=device, dtype=torch.bool)
                base[g, :q_len, kv_len:] = False
        masks: dict[int | None, torch.Tensor] = {}
        for window in self.windows:
            mask = base
            if window is not None:
                k_pos = kv_idx.repeat(n)
                k_pos[new_pos_idx_t] = new_pos_t
                q_pos = meta.positions.index_select(0, rows_t.reshape(-1)).view(n, max_q)
                mask = base & (q_pos[:, :, None] - k_pos.view(n, max_kv)[:, None, :] < window)
            # padded query rows attend to key 0 only (their output is discarded), avoiding NaN
            mask = mask | (~q_valid[:, :, None] & (kv_idx == 0)[None, None, :])
            masks[window] = mask.unsqueeze(1)
        return _Group(rows=rows_t, out_src=out_src_t, out_dst=out_dst_t, slots=slots, masks=masks)


def _group_sequences(meta: AttentionMetadata) -> list[list[int]]:
    """Sequences sorted by q_len, packed greedily while padding stays within 2x the exact work."""
    q_lens = [meta.q_indptr[b + 1] - meta.q_indptr[b] for b in range(meta.num_seqs)]
    order = sorted(range(meta.num_seqs), key=lambda b: (q_lens[b], meta.kv_lens[b]))
    groups: list[list[int]] = []
    current: list[int] = []
    exact = max_q = max_kv = 0
    for b in order:
        q_len, kv_len = q_lens[b], meta.kv_lens[b]
        new_exact = exact + q_len * kv_len
        new_q, new_kv = max(max_q, q_len), max(max_kv, kv_len)
        if current and (len(current) + 1) * new_q * new_kv > 2 * new_exact + _PAD_SLACK:
            groups.append(current)
            current, new_exact, new_q, new_kv = [], q_len * kv_len, q_len, kv_len
        current.append(b)
        exact, max_q, max_kv = new_exact, new_q, new_kv
    groups.append(current)
    return groups
