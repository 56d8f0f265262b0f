"""oneDNN-packed weights for the decoder projections on CPU (fp32), used for batches of rows.

MKL's fp32 GEMM is poor for a few rows: at 8 rows (a batch-8 decode step) Gemma 3 270M's
projections take ~2.3x the one-row time on one AVX2 core, far from both the compute and the
bandwidth bounds. oneDNN's matmul over a weight reordered once into its blocked layout for an
expected batch of 8 rows is 15-30 % faster at 4-8 rows and ~1.6x faster at 30 (prefill chunks),
but slower at 1-2 rows, where ``torch.mm`` stays (measured on AMD EPYC, 1 thread, 18 layers of
distinct weights: 8 rows 80 vs 98 ms, 1 row 57 vs 44 ms). Results agree with ``torch.mm`` to fp32
rounding (~4e-6 on unit-scale logits), like any other GEMM order.

The packed copy doubles the projections' memory, so only models whose projection weights fit in
``MAX_PACKED_BYTES`` are packed (the small models CPU serving is for).
"""

from __future__ import annotations

import torch
from torch import nn

MAX_PACKED_BYTES = 2 << 30
"""Pack no model whose decoder projection weights exceed this (the packed copy is extra memory)."""

MIN_ROWS = 3
"""Inputs with at least this many rows use the packed weight; fewer rows use ``torch.mm``."""

PACK_BATCH_HINT = 8
"""Rows oneDNN lays the packed weight out for (a decode step's batch)."""


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_linears(model: nn.Module) -> int:
    """Give every decoder ``Linear`` (fp32, CPU, 2-D weight) a ``packed_weight``; returns how
    many were packed (0 when oneDNN is missing or the model is too large)."""
    from espalier.engine.model.models.layers import Linear

    linears = [
        m
        for m in model.modules()
        if isinstance(m, Linear) and m.weight.dtype == torch.float32 and not m.weight.is_cuda
    ]
    total = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    if not linears or total > MAX_PACKED_BYTES or not packing_available():
        return 0
    with torch.inference_mode():
        for m in linears:
            m.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
                m.weight.detach(), PACK_BATCH_HINT
            )
    return len(linears)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, in]`` (fp32, CPU, contiguous rows) times the packed weight -> ``[M, out]``."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out
