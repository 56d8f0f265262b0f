"""Triton rotary-embedding kernels (re-exported by ``kernels/fused.py``), with the torch twin's
roundings (``layers.apply_rope``: rotate-half, rounded to the model dtype after each op).

- ``rope``: q and k rotated in one launch; q/k may be strided views of a fused qkv output; both
  outputs contiguous.
- ``rope_store``: the same rotation of q, with the layer's K/V cache write folded in: roped k and
  v go straight to their physical cache slots (what ``KVCache.write`` does with two
  ``index_copy`` launches). One launch instead of three per layer; q comes back contiguous.

One program per (token, head): heads ``[0, Hq)`` rotate q, heads ``[Hq, Hq + Hkv)`` rotate k (and,
storing, copy v). The rotation code is shared, so both functions give k the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from espalier.kernels.options import DEFAULT_KERNELS, KernelOptions
from espalier.kernels.pdl import launch_dependents, pdl, wait_previous


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    q_out_ptr,
    k_out_ptr,
    v_out_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    out_stride_row,
    out_stride_h,
    n_q_heads,
    HALF: tl.constexpr,
    STORE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, HALF)
    dtype = q_out_ptr.dtype.element_ty
    launch_dependents(USE_PDL)
    wait_previous(USE_PDL)
    c1 = tl.load(cos_ptr + t * 2 * HALF + offs).to(tl.float32)
    c2 = tl.load(cos_ptr + t * 2 * HALF + HALF + offs).to(tl.float32)
    s1 = tl.load(sin_ptr + t * 2 * HALF + offs).to(tl.float32)
    s2 = tl.load(sin_ptr + t * 2 * HALF + HALF + offs).to(tl.float32)
    if h < n_q_heads:
        src = q_ptr + t * q_stride_t + h * q_stride_h
        dst = q_out_ptr + (t * n_q_heads + h) * 2 * HALF
    else:
        kh = h - n_q_heads
        src = k_ptr + t * k_stride_t + kh * k_stride_h
        if STORE:  # the token's physical cache slot; v is copied there unrotated
            row = tl.load(slots_ptr + t)
            v_src = v_ptr + t * v_stride_t + kh * v_stride_h
            v_dst = v_out_ptr + row * out_stride_row + kh * out_stride_h
            tl.store(v_dst + offs, tl.load(v_src + offs))
            tl.store(v_dst + HALF + offs, tl.load(v_src + HALF + offs))
        else:
            row = t
        dst = k_out_ptr + row * out_stride_row + kh * out_stride_h
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
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    options: KernelOptions = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` (unit stride in D; may be views
    of a fused projection) with ``cos, sin [T, 1, D]`` (contiguous) -> contiguous ``(q, k)``."""
    t, hq, d = q.shape
    hk = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    if t:
        _launch(q, k, k, cos, sin, None, q_out, k_out, k_out, store=False, options=options)
    return q_out, k_out


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    options: KernelOptions = DEFAULT_KERNELS,
) -> torch.Tensor:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` as ``rope`` does, write the rotated k and
    ``v [T, Hkv, D]`` (q/k/v: unit stride in D, may be views of a fused projection) to rows
    ``slots`` (int64 ``[T]``, distinct) of ``k_cache`` / ``v_cache`` (``[S, Hkv, D]``, the layer's
    flat cache views, one layout), and return the rotated q, contiguous. One device, one dtype."""
    t, hq, d = q.shape
    if k_cache.stride() != v_cache.stride() or k_cache.stride(2) != 1:
        raise ValueError("k_cache and v_cache need one layout, unit stride in D")
    if slots.dtype != torch.int64 or slots.shape != (t,):
        raise ValueError(f"slots must be int64 [{t}]")
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t:
        _launch(q, k, v, cos, sin, slots, q_out, k_cache, v_cache, store=True, options=options)
    return q_out


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor | None,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    *,
    store: bool,
    options: KernelOptions,
) -> None:
    t, hq, d = q.shape
    use_pdl = pdl(q.device, t, options)
    _rope_kernel[(t, hq + k.shape[1])](
        q,
        k,
        v,
        cos.contiguous(),
        sin.contiguous(),
        q if slots is None else slots,  # unread without STORE
        q_out,
        k_out,
        v_out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        hq,
        HALF=d // 2,
        STORE=store,
        USE_PDL=use_pdl,
        num_warps=1,
        launch_pdl=use_pdl,
    )
