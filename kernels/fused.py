"""Fused CUDA kernels for the decoder layers (Triton), each matching its torch twin's roundings.

A decode step of an 8B model is a few milliseconds of weight streaming; every extra kernel costs
microseconds even inside a CUDA graph. The eager layer code launches ~40 kernels per layer (an
RMSNorm alone is eight); these five replace most of them, and ``fuse_projections`` turns the
q/k/v and gate/up projections into one GEMM each:

- ``rms_norm``: Llama style ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` or Gemma style
  ``(x * rsqrt(...) * (1 + weight)).to(dtype)``; one program per row, fp32 statistics.
- ``add_rms_norm``: the residual add before a norm fused into it, ``(x + delta, rms_norm(x +
  delta))`` in one launch; the decoder layers defer each residual add to the next norm for it.
- ``rope``: rotate-half rotary embedding of q and k in one launch (q/k may be strided views of a
  fused qkv output), outputs contiguous; the same bf16 roundings as ``layers.apply_rope``.
- ``rope_store``: the same rotation with the K/V cache write folded in: roped k and v go straight
  to their paged-cache slots (one launch instead of rope + two ``index_copy``).
- ``gated_act``: ``act(gate) * up`` of a fused ``[T, 2 * I]`` gate/up output (SiLU or tanh-GELU).

The norm kernels live in ``kernels/norm.py``, the rope kernels in ``kernels/rope.py``.
Used on CUDA tensors only; the layer code keeps its torch path for CPU (and as the oracle:
``tests/engine/test_fused_ops.py`` runs these kernels in Triton's CPU interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from espalier.kernels.norm import add_rms_norm, rms_norm
from espalier.kernels.options import DEFAULT_KERNELS, KernelOptions
from espalier.kernels.pdl import launch_dependents, pdl, wait_previous
from espalier.kernels.rope import rope, rope_store

__all__ = ["add_rms_norm", "fuse_projections", "gated_act", "rms_norm", "rope", "rope_store"]


@triton.jit
def _gated_act_kernel(
    x_ptr, out_ptr, n_cols, GELU: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    launch_dependents(USE_PDL)
    wait_previous(USE_PDL)
    g = tl.load(x_ptr + t * 2 * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * 2 * n_cols + n_cols + cols, mask=inside, other=0.0).to(tl.float32)
    if GELU:  # tanh approximation; tanh(z) = 1 - 2 / (exp(2z) + 1)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    else:
        a = g / (1.0 + tl.exp(-g))
    a = a.to(dtype).to(tl.float32)
    tl.store(out_ptr + t * n_cols + cols, (a * u).to(dtype), mask=inside)


def gated_act(
    gate_up: torch.Tensor, *, gelu: bool, options: KernelOptions = DEFAULT_KERNELS
) -> torch.Tensor:
    """``act(gate) * up`` of ``gate_up [T, 2 * I]`` (contiguous) -> ``[T, I]``."""
    t, width = gate_up.shape
    n = width // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = 1024
        use_pdl = pdl(gate_up.device, t, options)
        _gated_act_kernel[(t, triton.cdiv(n, block))](
            gate_up.contiguous(),
            out,
            n,
            GELU=gelu,
            BLOCK=block,
            USE_PDL=use_pdl,
            num_warps=4,
            launch_pdl=use_pdl,
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
