"""Fused CUDA kernels for the decoder layers (Triton), each matching its torch twin's roundings.

A decode step of an 8B model is a few milliseconds of weight streaming; every extra kernel costs
microseconds even inside a CUDA graph. The eager layer code launches ~40 kernels per layer (an
RMSNorm alone is eight); these four replace most of them, and ``fuse_projections`` turns the
q/k/v and gate/up projections into one GEMM each:

- ``rms_norm``: Llama style ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` or Gemma style
  ``(x * rsqrt(...) * (1 + weight)).to(dtype)``; one program per row, fp32 statistics.
- ``add_rms_norm``: the residual add before a norm fused into it, ``(x + delta, rms_norm(x +
  delta))`` in one launch; the decoder layers defer each residual add to the next norm for it.
- ``rope``: rotate-half rotary embedding of q and k in one launch (q/k may be strided views of a
  fused qkv output), outputs contiguous; the same bf16 roundings as ``layers.apply_rope``.
- ``gated_act``: ``act(gate) * up`` of a fused ``[T, 2 * I]`` gate/up output (SiLU or tanh-GELU).

The two norm kernels live in ``models/fused_norm.py``. Used on CUDA tensors only; the layer code
keeps its torch path for CPU (and as the oracle: ``tests/engine/test_fused_ops.py`` runs these
kernels in Triton's CPU interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from espalier.engine.models.fused_norm import add_rms_norm, rms_norm

__all__ = ["add_rms_norm", "fuse_projections", "gated_act", "rms_norm", "rope"]


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    n_q_heads,
    n_k_heads,
    HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, HALF)
    dtype = q_out_ptr.dtype.element_ty
    c1 = tl.load(cos_ptr + t * 2 * HALF + offs).to(tl.float32)
    c2 = tl.load(cos_ptr + t * 2 * HALF + HALF + offs).to(tl.float32)
    s1 = tl.load(sin_ptr + t * 2 * HALF + offs).to(tl.float32)
    s2 = tl.load(sin_ptr + t * 2 * HALF + HALF + offs).to(tl.float32)
    if h < n_q_heads:
        src = q_ptr + t * q_stride_t + h * q_stride_h
        dst = q_out_ptr + (t * n_q_heads + h) * 2 * HALF
    else:
        src = k_ptr + t * k_stride_t + (h - n_q_heads) * k_stride_h
        dst = k_out_ptr + (t * n_k_heads + h - n_q_heads) * 2 * HALF
    x1 = tl.load(src + offs).to(tl.float32)
    x2 = tl.load(src + HALF + offs).to(tl.float32)
    # x * cos + cat(-x2, x1) * sin, rounded to the model dtype after each op (as in torch)
    a1 = (x1 * c1).to(dtype).to(tl.float32)
    b1 = (-x2 * s1).to(dtype).to(tl.float32)
    a2 = (x2 * c2).to(dtype).to(tl.float32)
    b2 = (x1 * s2).to(dtype).to(tl.float32)
    tl.store(dst + offs, (a1 + b1).to(dtype))
    tl.store(dst + HALF + offs, (a2 + b2).to(dtype))


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` (unit stride in D; may be views
    of a fused projection) with ``cos, sin [T, 1, D]`` (contiguous) -> contiguous ``(q, k)``."""
    t, hq, d = q.shape
    hk = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    if t:
        _rope_kernel[(t, hq + hk)](
            q,
            k,
            cos.contiguous(),
            sin.contiguous(),
            q_out,
            k_out,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            hq,
            hk,
            HALF=d // 2,
            num_warps=1,
        )
    return q_out, k_out


@triton.jit
def _gated_act_kernel(x_ptr, out_ptr, n_cols, GELU: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + t * 2 * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * 2 * n_cols + n_cols + cols, mask=inside, other=0.0).to(tl.float32)
    if GELU:  # tanh approximation; tanh(z) = 1 - 2 / (exp(2z) + 1)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    else:
        a = g / (1.0 + tl.exp(-g))
    a = a.to(dtype).to(tl.float32)
    tl.store(out_ptr + t * n_cols + cols, (a * u).to(dtype), mask=inside)


def gated_act(gate_up: torch.Tensor, *, gelu: bool) -> torch.Tensor:
    """``act(gate) * up`` of ``gate_up [T, 2 * I]`` (contiguous) -> ``[T, I]``."""
    t, width = gate_up.shape
    n = width // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = 1024
        _gated_act_kernel[(t, triton.cdiv(n, block))](
            gate_up.contiguous(), out, n, GELU=gelu, BLOCK=block, num_warps=4
        )
    return out


def fuse_projections(model: nn.Module) -> None:
    """Give every attention block one ``qkv_weight`` (+ ``qkv_bias``) and every gated MLP one
    ``gate_up_weight`` (rows concatenated: one GEMM instead of three / two). The original
    parameters become views of the fused tensors, so ``state_dict`` and memory stay as they were."""
    for module in model.modules():
        if all(hasattr(module, n) for n in ("q_proj", "k_proj", "v_proj")):
            _fuse(module, ("q_proj", "k_proj", "v_proj"), "qkv")
        elif all(hasattr(module, n) for n in ("gate_proj", "up_proj")):
            _fuse(module, ("gate_proj", "up_proj"), "gate_up")


def _fuse(module: nn.Module, names: tuple[str, ...], prefix: str) -> None:
    linears = [getattr(module, n) for n in names]
    biases = [lin.bias for lin in linears]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return  # mixed biases: keep the separate projections
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    row = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[row : row + rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[row : row + rows], requires_grad=False)
        row += rows
    setattr(module, f"{prefix}_weight", weight)
    setattr(module, f"{prefix}_bias", bias)
