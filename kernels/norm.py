"""Triton RMSNorm kernels (re-exported by ``kernels/fused.py``), with the torch twins' roundings.

- ``rms_norm``: Llama style ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` or Gemma style
  ``(x * rsqrt(...) * (1 + weight)).to(dtype)``; one program per row, fp32 statistics.
- ``add_rms_norm``: the residual add before a norm and the norm of the sum in one launch:
  ``summed = x + delta`` rounded to the model dtype as torch's add rounds it, and
  ``rms_norm(summed)`` from the same normalization code (``_normalize``), so the fused pair is
  bit-identical to the add followed by ``rms_norm``.

Every fp32 -> model-dtype rounding goes through ``_round``: round to nearest even, spelled out
with integer ops for bf16 because Triton's CPU interpreter truncates fp32 -> bf16 casts (on the
GPU the result is that of the hardware conversion; the interpreter then matches it bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from espalier.kernels.options import DEFAULT_KERNELS, KernelOptions
from espalier.kernels.pdl import launch_dependents, pdl, wait_previous


@triton.jit
def _round(y, dtype: tl.constexpr):
    """fp32 ``y`` -> ``dtype``, rounded to nearest even (NaN stays NaN)."""
    if dtype == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        out = tl.where(y == y, out, y.to(tl.bfloat16))
    else:
        out = y.to(dtype)
    return out


@triton.jit
def _normalize(x, w, n_cols, eps, GEMMA: tl.constexpr, dtype: tl.constexpr):
    """One fp32 row ``x`` (zero past ``n_cols``) and fp32 ``w`` -> the normed row in ``dtype``."""
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    if GEMMA:  # noqa: SIM108  (a constexpr branch, resolved at compile time)
        y = x * rstd * (1.0 + w)
    else:
        y = _round(x * rstd, dtype).to(tl.float32) * w
    return _round(y, dtype)


@triton.jit
def _norm_kernel(
    x_ptr,
    d_ptr,
    w_ptr,
    sum_ptr,
    out_ptr,
    n_cols,
    eps,
    HAS_DELTA: tl.constexpr,
    GEMMA: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One row: ``out = norm(x)``, or with ``HAS_DELTA`` ``sum = x + d`` and ``out = norm(sum)``
    (``d_ptr`` and ``sum_ptr`` are not read without it)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    offs = row * n_cols + cols
    dtype = out_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)  # a weight: before the wait
    launch_dependents(USE_PDL)
    wait_previous(USE_PDL)
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(d_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        summed = _round(x + d, dtype)  # torch's add: fp32 sum, one rounding (exact in fp32)
        tl.store(sum_ptr + offs, summed, mask=inside)
        x = summed.to(tl.float32)
    y = _normalize(x, w, n_cols, eps, GEMMA, dtype)
    tl.store(out_ptr + offs, y, mask=inside)


def _num_warps(block: int) -> int:
    """Warps per row program: a decode step has few rows, so one program streams a whole row
    (4096 wide for 8B Llama) and its latency is the kernel's: 8-16 warps, not 4, for wide rows.
    Both kernels use the same count, so their reductions sum in the same order."""
    return min(16, max(4, block // 256))


def _launch_per_row(
    rows: torch.Tensor,
    tensors: tuple[torch.Tensor, ...],
    eps: float,
    gemma: bool,
    *,
    has_delta: bool,
    options: KernelOptions,
) -> None:
    """Launch ``_norm_kernel(*tensors, n_cols, eps, ...)`` (``tensors``: x, d, w, sum, out) with
    one program per row of ``rows`` (``[R, C]``, contiguous, the x); nothing for zero rows.
    Without ``has_delta`` d and sum are not read or written (any tensors of the device)."""
    if rows.shape[0]:
        block = triton.next_power_of_2(rows.shape[1])
        use_pdl = pdl(rows.device, rows.shape[0], options)
        _norm_kernel[(rows.shape[0],)](
            *tensors,
            rows.shape[1],
            eps,
            HAS_DELTA=has_delta,
            GEMMA=gemma,
            BLOCK=block,
            USE_PDL=use_pdl,
            num_warps=_num_warps(block),
            launch_pdl=use_pdl,
        )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as contiguous ``[rows, last dim]`` (a view when ``x`` is already contiguous)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    gemma: bool,
    options: KernelOptions = DEFAULT_KERNELS,
) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any shape, model dtype); ``weight``: ``[C]``, same
    device. Returns a new contiguous tensor of ``x``'s shape and dtype. ``options``: the
    model's launch paths (``kernels/options.py``)."""
    rows = _rows(x)
    out = torch.empty_like(rows)
    _launch_per_row(
        rows, (rows, rows, weight, out, out), eps, gemma, has_delta=False, options=options
    )
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    gemma: bool,
    options: KernelOptions = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(summed, normed)``: ``summed = x + delta`` (as torch adds them) and
    ``normed = rms_norm(summed, weight, eps, gemma=gemma)``, one launch.

    ``x``, ``delta``: same shape (any, RMSNorm over the last dim ``C``), dtype (the model dtype)
    and device; ``weight``: ``[C]``. Both results are new contiguous tensors of ``x``'s shape.
    """
    rows, deltas = _rows(x), _rows(delta)
    summed, out = torch.empty_like(rows), torch.empty_like(rows)
    _launch_per_row(
        rows, (rows, deltas, weight, summed, out), eps, gemma, has_delta=True, options=options
    )
    return summed.view(x.shape), out.view(x.shape)
