"""Building blocks shared by the model families: RMSNorms, rotary embedding, gated MLP, attention.

All modules take packed token rows: hidden ``[T, hidden]`` in the model dtype, T = tokens of
the step across all sequences. Parameter names follow Hugging Face checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from espalier.engine.config import ModelConfig, ModelOptions
from espalier.engine.kv_cache import KVCache
from espalier.engine.model.attention.base import AttentionBackend, AttentionMetadata, LayerSpec
from espalier.engine.model.models import cpu_packed
from espalier.kernels import fused, gemv

DEFAULT_OPTIONS = ModelOptions()


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    options: ModelOptions = DEFAULT_OPTIONS,
) -> torch.Tensor:
    """``F.linear`` for 2-D ``x [M, in]``; on CPU computed as ``(W @ x^T)^T``; on CUDA, for
    small M, the skinny GEMM kernel (``ModelOptions.skinny_gemv``).

    Why: MKL's ``x @ W^T`` kernel is 3-15x slower than ``W @ x^T`` for small M on AVX2 CPUs
    (measured on AMD EPYC: M=8 LM head 0.73 s vs 0.19 s); the results agree to fp32 rounding.
    On CUDA the kernel is 1-15 % faster than cuBLAS on most 8B-Llama projections at M <= 16
    (H200; ``espalier.kernels.gemv.preferred`` says where, and why not elsewhere).
    """
    kernels = options.kernels
    if x.is_cuda and options.skinny_gemv and gemv.preferred(x, weight, bias, kernels):
        return gemv.gemv(x, weight, bias, options=kernels)
    if x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out + bias


class UsesOptions:
    """A module whose forward follows its model's ``ModelOptions`` (``options``: the defaults
    until ``build_model`` gives every such module of a model that model's options)."""

    options: ModelOptions = DEFAULT_OPTIONS


def use_options(model: nn.Module, options: ModelOptions) -> None:
    """Give every ``UsesOptions`` module of ``model`` (the model too, if it is one) ``options``."""
    for module in model.modules():
        if isinstance(module, UsesOptions):
            module.options = options


class Linear(UsesOptions, nn.Linear):
    """``nn.Linear`` routed through ``linear`` (same parameters and checkpoint names); on CPU,
    inputs of several rows use the oneDNN-packed weight when the runner made one
    (``cpu_packed.pack_linears``)."""

    packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed_weight
        if packed is not None and x.dim() == 2 and x.shape[0] >= cpu_packed.MIN_ROWS:
            return cpu_packed.packed_linear(x.contiguous(), packed, self.bias)
        return linear(x, self.weight, self.bias, self.options)


class RMSNormBase(UsesOptions, nn.Module):
    """RMSNorm over the last dim, in two flavours (``RMSNorm``, ``GemmaRMSNorm``); ``weight [C]``.

    On CUDA one Triton kernel per norm (``fused.rms_norm``, eight torch kernels otherwise) and
    one per residual add + norm (``add_norm``); on CPU the torch twin ``_torch_norm``.
    """

    gemma: ClassVar[bool]

    def __init__(self, dim: int, eps: float, init: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., C]`` (model dtype) -> normed, same shape, dtype and device."""
        if self._kernels(x):
            kernels = self.options.kernels
            return fused.rms_norm(x, self.weight, self.eps, gemma=self.gemma, options=kernels)
        return self._torch_norm(x)

    def _kernels(self, x: torch.Tensor) -> bool:
        """Whether the norms of ``x`` run as Triton kernels (``kernels/norm.py``): on CUDA."""
        return x.is_cuda or self.options.norm_kernels_on_cpu

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, self(x + delta))`` for ``x, delta [..., C]`` (model dtype, one device);
        ``delta=None``: nothing to add, ``(x, self(x))``. On CUDA one kernel
        (``fused.add_rms_norm``: the same values as the add followed by the norm kernel)."""
        if delta is None:
            return x, self(x)
        if self.options.fuse_residual_add and self._kernels(x):
            kernels = self.options.kernels
            return fused.add_rms_norm(
                x, delta, self.weight, self.eps, gemma=self.gemma, options=kernels
            )
        summed = x + delta
        return summed, self(summed)

    def _torch_norm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class RMSNorm(RMSNormBase):
    """Llama-style: normalize in fp32, cast back, then multiply by ``weight``."""

    gemma = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps, 1.0)

    def _torch_norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GemmaRMSNorm(RMSNormBase):
    """Gemma-style: ``x_normed * (1 + weight)`` computed in fp32, then cast back."""

    gemma = True

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps, 0.0)

    def _torch_norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[T, 1, head_dim]`` in ``dtype`` for int64 ``positions [T]`` (HF half layout).

    inv_freq: fp32 ``[head_dim // 2]`` on the positions' device (``RopeConfig.inv_freq``).
    """
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: ``[T, heads, D]``; rotate-half convention (as transformers)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class GatedMLP(UsesOptions, nn.Module):
    """``down(act(gate(x)) * up(x))`` with act = silu (SwiGLU) or gelu-tanh (GeGLU)."""

    gate_up_weight: torch.Tensor | None = None  # set on CUDA by ``fused.fuse_projections``

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.act: Callable[[torch.Tensor], torch.Tensor]
        if act == "silu":
            self.act = F.silu
        elif act in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):
            # Gemma checkpoints say "gelu" but were trained with the tanh approximation
            self.act = _gelu_tanh
        else:
            raise ValueError(f"unsupported activation {act!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None and x.is_cuda:  # ``fused.fuse_projections``
            gelu, options = self.act is _gelu_tanh, self.options
            kernels = options.kernels
            if options.skinny_gemv and gemv.preferred_gated(x, self.gate_up_weight, kernels):
                gated = gemv.gated_gemv(x, self.gate_up_weight, gelu=gelu, options=kernels)
                return self.down_proj(gated)  # one launch for gate/up and the activation
            gate_up = linear(x, self.gate_up_weight, None, options)
            return self.down_proj(fused.gated_act(gate_up, gelu=gelu, options=kernels))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PagedAttention(UsesOptions, nn.Module):
    """q/k/v/o projections (+ optional per-head QK-norm) around the paged attention backend."""

    qkv_weight: torch.Tensor | None = None  # set on CUDA by ``fused.fuse_projections``
    qkv_bias: torch.Tensor | None = None

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        *,
        qkv_bias: bool,
        o_bias: bool,
        norm_cls: type[nn.Module] | None,
    ) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = Linear(h, config.num_heads * d, bias=qkv_bias)
        self.k_proj = Linear(h, config.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = Linear(h, config.num_kv_heads * d, bias=qkv_bias)
        self.o_proj = Linear(config.num_heads * d, h, bias=o_bias)
        self.q_norm = norm_cls(d, config.rms_norm_eps) if norm_cls is not None else None
        self.k_norm = norm_cls(d, config.rms_norm_eps) if norm_cls is not None else None
        self.spec = LayerSpec(layer=layer, scale=config.scale, sliding_window=config.window(layer))

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        attention: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_weight is not None and x.is_cuda:  # one GEMM (``fused.fuse_projections``)
            qkv = linear(x, self.qkv_weight, self.qkv_bias, self.options)
            nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q = qkv[:, :nq].view(t, self.num_heads, self.head_dim)
            k = qkv[:, nq : nq + nk].view(t, self.num_kv_heads, self.head_dim)
            v = qkv[:, nq + nk :].view(t, self.num_kv_heads, self.head_dim)
        else:
            q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
            k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        layer = self.spec.layer
        kernels = self.options.kernels
        if q.is_cuda and self.options.fuse_rope_store:  # rotation and cache write in one launch
            cache, slots = kv_cache.flat(layer), meta.slot_mapping
            q = fused.rope_store(q, k, v, cos, sin, *cache, slots, options=kernels)
        else:
            if q.is_cuda:
                q, k = fused.rope(q, k, cos, sin, kernels)
            else:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kv_cache.write(layer, meta.slot_mapping, k, v)
        out = attention.attend(self.spec, q, kv_cache, meta)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
