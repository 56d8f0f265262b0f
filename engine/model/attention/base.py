"""Attention backend interface over the paged KV cache, its per-step metadata and a registry.

One forward step covers B sequences; sequence b contributes ``q_len[b]`` new tokens (a prefill
chunk, one decode token, or a draft tree) on top of ``context_len[b]`` cached entries. The new
tokens are packed ("ragged") into ``T = sum(q_len)`` rows; ``q_indptr`` delimits them. This is
the shape flashinfer's paged prefill/decode wrappers take (qo_indptr, paged kv indptr/indices,
last page len, packed custom mask), so a flashinfer backend fits the same ``AttentionMetadata``.

Masking rule for new token t of sequence b against cache index j (0 <= j < kv_len[b]):
``allowed = custom_mask[b][t, j]`` if a custom mask is given, else ``j <= context_len[b] + t``;
on sliding-window layers additionally ``q_pos(t) - k_pos(j) < window``, where ``k_pos(j) = j`` for
context entries and the new token's own position for new entries.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from espalier.engine.config import ModelConfig, ModelOptions
    from espalier.engine.kv_cache import KVCache
    from espalier.engine.model.runner import SeqInput


@dataclass(frozen=True)
class LayerSpec:
    """What attention needs to know about one layer."""

    layer: int
    scale: float
    sliding_window: int | None = None


@dataclass
class AttentionMetadata:
    """One step's batch description. Python lists are host-side; tensors are on the device.

    token_ids, positions, slot_mapping: int64 ``[T]`` (slot: physical cache slot per new token).
    q_indptr: ``[B + 1]`` offsets of each sequence's rows in the packed ``T``.
    context_lens / kv_lens: cached entries before / after the step, per sequence.
    block_tables: per-sequence physical block ids (python).
    positions_list: per-sequence python list of new-token positions.
    custom_masks: per-sequence bool ``[q_len, kv_len]`` or None (causal).
    logits_rows: int64 ``[n]`` rows of ``T`` that get logits; logits_indptr ``[B + 1]`` (python).
    backend_state: whatever the backend's ``prepare`` computed once for all layers.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    q_indptr: list[int]
    context_lens: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]]
    positions_list: list[list[int]]
    custom_masks: list[torch.Tensor | None]
    logits_rows: torch.Tensor
    logits_indptr: list[int]
    block_size: int
    device: torch.device
    backend_state: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.kv_lens)

    @property
    def num_tokens(self) -> int:
        return self.q_indptr[-1]


class AttentionBackend(Protocol):
    """Attends each layer's new queries over the paged cache.

    ``warm_up`` runs once, at the runner's construction; ``prepare`` once per step (plan: index
    tensors, masks, flashinfer ``plan()``);
    ``attend`` once per layer with the step's prepared metadata, after the layer has written its
    new K/V to the cache (at ``meta.slot_mapping``; on CUDA fused with the rope kernel).
    """

    name: str

    def prepare(self, meta: AttentionMetadata) -> None:
        """Fill ``meta.backend_state`` for this step."""
        ...

    def attend(
        self, spec: LayerSpec, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: ``[T, H, D]`` (roped, model dtype) -> ``[T, H, D]``."""
        ...

    def warm_up(self, block_size: int, max_rows: int) -> None:
        """Build every kernel variant a step over a cache of ``block_size``-token pages can
        launch, once, before the first step (nothing is compiled while requests run);
        ``max_rows``: the most token rows a step can hold (the cache's slots)."""
        ...


def resolve_backend_name(
    name: str, model_config: ModelConfig, device: torch.device | None, dtype: torch.dtype | None
) -> str:
    """``"auto"`` -> "flashinfer" on CUDA when it imports and supports the model, else "sdpa"."""
    if name != "auto":
        return name
    if device is None or device.type != "cuda" or dtype is None:
        return "sdpa"
    from espalier.engine.model.attention.flashinfer import flashinfer_supports

    return "flashinfer" if flashinfer_supports(model_config, dtype) else "sdpa"


def get_attention_backend(
    name: str,
    model_config: ModelConfig,
    *,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    options: ModelOptions | None = None,
) -> AttentionBackend:
    """The backend called ``name`` ("sdpa", "flashinfer" or "auto"), imported lazily.

    flashinfer needs ``device`` and ``dtype`` (its workspace lives on the device) and follows
    ``options`` (which of its steps reach which kernel; None: the defaults)."""
    name = resolve_backend_name(name, model_config, device, dtype)
    if name == "sdpa":
        from espalier.engine.model.attention.sdpa import SdpaBackend

        return SdpaBackend(model_config)
    if name == "flashinfer":
        from espalier.engine.model.attention.flashinfer import FlashinferBackend

        if device is None or dtype is None:
            raise ValueError("the flashinfer backend needs a CUDA device and a dtype")
        return FlashinferBackend(model_config, device=device, dtype=dtype, options=options)
    raise ValueError(f"unknown attention backend {name!r}; known: auto, flashinfer, sdpa")


def int64_to_device(lists: Sequence[list[int]], device: torch.device) -> list[torch.Tensor]:
    """int64 device tensors of several python lists through one host-to-device copy."""
    flat = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64)
    if device.type != "cpu":
        flat = flat.to(device, non_blocking=True)
    return list(torch.split(flat, [len(values) for values in lists]))


def build_metadata(
    batch: Sequence[SeqInput], *, block_size: int, device: torch.device
) -> AttentionMetadata:
    """Pack a step's sequences into ``AttentionMetadata`` (host work in python lists, then one
    tensor per field)."""
    if not batch:
        raise ValueError("empty batch")
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    q_indptr = [0]
    logits_rows: list[int] = []
    logits_indptr = [0]
    positions_list: list[list[int]] = []
    for seq in batch:
        q_len, start = len(seq.token_ids), seq.context_len
        if q_len < 1:
            raise ValueError("a sequence needs at least one new token")
        table = list(seq.block_table)
        if len(table) * block_size < start + q_len:
            raise ValueError(
                f"block table covers {len(table) * block_size} < {start + q_len} entries"
            )
        pos = (
            list(seq.positions) if seq.positions is not None else list(range(start, start + q_len))
        )
        if len(pos) != q_len:
            raise ValueError("positions and token_ids differ in length")
        if seq.custom_mask is not None and tuple(seq.custom_mask.shape) != (q_len, start + q_len):
            raise ValueError(f"custom_mask must be [{q_len}, {start + q_len}]")
        token_ids.extend(seq.token_ids)
        positions.extend(pos)
        positions_list.append(pos)
        slots.extend(
            table[i // block_size] * block_size + i % block_size
            for i in range(start, start + q_len)
        )
        row0 = q_indptr[-1]
        if seq.logits == "last":
            logits_rows.append(row0 + q_len - 1)
        elif seq.logits == "all":
            logits_rows.extend(range(row0, row0 + q_len))
        elif seq.logits != "none":
            raise ValueError(f"logits must be 'last', 'all' or 'none', not {seq.logits!r}")
        q_indptr.append(row0 + q_len)
        logits_indptr.append(len(logits_rows))

    token_t, positions_t, slots_t, logits_t = int64_to_device(
        [token_ids, positions, slots, logits_rows], device
    )
    return AttentionMetadata(
        token_ids=token_t,
        positions=positions_t,
        slot_mapping=slots_t,
        q_indptr=q_indptr,
        context_lens=[s.context_len for s in batch],
        kv_lens=[s.context_len + len(s.token_ids) for s in batch],
        block_tables=[list(s.block_table) for s in batch],
        positions_list=positions_list,
        custom_masks=[s.custom_mask for s in batch],
        logits_rows=logits_t,
        logits_indptr=logits_indptr,
        block_size=block_size,
        device=device,
    )
