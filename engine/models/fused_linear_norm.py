"""A decode step's last projection of a block, its residual add and the next RMSNorm: one launch.

At batch 1 a decoder layer's ``o_proj`` and ``down_proj`` are skinny GEMVs (``kernels/gemv``)
each followed by ``add_rms_norm`` (``models/fused_norm``): a 2 us launch for 8 KB of work, and
one more gap in the graph. ``linear_add_rms_norm`` folds it into the GEMV: every program adds
the residual to its output columns and stores the sum; then it takes a ticket (an atomic add
on a counter), and the program that takes the last one normalizes the whole row (reading the
sums back from L2) and resets the counter for the next launch.

Roundings are those of the unfused pair: the product rounded to the model dtype as ``gemv``
stores it (same tiles, so the same sums), the add as torch adds, ``fused_norm._normalize`` for
the norm (its reduction runs in this kernel's layout, so ``normed`` can differ from
``add_rms_norm``'s in the last bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from espalier.engine.models.fused_norm import _normalize, _round
from espalier.kernels import gemv
from espalier.kernels.gemv import _accumulate, _load_weight

_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _counter(device: torch.device) -> torch.Tensor:
    """A zeroed int32 ticket counter for ``device`` (one per device: launches on one stream run
    in order; every launch leaves it at zero). Made once, so CUDA graphs keep its address."""
    counters = _COUNTERS.setdefault(device, [])
    if not counters:
        counters.append(torch.zeros(1, dtype=torch.int32, device=device))
    return counters[0]


@triton.jit
def _linear_add_norm_kernel(
    x_ptr,
    w_ptr,
    res_ptr,
    norm_w_ptr,
    summed_ptr,
    normed_ptr,
    counter_ptr,
    N,
    K,
    eps,
    GEMMA: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
):
    """Program p: columns ``[p * BLOCK_N, (p + 1) * BLOCK_N)`` of ``x @ w^T`` (one row of x),
    plus the residual; the last program to finish: the norm of the whole row."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = tl.minimum(rows, N - 1).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + cols[None, :]
    w_ptrs = w_ptr + w_rows[:, None] * K + cols[None, :]
    acc = tl.zeros((1, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = (k + cols) < K
        if EVEN_K:  # noqa: SIM108  (a constexpr branch, resolved at compile time)
            x = tl.load(x_ptrs)
        else:
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
        acc = _accumulate(acc, x, _load_weight(w_ptrs, k_ok, EVEN_K), False, False)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = summed_ptr.dtype.element_ty
    out = tl.sum(acc, axis=2).to(dtype).to(tl.float32)  # as gemv stores it
    n_ok = rows[None, :] < N
    res = tl.load(res_ptr + rows[None, :], mask=n_ok, other=0.0).to(tl.float32)
    tl.store(summed_ptr + rows[None, :], _round(res + out, dtype), mask=n_ok)
    tl.debug_barrier()  # every thread's sums stored before the ticket is taken
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:
        norm_cols = tl.arange(0, NORM_BLOCK)
        inside = norm_cols < N
        row = tl.load(summed_ptr + norm_cols, mask=inside, other=0.0, cache_modifier=".cg")
        w = tl.load(norm_w_ptr + norm_cols, mask=inside, other=0.0).to(tl.float32)
        y = _normalize(row.to(tl.float32), w, N, eps, GEMMA, dtype)
        tl.store(normed_ptr + norm_cols, y, mask=inside)
        tl.atomic_xchg(counter_ptr, 0)


def fusable(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``linear_add_rms_norm`` takes this projection: one row (a batch-1 decode step),
    no bias, contiguous operands, and on CUDA a shape where ``gemv`` is the projection's kernel
    (on the CPU: Triton's interpreter, tests)."""
    return (
        inp.dim() == 2
        and inp.shape[0] == 1
        and bias is None
        and inp.is_contiguous()
        and weight.is_contiguous()
        and (not inp.is_cuda or gemv.preferred(inp, weight))
    )


def linear_add_rms_norm(
    inp: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    *,
    gemma: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(summed, normed)`` with ``summed = residual + inp @ weight^T`` and ``normed =
    rms_norm(summed)``: what ``add_rms_norm(residual, linear(inp, weight), ...)`` returns.

    inp ``[1, K]``, weight ``[N, K]``, residual ``[1, N]`` (contiguous, model dtype, one CUDA
    device, or CPU under Triton's interpreter), norm_weight ``[N]``. Returns two new ``[1, N]``.
    """
    (m, k), n = inp.shape, weight.shape[0]
    if m != 1 or residual.shape != (1, n):
        raise ValueError("linear_add_rms_norm takes one row")
    cfg = gemv.default_config(1, n, k, inp.device)  # gemv's tiles: the same sums
    summed, normed = torch.empty_like(residual), torch.empty_like(residual)
    _linear_add_norm_kernel[(triton.cdiv(n, cfg.block_n),)](
        inp,
        weight,
        residual,
        norm_weight,
        summed,
        normed,
        _counter(inp.device),
        n,
        k,
        eps,
        GEMMA=gemma,
        EVEN_K=k % cfg.block_k == 0,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        NORM_BLOCK=triton.next_power_of_2(n),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return summed, normed
