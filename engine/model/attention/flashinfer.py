"""flashinfer paged attention (CUDA, bf16/fp16): prefill chunks, decodes and draft trees.

Per distinct layer window (None = full attention: Llama has one kind, Gemma 3 two) one
``BatchPrefillWithPagedKVCacheWrapper`` (FA2 kernels, "NHD" layout = ``engine/kv_cache.py``) for
prefill chunks, trees and (by default) decodes, and one ``BatchDecodeWithPagedKVCacheWrapper``
for steps whose every sequence feeds one token under the causal rule, in batches of up to
``ModelOptions.decode_kernel_up_to`` (0 by default: see there). Steps of at most
``ModelOptions.small_query_up_to`` new tokens per sequence (decodes, draft trees, short prefill
chunks) do not reach flashinfer's kernels: ``small_query.SmallQueryWrapper`` (the same
planning surface, espalier's ``kernels/paged_attention``) takes them, eager and in CUDA graphs.
``prepare`` plans the step's wrappers once from its CSR arrays (``paged_plan``); ``attend`` runs
the planned wrapper over the cache, which already holds the layer's new K/V. GQA is native
(``num_heads`` a multiple of ``num_kv_heads``); the softmax scale is the model's ``attn_scale``.

Masks: a causal step (prefill chunks, decodes) plans with flashinfer's causal rule and
``window_left = window - 1``. A step with a draft tree (custom masks, positions by depth) plans
explicit masks (``paged_plan.step_mask``), bit-packed on the CPU and uploaded without blocking.
Either way ``plan`` reads only CPU arrays: nothing is read back from the device. Its copies to
the device come from pageable memory, though, so a plan made while the stream is busy waits for
it (the call then lasts the whole step); ``engine/model/cuda_graphs.py`` plans ahead on a side
stream, into a second graph, for that reason (``docs/decisions/flashinfer-plan-and-kernels.md``).

CUDA graphs (``engine/model/cuda_graphs.py``): ``graph_wrappers`` makes wrappers in flashinfer's
CUDA-graph mode with fixed-size index (and packed-mask) buffers for one captured shape;
``plan_causal`` / ``plan_graph_masked`` re-plan them (on the host, outside the graph) before each
replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from espalier.engine.config import ModelConfig, ModelOptions
from espalier.engine.kv_cache import KVCache
from espalier.engine.model.attention.base import AttentionMetadata, LayerSpec
from espalier.engine.model.attention.paged_plan import (
    PagedLayout,
    meta_layout,
    pack_mask_segments,
    step_mask,
)
from espalier.engine.model.attention.small_query import (
    SmallQueryWrapper,
    plan_windows,
    window_wrappers,
)
from espalier.kernels import paged_attention as pa

SUPPORTED_HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 256 << 20  # flashinfer's float workspace (split-KV partial results)

Wrappers = dict[int | None, Any]  # layer window (None = full) -> a planned flashinfer wrapper


@dataclass
class GraphWrappers:
    """CUDA-graph-mode wrappers of one captured shape, per layer window; in custom-mask mode also
    each window's fixed (packed mask uint8 ``[bytes]``, byte offsets int32 ``[B + 1]``) buffers."""

    wrappers: Wrappers
    mask_buffers: dict[int | None, tuple[torch.Tensor, torch.Tensor]]


def flashinfer_supports(model_config: ModelConfig, dtype: torch.dtype) -> bool:
    """Whether flashinfer imports and runs this model: half-precision K/V, a head dim it has
    kernels for."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    if model_config.head_dim not in SUPPORTED_HEAD_DIMS:
        return False
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


class FlashinferBackend:
    """Paged attention through flashinfer's batch prefill wrappers (see the module docstring);
    ``options``: which kernel takes which step (``small_query_up_to``, ``decode_kernel_up_to``)
    and the small-query kernel's launch paths (None: the defaults)."""

    name = "flashinfer"

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        options: ModelOptions | None = None,
    ) -> None:
        try:
            import flashinfer
        except ImportError as exc:  # pragma: no cover - CPU CI has no flashinfer
            raise ImportError("flashinfer backend: `pip install flashinfer-python`") from exc
        if device.type != "cuda":
            raise ValueError("the flashinfer backend runs on CUDA only")
        self._flashinfer = flashinfer
        self.config = model_config
        self.options = options or ModelOptions()
        self.device, self.dtype = device, dtype
        self.windows = sorted(
            {model_config.window(i) for i in range(model_config.num_layers)},
            key=lambda w: -1 if w is None else w,
        )
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._eager: Wrappers = {w: self._wrapper() for w in self.windows}
        self._eager_decode: Wrappers = {}  # made at the first decode step (its JIT module)
        self._small_workspace = pa.Workspace.empty(device)  # split partials of small-query steps
        self._eager_small: Wrappers = window_wrappers(
            model_config, self.windows, device, self._small_workspace, options=self.options.kernels
        )

    def _wrapper(self, **graph_buffers: Any) -> Any:
        return self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2", **graph_buffers
        )

    def _decode_wrapper(self, **graph_buffers: Any) -> Any:
        return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_tensor_cores=True,  # FA3 on Hopper, the fastest at batch 1 (docs/decisions)
            **graph_buffers,
        )

    def _small_query(self, max_q_len: int) -> bool:
        """Whether a step of at most ``max_q_len`` new tokens per sequence takes the small-query
        kernel."""
        return 0 < max_q_len <= self.options.small_query_up_to

    def _decode_kernel(self, num_seqs: int) -> bool:
        """Whether a one-token causal step of ``num_seqs`` sequences runs the decode wrapper."""
        return num_seqs <= self.options.decode_kernel_up_to

    def _is_decode(self, wrapper: Any) -> bool:
        return isinstance(wrapper, self._flashinfer.BatchDecodeWithPagedKVCacheWrapper)

    def warm_up(self, block_size: int, max_rows: int) -> None:
        """Compile every variant of the small-query kernel a step can launch (``paged_attention
        .warm_up``: its tile shapes up to ``small_query_up_to`` rows per sequence, causal with
        each layer window or masked, split or not, PDL or not); flashinfer's own kernels come
        compiled (its JIT cache) and are not specialized on a step's sizes."""
        if self.options.small_query_up_to <= 0:
            return
        cfg = self.config
        pa.warm_up(
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            page_size=block_size,
            dtype=self.dtype,
            device=self.device,
            max_q_len=self.options.small_query_up_to,
            window_lefts=[-1 if w is None else w - 1 for w in self.windows],
            options=self.options.kernels,
            max_rows=max_rows,
        )

    # -- planning (host side, once per step) ---------------------------------------------------

    def prepare(self, meta: AttentionMetadata) -> None:
        layout = meta_layout(meta)
        masks = {window: step_mask(meta, window) for window in self.windows}
        q_lens = (meta.q_indptr[b + 1] - meta.q_indptr[b] for b in range(meta.num_seqs))
        if self._small_query(max(q_lens)):
            plan_windows(self._eager_small, layout, meta.block_size, masks)
            meta.backend_state = self._eager_small
            return
        causal = all(segments is None for segments in masks.values())
        if causal and meta.num_tokens == meta.num_seqs and self._decode_kernel(meta.num_seqs):
            if not self._eager_decode:
                self._eager_decode = {w: self._decode_wrapper() for w in self.windows}
            self.plan_causal(self._eager_decode, layout, meta.block_size)
            meta.backend_state = self._eager_decode
            return
        for window, wrapper in self._eager.items():
            segments = masks[window]
            if segments is None:
                self._plan(wrapper, layout, meta.block_size, window=window)
            else:
                self._plan_masked(wrapper, layout, meta.block_size, segments)
        meta.backend_state = self._eager

    def _plan_masked(
        self, wrapper: Any, layout: PagedLayout, block_size: int, segments: list[np.ndarray]
    ) -> None:
        """Plan with explicit masks, packed here on the CPU (``paged_plan.pack_mask_segments``).

        Why not ``plan(custom_mask=...)``: flashinfer packs on the device from device-side indptrs
        and reads the packed size back (host syncs), and its packing kernel is one more JIT
        module. The wrapper takes the packed mask and its byte offsets as ``_custom_mask_buf`` /
        ``_mask_indptr_buf`` (flashinfer 0.6: what ``run`` reads to pick the custom-mask mode);
        where a version lacks them, the public path runs instead.
        """
        if not (hasattr(wrapper, "_custom_mask_buf") and hasattr(wrapper, "_mask_indptr_buf")):
            custom = torch.from_numpy(np.concatenate(segments)).to(self.device)
            self._plan(wrapper, layout.to(self.device), block_size, window=None, custom_mask=custom)
            return
        packed, indptr = pack_mask_segments(segments)
        self._plan(wrapper, layout, block_size, window=None, causal=False)
        wrapper._custom_mask_buf = torch.from_numpy(packed).to(self.device, non_blocking=True)
        wrapper._mask_indptr_buf = torch.from_numpy(indptr).to(self.device, non_blocking=True)

    def plan_causal(self, wrappers: Wrappers, layout: PagedLayout, block_size: int) -> None:
        """Plan ``wrappers`` (prefill or decode, eager or CUDA-graph mode) for the causal step
        ``layout`` (decode wrappers: one token per sequence)."""
        if _small(wrappers):  # one shared plan; each wrapper's window is its own
            plan_windows(wrappers, layout, block_size)
            return
        for window, wrapper in wrappers.items():
            self._plan(wrapper, layout, block_size, window=window)

    def _plan(
        self,
        wrapper: Any,
        layout: PagedLayout,
        block_size: int,
        *,
        window: int | None,
        custom_mask: torch.Tensor | None = None,
        causal: bool = True,
    ) -> None:
        """Plan a prefill or decode ``wrapper`` (decode: causal, one token per sequence)."""
        cfg = self.config
        paged = (layout.kv_indptr, layout.kv_indices, layout.last_page_len)
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size)
        common = {
            "sm_scale": cfg.scale,
            "window_left": -1 if window is None else window - 1,
            "q_data_type": self.dtype,
            "kv_data_type": self.dtype,
        }
        if self._is_decode(wrapper):
            wrapper.plan(*paged, *heads, **common)
            return
        wrapper.plan(
            layout.qo_indptr,
            *paged,
            *heads,
            custom_mask=custom_mask,
            causal=causal and custom_mask is None,
            **common,
        )

    def graph_wrappers(
        self, batch_size: int, max_pages: int, tokens_per_seq: int = 1, mask_bytes: int = 0
    ) -> GraphWrappers:
        """Wrappers in CUDA-graph mode for ``batch_size`` sequences of ``tokens_per_seq`` new
        tokens over at most ``max_pages`` pages in all (fixed int32 index buffers on the device):
        decode wrappers for one causal token per sequence (``decode_kernel_up_to``), else prefill
        ones.
        ``mask_bytes > 0``: custom-mask mode, with a packed-mask buffer of that many bytes per
        layer window (``plan_graph_masked`` fills it)."""

        def ints(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=self.device)

        step = tokens_per_seq
        out = GraphWrappers({}, {})
        if self._small_query(step):  # row-aligned mask words: up to 4 more bytes per row
            words = -(-mask_bytes // 4) + batch_size * step if mask_bytes else 0
            graph = (batch_size, step, max_pages)
            out.wrappers.update(
                window_wrappers(
                    self.config,
                    self.windows,
                    self.device,
                    self._small_workspace,
                    graph,
                    words,
                    options=self.options.kernels,
                )
            )
            return out
        if step == 1 and not mask_bytes and self._decode_kernel(batch_size):
            for window in self.windows:
                out.wrappers[window] = self._decode_wrapper(
                    use_cuda_graph=True,
                    paged_kv_indptr_buffer=ints(batch_size + 1),
                    paged_kv_indices_buffer=ints(max_pages),
                    paged_kv_last_page_len_buffer=ints(batch_size) + 1,
                )
            return out
        for window in self.windows:
            masks: dict[str, torch.Tensor] = {}
            if mask_bytes:
                mask = torch.zeros(mask_bytes, dtype=torch.uint8, device=self.device)
                masks = {"custom_mask_buf": mask, "mask_indptr_buf": ints(batch_size + 1)}
                out.mask_buffers[window] = (mask, masks["mask_indptr_buf"])
            out.wrappers[window] = self._wrapper(
                use_cuda_graph=True,
                qo_indptr_buf=torch.arange(
                    0, batch_size * step + 1, step, dtype=torch.int32, device=self.device
                ),
                paged_kv_indptr_buf=ints(batch_size + 1),
                paged_kv_indices_buf=ints(max_pages),
                paged_kv_last_page_len_buf=ints(batch_size) + 1,
                **masks,
            )
        return out

    def plan_graph_masked(
        self,
        graph: GraphWrappers,
        layout: PagedLayout,
        block_size: int,
        segments: dict[int | None, list[np.ndarray]],
    ) -> None:
        """Plan custom-mask ``graph_wrappers`` for a step: ``segments[window]`` per sequence (the
        window folded in, ``paged_plan.sequence_mask``); the packed masks are copied into the
        fixed buffers. Raises ValueError when they do not fit."""
        if _small(graph.wrappers):  # one shared plan; masks into each wrapper's buffers
            plan_windows(graph.wrappers, layout, block_size, segments)
            return
        for window, wrapper in graph.wrappers.items():
            mask_buf, indptr_buf = graph.mask_buffers[window]
            packed, indptr = pack_mask_segments(segments[window])
            if len(packed) > mask_buf.numel():
                raise ValueError("packed masks exceed the graph's mask buffer")
            self._plan(wrapper, layout, block_size, window=None, causal=False)
            mask_buf[: len(packed)].copy_(torch.from_numpy(packed), non_blocking=True)
            indptr_buf.copy_(torch.from_numpy(indptr), non_blocking=True)

    # -- per layer -------------------------------------------------------------------------------

    def attend(
        self, spec: LayerSpec, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: ``[T, H, D]`` (roped, bf16/fp16, CUDA; the step's K/V already in the cache) ->
        ``[T, H, D]``."""
        wrapper = meta.backend_state[spec.sliding_window]
        out: torch.Tensor = wrapper.run(q, (kv_cache.k[spec.layer], kv_cache.v[spec.layer]))
        return out


def _small(wrappers: Wrappers) -> bool:
    """Whether ``wrappers`` are small-query wrappers (``small_query``), not flashinfer's."""
    return isinstance(next(iter(wrappers.values())), SmallQueryWrapper)
