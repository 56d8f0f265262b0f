"""Skinny GEMM for decode: ``out = x @ weight^T (+ bias)`` for a few rows of ``x`` (M <= 16).

At batch 1 a decode step is a stream of weight bytes: each projection reads its whole ``[N, K]``
weight once. ``gated_gemv`` also fuses the MLP's activation: ``act(x @ gate^T) * (x @ up^T)``
from the fused ``[2I, K]`` gate/up weight in one launch. ``preferred`` says where either beats
cuBLAS (H200 numbers: ``bench/BASELINES.md``, ``docs/decisions/skinny-gemv-per-shape.md``).

Design: program ``p`` owns output columns ``[p * BLOCK_N, (p + 1) * BLOCK_N)``, i.e. a block of
``BLOCK_N`` weight rows (plus the matching up rows when gated), and walks K in ``BLOCK_K`` steps
(each one ``[BLOCK_N, BLOCK_K]`` tile, coalesced along K, loaded ``evict_first``: read once per
step). Rows past N are clamped onto row ``N - 1`` so that weight loads need no mask along N
(their results are dropped at the store). No split-K: N >= 4096 with ``BLOCK_N`` 4-32 gives
128-1024 programs for 132 SMs, and each output is one program's sum (deterministic; no reduce
launch).

Two inner products (``SkinnyConfig.use_dot``):

- FMA (M = 1): ``acc [BLOCK_M, BLOCK_N, BLOCK_K]`` fp32 accumulates elementwise products; one
  reduction over K at the end, none in the loop.
- DOT: ``tl.dot`` of the ``[BLOCK_M >= 16, BLOCK_K]`` activation tile (rows >= M masked to zero)
  with the transposed weight tile (tensor cores), fp32 accumulation.

Under programmatic dependent launch (``kernels/pdl.py``) the first K step's weight tiles of the
FMA tiles are loaded before the wait for the previous kernel, so they stream during its tail
(the tensor-core tiles wait first: loading early gained nothing on the H200), and the next
kernel may launch once the K loop ends (faster than at the start on the H200; both:
``docs/decisions/pdl-one-row-steps.md``).

Both accumulate in fp32 and round once to the output dtype, like cuBLAS (results agree with
``F.linear`` to bf16/fp16 rounding, not bit for bit: the summation order differs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from espalier.kernels import reference
from espalier.kernels._dispatch import Backend, next_power_of_2, use_triton
from espalier.kernels.options import DEFAULT_KERNELS, KernelOptions
from espalier.kernels.pdl import launch_dependents, pdl, wait_previous

MAX_M = 16
"""Largest number of rows ``gemv`` takes (decode and small verify batches)."""


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch shape: ``block_m`` rows of x (a power of two >= M; >= 16 with ``use_dot``),
    ``block_n`` weight rows per program, ``block_k`` columns per loop step, warps, stages."""

    use_dot: bool
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1


@triton.jit
def _accumulate(acc, x, w, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + x @ w^T: ``acc [BM, BN]`` (DOT) or the elementwise ``acc [BM, BN, BK]`` (FMA)."""
    if USE_DOT and DOT_FP32:  # the interpreter: its bf16 tl.dot is wrong (Triton 3.9)
        out = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    elif USE_DOT:
        out = tl.dot(x, tl.trans(w), acc)
    else:
        out = acc + x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return out


@triton.jit
def _load_weight(ptrs, k_ok, EVEN_K: tl.constexpr):
    """One weight tile, streamed once (``evict_first``); masked along K only on a K tail."""
    if EVEN_K:
        tile = tl.load(ptrs, eviction_policy="evict_first")
    else:
        tile = tl.load(ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
    return tile


@triton.jit
def _load_tiles(w_ptrs, up_offset, k_ok, GATED: tl.constexpr, EVEN_K: tl.constexpr):
    """One K step's weight tile and, when gated, its up tile ``up_offset`` elements further
    (without ``GATED`` the second value is the first tile again, unused)."""
    w = _load_weight(w_ptrs, k_ok, EVEN_K)
    w_up = w
    if GATED:
        w_up = _load_weight(w_ptrs + up_offset, k_ok, EVEN_K)
    return w, w_up


@triton.jit
def _step(
    acc,
    acc_up,
    x_ptrs,
    w,
    w_up,
    m_ok,
    k_ok,
    GATED: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """One K step: load the activation tile at ``x_ptrs`` and add its products with the loaded
    weight tiles ``w`` (and ``w_up`` when gated) to the accumulators."""
    if EVEN_K:  # no mask along K: full-width vector loads
        x = tl.load(x_ptrs, mask=m_ok, other=0.0)
    else:
        x = tl.load(x_ptrs, mask=m_ok & k_ok[None, :], other=0.0)
    acc = _accumulate(acc, x, w, USE_DOT, DOT_FP32)
    if GATED:
        acc_up = _accumulate(acc_up, x, w_up, USE_DOT, DOT_FP32)
    return acc, acc_up


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    GELU: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program p: ``out[:M, p * BLOCK_N : (p + 1) * BLOCK_N]`` over the whole of K.

    GATED: the weight is ``[2N, K]`` (gate rows, then up rows) and the program also streams the
    up rows of its columns; the output is ``act(gate) * up`` with the roundings of
    ``kernels/fused.gated_act`` (gate and up rounded to the output dtype first).
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = tl.minimum(rows, N - 1).to(tl.int64)  # clamped: unmasked loads along N
    cols = tl.arange(0, BLOCK_K)
    ms = tl.arange(0, BLOCK_M)
    x_ptrs = x_ptr + ms[:, None] * stride_xm + cols[None, :]
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + cols[None, :]
    up_offset = N.to(tl.int64) * stride_wn
    m_ok = ms[:, None] < M
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    first = 0
    if not USE_DOT:
        # The first K step, peeled: its weight tiles load before the wait for the previous
        # kernel (no kernel writes weights), so under PDL they stream during that kernel's tail.
        k_ok = cols < K
        w, w_up = _load_tiles(w_ptrs, up_offset, k_ok, GATED, EVEN_K)
        wait_previous(USE_PDL)
        acc, acc_up = _step(
            acc, acc_up, x_ptrs, w, w_up, m_ok, k_ok, GATED, USE_DOT, DOT_FP32, EVEN_K
        )
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        first = BLOCK_K
    else:
        wait_previous(USE_PDL)
    for k in range(first, K, BLOCK_K):
        k_ok = (k + cols) < K
        w, w_up = _load_tiles(w_ptrs, up_offset, k_ok, GATED, EVEN_K)
        acc, acc_up = _step(
            acc, acc_up, x_ptrs, w, w_up, m_ok, k_ok, GATED, USE_DOT, DOT_FP32, EVEN_K
        )
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    launch_dependents(USE_PDL)  # after the K loop: the next kernel launches as this one ends
    dtype = out_ptr.dtype.element_ty
    if USE_DOT:
        total = acc
        total_up = acc_up
    else:
        total = tl.sum(acc, axis=2)
        total_up = tl.sum(acc_up, axis=2)
    if HAS_BIAS:
        total += tl.load(bias_ptr + w_rows).to(tl.float32)[None, :]
    if GATED:
        g = total.to(dtype).to(tl.float32)
        if GELU:  # tanh approximation; tanh(z) = 1 - 2 / (exp(2z) + 1)
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
        else:
            a = g / (1.0 + tl.exp(-g))
        total = a.to(dtype).to(tl.float32) * total_up.to(dtype).to(tl.float32)
    out_ptrs = out_ptr + ms[:, None] * stride_om + rows[None, :]
    tl.store(out_ptrs, total.to(dtype), mask=m_ok & (rows[None, :] < N))


def default_config(m: int, n: int, k: int, device: torch.device) -> SkinnyConfig:
    """The launch shape for ``[m, k] x [n, k]^T`` on ``device`` (for a gated call: n = 2I).

    CUDA (the H200 sweep of ``bench/gemv.py`` over 8B-Llama shapes chose them): M = 1 streams with
    FMA tiles of 8 x 512 (4 x 512 for the long-K down projection, 16 x 256 for LM heads); M >= 2
    with tensor-core tiles 32 x 256 (32 x 128 for the gate/up projection), 3-4 stages. The
    interpreter: small tiles so that CPU tests cover several programs, K steps and a K tail.
    """
    if device.type != "cuda":
        if m <= 4:
            return SkinnyConfig(False, next_power_of_2(m), 4, 32)
        return SkinnyConfig(True, 16, 16, 32)
    if m == 1:
        if n >= 65536:
            return SkinnyConfig(False, 1, 16, 256)
        return SkinnyConfig(False, 1, 4 if k > 8192 else 8, 512)
    if n >= 65536:
        return SkinnyConfig(True, 16, 32, 256, num_stages=3)
    if n >= 16384:
        return SkinnyConfig(True, 16, 32, 128, num_stages=3)
    return SkinnyConfig(True, 16, 32, 256, num_stages=4)


PREFERRED_MAX_M = 16
"""Most rows for which ``preferred`` picks the kernel over cuBLAS (decode at small batches and
batch-1 tree verification)."""


def preferred(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    options: KernelOptions = DEFAULT_KERNELS,
) -> bool:
    """Whether ``F.linear(x, weight, bias)`` should run as ``gemv``: CUDA bf16/fp16 operands,
    2-D ``x`` of 1..``PREFERRED_MAX_M`` rows, unit stride along K, weight rows 16-byte aligned
    (vector loads), and a shape where the kernel was faster than cuBLAS on the H200 in
    ``bench/gemv.py`` (three runs on 8B-Llama shapes; cuBLAS's time for one shape varied by up
    to 9 % between runs and even between M in one run, ours by 1-2 %):

    - M = 1: every weight but those of 16384 <= N < 65536 rows (the fused gate/up projection:
      cuBLAS streams it at 0.87-0.96 of copy bandwidth and won two of three runs by 4 %), and
      those too under PDL (``KernelOptions.gate_up_m1_under_pdl``: a cuBLAS kernel takes no
      part in PDL, so it would break the chain of early launches twice per layer).
      Ours vs cuBLAS: o +13-15 %, qkv +2-11 %, LM head +1-3 %, down -1 to +1 %.
    - M >= 2: K <= 8192 (cuBLAS wins the down projection, K = 14336, by 2-7 %) and N <= 4096 or
      N >= 16384: with 32-row tiles N = 6144 (qkv) makes 192 programs, 1.45 waves on 132 SMs,
      and lost by 2-7 % in two runs. Ours: o +6-10 %, LM head +2-5 %, gate/up (``gated_gemv``
      vs cuBLAS + ``gated_act``) +1 %.
    """
    if not (
        x.is_cuda
        and x.dim() == 2
        and 1 <= x.shape[0] <= PREFERRED_MAX_M
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and weight.stride(0) % 8 == 0
        and (bias is None or bias.is_contiguous())
    ):
        return False
    m, k = x.shape
    n = weight.shape[0]
    if m == 1:
        under_pdl = options.gate_up_m1_under_pdl and pdl(x.device, m, options)
        return not 16384 <= n < 65536 or under_pdl
    return k <= 8192 and (n <= 4096 or n >= 16384)


def preferred_gated(
    x: torch.Tensor, gate_up: torch.Tensor, options: KernelOptions = DEFAULT_KERNELS
) -> bool:
    """Whether the gate/up projection + activation should run as ``gated_gemv``: where
    ``preferred`` holds, and M >= 2 (at M = 1 the two weight streams per program ran 13 %
    slower than one: 68 vs 60 µs on the 8B shape)."""
    return x.dim() == 2 and x.shape[0] >= 2 and preferred(x, gate_up, options=options)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: SkinnyConfig | None = None,
    backend: Backend = "auto",
    options: KernelOptions = DEFAULT_KERNELS,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M, K]`` with ``1 <= M <= MAX_M``.

    x: bf16/fp16/fp32 ``[M, K]``, unit stride along K (any row stride). weight: same dtype and
    device, ``[N, K]``, unit stride along K (row slices of a fused weight are fine). bias:
    optional ``[N]``, contiguous. Returns a new contiguous ``[M, N]`` in x's dtype (fp32
    accumulation, one rounding). ``config``: launch shape (default ``default_config``);
    ``options``: the model's launch paths (``kernels/options.py``).
    """
    _check(x, weight, bias)
    if not use_triton(x, backend):
        return reference.linear(x, weight, bias)
    return _launch(x, weight, bias, weight.shape[0], None, config, options)


def gated_gemv(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    *,
    gelu: bool,
    config: SkinnyConfig | None = None,
    backend: Backend = "auto",
    options: KernelOptions = DEFAULT_KERNELS,
) -> torch.Tensor:
    """``act(x @ gate^T) * (x @ up^T)`` in one launch, ``gate_up = cat([gate, up]) [2I, K]``.

    The values of ``gemv(x, gate_up)`` followed by ``kernels/fused.gated_act`` (gate and up
    rounded to x's dtype, the activation rounded, the product rounded; by default the same
    launch shape, so the same sums). act: SiLU, or tanh-GELU with ``gelu``. Returns ``[M, I]``.
    """
    _check(x, gate_up, None)
    if gate_up.shape[0] % 2:
        raise ValueError(f"gate_up needs an even number of rows, got {gate_up.shape[0]}")
    if not use_triton(x, backend):
        return reference.gated_linear(x, gate_up, gelu=gelu)
    return _launch(x, gate_up, None, gate_up.shape[0] // 2, gelu, config, options)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
    gelu: bool | None,
    config: SkinnyConfig | None,
    options: KernelOptions,
) -> torch.Tensor:
    """Run the kernel for ``n`` output columns; ``gelu`` None: plain, else gated."""
    m, k = x.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    cfg = config or default_config(m, weight.shape[0], k, x.device)
    if cfg.block_m < m or (cfg.use_dot and cfg.block_m < 16):
        raise ValueError(f"config {cfg} does not fit M={m}")
    use_pdl = pdl(x.device, m, options)
    _skinny_gemm_kernel[(triton.cdiv(n, cfg.block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        GATED=gelu is not None,
        GELU=bool(gelu),
        USE_DOT=cfg.use_dot,
        DOT_FP32=not x.is_cuda or x.dtype == torch.float32,
        EVEN_K=k > 0 and k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        USE_PDL=use_pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=use_pdl,
    )
    return out


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"need x [M, K] and weight [N, K], got {x.shape} and {weight.shape}")
    if not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"gemv takes 1..{MAX_M} rows, got {x.shape[0]}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dtype != x.dtype:
        raise TypeError(f"x and weight need one float dtype, got {x.dtype} and {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need unit stride along K")
    if weight.device != x.device:
        raise ValueError("x and weight must be on one device")
    if bias is not None and (
        bias.shape != (weight.shape[0],) or not bias.is_contiguous() or bias.device != x.device
    ):
        raise ValueError(f"bias must be contiguous [{weight.shape[0]}] on x's device")
