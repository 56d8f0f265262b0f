"""espalier's paged-attention kernel behind the flashinfer backend, for steps of few new tokens.

Decode steps and tree verification (at most ``SMALL_QUERY_UP_TO`` new tokens per sequence, so
also short prefill chunks) run ``kernels/paged_attention`` instead of flashinfer's prefill
kernel: one kernel for both, so a decoded row and the verified row of the same token go through
the same code, and at batch 1 it needs neither flashinfer's split-KV merge launch nor its output
fill. H200, 8B-Llama shape (``bench/attention.py``, run 73, us per layer in a graph): batch-1
decode over 128 entries 6.5 vs 10.7, 32 nine-node trees 11.2 vs 36.0, batch 64 12.0 vs 24.6;
slower over 2048 entries at batch 8 and 32 (32.4 vs 29.1, 78.1 vs 74.1). ``bench/gpu.py`` batch-1
decode (run 74): 0.773 of the HBM roofline vs 0.738 with flashinfer's kernel (path
``flashinfer_graphs_prefill_attention``), batch 64: 0.632 vs 0.579. Longer steps stay on
flashinfer.

``SmallQueryWrapper`` has the surface the backend uses for a flashinfer wrapper: planned on the
host from a step's ``PagedLayout`` (CSR arrays, CPU), run per layer. In CUDA-graph mode its
index buffers, split workspace and split count are fixed at capture; each plan rewrites the
buffers in place (one host-to-device copy) and picks the split length for the step's longest
sequence.
"""

from __future__ import annotations

import numpy as np
import torch

from espalier.engine.attention.paged_plan import PagedLayout
from espalier.kernels import paged_attention as pa

SMALL_QUERY_UP_TO = 16
"""Steps whose every sequence has at most this many new tokens attend with the kernel here; 0:
every step on flashinfer (the anchor path in ``bench/gpu.py``). Read when a step is planned and
when a CUDA graph's wrappers are made."""


def use_small_query(max_q_len: int) -> bool:
    return 0 < max_q_len <= SMALL_QUERY_UP_TO


class SmallQueryWrapper:
    """A planned ``paged_attention`` call for layers of one window (``window_left`` -1: none).

    ``graph``: (sequences, tokens per sequence, max pages) of a captured shape, for fixed
    buffers; None for eager steps (fresh tensors per plan). ``mask_buffers``: a graph's int32
    mask words and word offsets ``[sequences + 1]`` (``pack_row_masks``), filled by ``plan``."""

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        window_left: int,
        device: torch.device,
        workspace: pa.Workspace,
        graph: tuple[int, int, int] | None = None,
        mask_buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Graph mode: ``graph`` and (tree shapes) ``mask_buffers``; eager: neither."""
        self.heads, self.kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.window_left, self.device = scale, window_left, device
        self.workspace = workspace
        self.graph = graph
        self.mask_buffers = mask_buffers
        self.plan_: pa.StepPlan | None = None
        self.mask: tuple[torch.Tensor, torch.Tensor] | None = None
        self.page_size = 0
        if graph is not None:
            batch, n, max_pages = graph
            _, block_q = pa.tile_shape(num_heads, num_kv_heads, n)
            programs = batch * -(-n // block_q) * num_kv_heads
            splits = pa.choose_splits(programs, 1 << 30, device)
            self.plan_ = pa.StepPlan(
                torch.zeros(3 * batch + 3, dtype=torch.int32, device=device),
                torch.zeros(max_pages, dtype=torch.int32, device=device),
                batch,
                n,
                splits,
            )
            if splits > 1:
                workspace.ensure(splits * batch * n * num_heads, head_dim, programs)

    def plan(
        self, layout: PagedLayout, page_size: int, segments: list[np.ndarray] | None = None
    ) -> None:
        """Plan a step from CPU CSR arrays. ``segments``: per sequence its explicit bool mask
        ``[q_len, kv_len]`` flattened (``paged_plan.step_mask``), or None (causal, with the
        wrapper's window). Graph mode: the masks go into the graph's mask buffers."""
        self.page_size = page_size
        qo = layout.qo_indptr.tolist()
        kv = layout.kv_indptr.tolist()
        last = layout.last_page_len.tolist()
        batch = len(last)
        q_lens = [qo[b + 1] - qo[b] for b in range(batch)]
        pages = [kv[b + 1] - kv[b] for b in range(batch)]
        kv_lens = [(p - 1) * page_size + n for p, n in zip(pages, last)]
        max_kv = max(kv_lens)
        if self.graph is None:
            _, block_q = pa.tile_shape(self.heads, self.kv_heads, max(q_lens))
            programs = batch * -(-max(q_lens) // block_q) * self.kv_heads
            splits = pa.choose_splits(programs, max_kv, self.device)
            split_len = pa.split_len_for(max_kv, splits, self.head_dim)
            splits = -(-max_kv // split_len)
            meta = pa.host_meta(q_lens, kv_lens, pages, split_len)
            self.plan_ = pa.StepPlan(
                torch.tensor(meta, dtype=torch.int32).to(self.device, non_blocking=True),
                layout.kv_indices.to(self.device, non_blocking=True),
                batch,
                max(q_lens),
                splits,
            )
            self.mask = None
            if segments is not None:
                words, offsets = pa.pack_row_masks(segments, kv_lens)
                self.mask = (
                    torch.from_numpy(words).to(self.device, non_blocking=True),
                    torch.from_numpy(offsets).to(self.device, non_blocking=True),
                )
            return
        plan = self.plan_
        assert plan is not None
        if batch != plan.batch or max(q_lens) > plan.max_q_len:
            raise ValueError("the step does not fit the captured shape")
        if len(layout.kv_indices) > plan.kv_indices.numel():
            raise ValueError("more pages than the graph's index buffer holds")
        split_len = pa.split_len_for(max_kv, plan.splits, self.head_dim)
        meta = pa.host_meta(q_lens, kv_lens, pages, split_len)
        plan.meta.copy_(torch.tensor(meta, dtype=torch.int32), non_blocking=True)
        indices = layout.kv_indices
        plan.kv_indices[: len(indices)].copy_(indices, non_blocking=True)
        self.mask = None
        if segments is not None:
            if self.mask_buffers is None:
                raise ValueError("this graph's wrapper has no mask buffers")
            words, offsets = pa.pack_row_masks(segments, kv_lens)
            words_buf, offsets_buf = self.mask_buffers
            if len(words) > words_buf.numel():
                raise ValueError("the step's masks exceed the graph's mask buffer")
            words_buf[: len(words)].copy_(torch.from_numpy(words), non_blocking=True)
            offsets_buf.copy_(torch.from_numpy(offsets), non_blocking=True)
            self.mask = self.mask_buffers

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q ``[T, H, D]``; kv: the layer's paged K and V ``[blocks, page, KVH, D]``."""
        assert self.plan_ is not None, "plan before run"
        k, v = kv
        return pa.paged_attention(
            q,
            k.view(-1, *k.shape[2:]),
            v.view(-1, *v.shape[2:]),
            self.plan_,
            page_size=self.page_size,
            scale=self.scale,
            window_left=self.window_left,
            mask=self.mask,
            workspace=self.workspace,
        )
