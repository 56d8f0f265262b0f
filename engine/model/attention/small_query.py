"""espalier's paged-attention kernel behind the flashinfer backend, for steps of few new tokens.

Decode steps and tree verification (at most ``ModelOptions.small_query_up_to`` new tokens per
sequence, so also short prefill chunks) run ``kernels/paged_attention`` instead of flashinfer's
prefill kernel: one kernel for both, so a decoded row and the verified row of the same token go
through the same code, and at batch 1 it needs neither flashinfer's split-KV merge launch nor
its output fill. It is faster than flashinfer's kernel for decode and tree verification over
short contexts, slightly slower over long ones (``docs/decisions/small-query-attention.md``).
Longer steps stay on flashinfer.

``SmallQueryWrapper`` (one per layer window) runs per layer like a flashinfer wrapper. Its
planning has two parts: ``SmallQueryPlan``, shared by every window's wrapper and planned once
per step from the step's ``PagedLayout`` (CSR arrays, CPU), and each window's masks
(``plan_windows`` does both). In CUDA-graph mode the index buffers, split workspace and split
count are fixed at capture; each plan rewrites the buffers in place (one host-to-device copy)
and picks the split length for the step's longest sequence.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from espalier.engine.config import ModelConfig
from espalier.engine.model.attention.paged_plan import PagedLayout
from espalier.kernels import paged_attention as pa
from espalier.kernels.options import DEFAULT_KERNELS, KernelOptions


class SmallQueryPlan:
    """The window-independent part of a step's plan, shared by the wrappers of every layer
    window: the device ``StepPlan`` (sequences, pages, split length) and the host ``kv_lens``.

    ``graph``: (sequences, tokens per sequence, max pages) of a captured shape, for fixed
    buffers (and the split count and workspace fixed at capture); None for eager steps (fresh
    tensors per plan). ``options``: the model's launch paths (splits, launch shape, PDL)."""

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        workspace: pa.Workspace,
        graph: tuple[int, int, int] | None = None,
        options: KernelOptions = DEFAULT_KERNELS,
    ) -> None:
        self.heads, self.kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.device, self.workspace, self.graph = device, workspace, graph
        self.options = options
        self.step: pa.StepPlan | None = None
        self.kv_lens: list[int] = []
        self.page_size = 0
        if graph is not None:
            batch, n, max_pages = graph
            programs = batch * pa.tiles_per_sequence(num_heads, num_kv_heads, n) * num_kv_heads
            splits = pa.choose_splits(programs, 1 << 30, device, options)
            self.step = pa.StepPlan(
                torch.zeros(3 * batch + 3, dtype=torch.int32, device=device),
                torch.zeros(max_pages, dtype=torch.int32, device=device),
                batch,
                n,
                splits,
            )
            if splits > 1:
                workspace.ensure(splits * batch * n * num_heads, head_dim, programs)

    def plan(self, layout: PagedLayout, page_size: int) -> None:
        """Plan a step from its CPU CSR arrays (one host-to-device copy per tensor)."""
        self.page_size = page_size
        qo = layout.qo_indptr.tolist()
        kv = layout.kv_indptr.tolist()
        last = layout.last_page_len.tolist()
        batch = len(last)
        q_lens = [qo[b + 1] - qo[b] for b in range(batch)]
        pages = [kv[b + 1] - kv[b] for b in range(batch)]
        self.kv_lens = kv_lens = [(p - 1) * page_size + n for p, n in zip(pages, last)]
        if self.graph is None:
            tiles = pa.tiles_per_sequence(self.heads, self.kv_heads, max(q_lens))
            programs = batch * tiles * self.kv_heads
            splits = pa.choose_splits(programs, max(kv_lens), self.device, self.options)
            self.step = pa.build_plan(
                q_lens, kv_lens, pages, layout.kv_indices,
                head_dim=self.head_dim, splits=splits, device=self.device, options=self.options,
            )  # fmt: skip
            return
        step = self.step
        assert step is not None
        if batch != step.batch or max(q_lens) > step.max_q_len:
            raise ValueError("the step does not fit the captured shape")
        if len(layout.kv_indices) > step.kv_indices.numel():
            raise ValueError("more pages than the graph's index buffer holds")
        split_len = pa.split_len_for(max(kv_lens), step.splits, self.head_dim, options=self.options)
        meta = pa.host_meta(q_lens, kv_lens, pages, split_len)
        step.meta.copy_(torch.tensor(meta, dtype=torch.int32), non_blocking=True)
        indices = layout.kv_indices
        step.kv_indices[: len(indices)].copy_(indices, non_blocking=True)


class SmallQueryWrapper:
    """A planned ``paged_attention`` call for layers of one window (``window_left`` -1: none)
    over a ``SmallQueryPlan`` (``shared``: the other windows' plan; None: its own, made from
    the arguments). ``mask_buffers``: a graph's int32 mask words and word offsets
    ``[sequences + 1]`` (``pack_row_masks``), filled by ``set_masks``."""

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
        shared: SmallQueryPlan | None = None,
    ) -> None:
        """Graph mode: ``graph`` and (tree shapes) ``mask_buffers``; eager: neither."""
        self.shared = shared or SmallQueryPlan(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            device=device,
            workspace=workspace,
            graph=graph,
        )
        self.scale, self.window_left, self.device = scale, window_left, device
        self.mask_buffers = mask_buffers
        self.mask: tuple[torch.Tensor, torch.Tensor] | None = None

    def plan(
        self, layout: PagedLayout, page_size: int, segments: list[np.ndarray] | None = None
    ) -> None:
        """Plan the shared part (``SmallQueryPlan.plan``), then this window's masks."""
        self.shared.plan(layout, page_size)
        self.set_masks(segments)

    def set_masks(self, segments: list[np.ndarray] | None) -> None:
        """This window's masks for the step the shared plan holds: ``segments`` per sequence
        its explicit bool mask ``[q_len, kv_len]`` flattened (``paged_plan.step_mask``), or None
        (causal, with the wrapper's window). Graph mode: into the graph's mask buffers."""
        self.mask = None
        if segments is None:
            return
        words, offsets = pa.pack_row_masks(segments, self.shared.kv_lens)
        if self.shared.graph is None:
            self.mask = (
                torch.from_numpy(words).to(self.device, non_blocking=True),
                torch.from_numpy(offsets).to(self.device, non_blocking=True),
            )
            return
        if self.mask_buffers is None:
            raise ValueError("this graph's wrapper has no mask buffers")
        words_buf, offsets_buf = self.mask_buffers
        if len(words) > words_buf.numel():
            raise ValueError("the step's masks exceed the graph's mask buffer")
        words_buf[: len(words)].copy_(torch.from_numpy(words), non_blocking=True)
        offsets_buf.copy_(torch.from_numpy(offsets), non_blocking=True)
        self.mask = self.mask_buffers

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q ``[T, H, D]``; kv: the layer's paged K and V ``[blocks, page, KVH, D]``."""
        step = self.shared.step
        assert step is not None, "plan before run"
        k, v = kv
        return pa.paged_attention(
            q,
            k.view(-1, *k.shape[2:]),
            v.view(-1, *v.shape[2:]),
            step,
            page_size=self.shared.page_size,
            scale=self.scale,
            window_left=self.window_left,
            mask=self.mask,
            workspace=self.shared.workspace,
            options=self.shared.options,
        )


def plan_windows(
    wrappers: dict[int | None, SmallQueryWrapper],
    layout: PagedLayout,
    page_size: int,
    segments: Mapping[int | None, list[np.ndarray] | None] | None = None,
) -> None:
    """Plan the wrappers of every layer window of one step (they share one ``SmallQueryPlan``:
    it is planned once); ``segments[window]``: that window's masks (None: causal)."""
    shared = {id(w.shared) for w in wrappers.values()}
    assert len(shared) == 1, "the windows' wrappers must share one plan"
    next(iter(wrappers.values())).shared.plan(layout, page_size)
    for window, wrapper in wrappers.items():
        wrapper.set_masks(None if segments is None else segments[window])


def window_wrappers(
    config: ModelConfig,
    windows: list[int | None],
    device: torch.device,
    workspace: pa.Workspace,
    graph: tuple[int, int, int] | None = None,
    mask_words: int = 0,
    options: KernelOptions = DEFAULT_KERNELS,
) -> dict[int | None, SmallQueryWrapper]:
    """A wrapper per layer window over one shared ``SmallQueryPlan``: eager (``graph`` None)
    or for a captured shape, with ``mask_words`` int32 mask words per window (0: causal only);
    ``options``: the model's launch paths."""
    shared = SmallQueryPlan(
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        device=device,
        workspace=workspace,
        graph=graph,
        options=options,
    )
    wrappers = {}
    for window in windows:
        buffers = None
        if mask_words and graph is not None:
            words = torch.zeros(mask_words, dtype=torch.int32, device=device)
            buffers = (words, torch.zeros(graph[0] + 1, dtype=torch.int32, device=device))
        wrappers[window] = SmallQueryWrapper(
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            scale=config.scale,
            window_left=-1 if window is None else window - 1,
            device=device,
            workspace=workspace,
            mask_buffers=buffers,
            shared=shared,
        )
    return wrappers
