"""Host-side flashinfer plan inputs (CPU): CSR page arrays and explicit masks against the base
rule of ``attention/base.py`` (causal; custom masks; windows on rope positions)."""

from __future__ import annotations

import torch

from espalier.engine.model.attention.base import build_metadata
from espalier.engine.model.attention.paged_plan import (
    explicit_mask,
    needs_explicit_mask,
    pack_mask_segments,
    paged_layout,
    step_mask,
)
from espalier.engine.model.runner import SeqInput
from espalier.engine.spec.tree_builder import tree_attention_mask


def test_paged_layout_csr_arrays() -> None:
    layout = paged_layout([3, 1], [3, 9], [[7, 8], [2, 5, 6]], block_size=4)
    assert layout.qo_indptr.tolist() == [0, 3, 4]
    assert layout.kv_indptr.tolist() == [0, 1, 4]
    assert layout.kv_indices.tolist() == [7, 2, 5, 6]  # only the pages in use
    assert layout.last_page_len.tolist() == [3, 1]
    assert layout.qo_indptr.dtype == torch.int32 and layout.batch_size == 2


def base_rule(meta: object, b: int, window: int | None) -> torch.Tensor:
    """The masking rule of ``attention/base.py``, entry by entry (the slow obvious oracle)."""
    ctx, kv = meta.context_lens[b], meta.kv_lens[b]  # type: ignore[attr-defined]
    positions = meta.positions_list[b]  # type: ignore[attr-defined]
    custom = meta.custom_masks[b]  # type: ignore[attr-defined]
    out = torch.zeros((kv - ctx, kv), dtype=torch.bool)
    for t in range(kv - ctx):
        for j in range(kv):
            allowed = bool(custom[t, j]) if custom is not None else j <= ctx + t
            k_pos = j if j < ctx else positions[j - ctx]
            if window is not None and positions[t] - k_pos >= window:
                allowed = False
            out[t, j] = allowed
    return out


def test_explicit_masks_follow_the_base_rule() -> None:
    #  tree after 9 context entries:  0 -> 1 -> 3,  0 -> 2
    parents = [-1, 0, 0, 1]
    tree = SeqInput(
        list(range(4)),
        [5, 6, 7, 8],
        9,
        positions=[9, 10, 10, 11],
        custom_mask=tree_attention_mask(parents, 9),
        logits="all",
    )
    causal = SeqInput([4, 5], [1, 2, 3], 2)
    meta = build_metadata([tree, causal], block_size=4, device=torch.device("cpu"))
    for window in (None, 3, 6):
        for b in range(2):
            got = torch.from_numpy(explicit_mask(meta, b, window))
            assert torch.equal(got, base_rule(meta, b, window)), (window, b)
        segments = step_mask(meta, window)
        assert segments is not None and [len(s) for s in segments] == [4 * 13, 3 * 5]
    assert needs_explicit_mask(meta, 0, None) and not needs_explicit_mask(meta, 1, 3)


def test_causal_steps_need_no_mask() -> None:
    batch = [SeqInput([0, 1], [4, 5, 6], 0), SeqInput([2], [9], 3)]
    meta = build_metadata(batch, block_size=4, device=torch.device("cpu"))
    assert step_mask(meta, None) is None and step_mask(meta, 2) is None


def test_packed_masks_read_back_as_flashinfer_reads_them() -> None:
    """Byte-aligned segments, little bit order: bit ``i`` of segment ``b`` is at byte
    ``indptr[b] + i // 8``, bit ``i % 8`` (what the kernel reads for query row ``i // kv_len``)."""
    rng = torch.Generator().manual_seed(0)
    segments = [torch.rand(n, generator=rng).numpy() < 0.5 for n in (13, 8, 1, 30)]
    packed, indptr = pack_mask_segments(segments)
    assert indptr.tolist() == [0, 2, 3, 4, 8] and packed.dtype.name == "uint8"
    for b, seg in enumerate(segments):
        bits = [(packed[indptr[b] + i // 8] >> (i % 8)) & 1 for i in range(len(seg))]
        assert bits == seg.astype(int).tolist()
