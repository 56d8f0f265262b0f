"""Apply a token bitmask to logits in place: disallowed tokens become ``-inf``.

Bitmask layout (written once in ``espalier/constrained/bitmask.py``; restated here because
kernels import nothing from the project): ``int32[rows, words]``; token ``t`` is allowed in row
``r`` iff bit ``t % 32`` of word ``t // 32`` is 1. Tokens whose word lies beyond ``words`` (a
model vocabulary wider than the mask: padding ids) are disallowed.

The Triton kernel never reads a logit it only overwrites. It works on memory sectors (32 bytes: 8
fp32 or 16 bf16/fp16 logits): a sector whose tokens are all disallowed is written with ``-inf``
without being read, one whose tokens are all allowed is not touched at all, and only a sector with
both is read and written. Every access is a full-width vector access (the predicate is uniform per
sector), so DRAM traffic is the minimum the mask allows: about one write pass for sparse masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from espalier.kernels import reference
from espalier.kernels._dispatch import Backend, target_programs, use_triton

# Launch shape on CUDA (bench/kernels.py sweeps these): bytes of logits per program iteration,
# warps per program.
CUDA_BYTES_PER_ITER = 8192
CUDA_NUM_WARPS = 8  # the H200 sweep: 8 warps beat 4 at 1,024 rows, equal at 1 row

_NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))


@triton.jit
def _apply_block(
    logits_row,
    mask_row,
    first_col,
    n_cols,
    mask_words,
    BOUNDED: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Mask columns ``[first_col, first_col + BLOCK)``; bounds-checked only when ``BOUNDED``."""
    NGROUPS: tl.constexpr = BLOCK // GROUP
    FULL: tl.constexpr = (1 << GROUP) - 1
    lane = tl.arange(0, GROUP)
    first = first_col + tl.arange(0, NGROUPS) * GROUP  # first column of each sector
    word = first // 32
    bits = tl.load(mask_row + word, mask=word < mask_words, other=0)
    sector_bits = (bits >> (first % 32)) & FULL
    allowed = (sector_bits[:, None] & (1 << lane)[None, :]) != 0
    mixed = ((sector_bits != 0) & (sector_bits != FULL))[:, None]
    write = (sector_bits != FULL)[:, None]
    cols = first[:, None] + lane[None, :]
    if BOUNDED:
        mixed = mixed & (cols < n_cols)
        write = write & (cols < n_cols)
    x = tl.load(logits_row + cols, mask=mixed, other=_NEG_INF)
    tl.store(logits_row + cols, tl.where(allowed, x, _NEG_INF), mask=write)


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,
    mask_ptr,
    rows_ptr,
    n_cols,
    mask_words,
    logits_stride,
    mask_stride,
    chunk,
    HAS_ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (r, s): logits row ``rows[r]`` (or r), columns ``[s * chunk, (s + 1) * chunk)``."""
    r = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.load(rows_ptr + r).to(tl.int64) if HAS_ROWS else r.to(tl.int64)
    logits_row = logits_ptr + row * logits_stride
    mask_row = mask_ptr + row * mask_stride
    start = split * chunk
    span = tl.minimum(chunk, n_cols - start)
    n_full = span // BLOCK  # blocks inside the row: no per-element bounds checks
    for i in range(0, n_full):
        _apply_block(
            logits_row, mask_row, start + i * BLOCK, n_cols, mask_words, False, GROUP, BLOCK
        )
    if n_full * BLOCK < span:
        _apply_block(
            logits_row, mask_row, start + n_full * BLOCK, n_cols, mask_words, True, GROUP, BLOCK
        )


def apply_bitmask_(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    rows: torch.Tensor | None = None,
    vocab_size: int | None = None,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Set disallowed logits to ``-inf`` in place and return ``logits``.

    logits: float32/bfloat16/float16 ``[B, Vl]`` (or ``[Vl]``), unit stride along the vocabulary,
        any row stride. bitmask: int32 ``[B, W]`` on the same device, layout above.
    rows: optional int32/int64 ``[R]`` (same device): mask only these rows; row ``rows[i]`` of the
        logits is masked with row ``rows[i]`` of the bitmask (one bitmask row per batch slot, as in
        xgrammar). Other rows are left untouched (unconstrained requests).
    vocab_size: tokens ``>= vocab_size`` are disallowed even where the mask has bits for them
        (default ``min(Vl, 32 * W)``); columns ``>= 32 * W`` are always disallowed.
    """
    if logits.dim() == 1:
        apply_bitmask_(logits[None], bitmask.reshape(1, -1), rows, vocab_size, backend=backend)
        return logits
    _check(logits, bitmask, rows)
    if vocab_size is not None and vocab_size < 32 * bitmask.shape[1]:
        bitmask = reference.clip_bitmask(bitmask, vocab_size)
    n_rows = logits.shape[0] if rows is None else rows.shape[0]
    if n_rows == 0 or logits.shape[1] == 0:
        return logits
    if not use_triton(logits, backend):
        return reference.apply_bitmask_(logits, bitmask, rows)
    group = 32 // logits.element_size()
    n_cols = logits.shape[1]
    # CUDA: 8 KiB per program iteration; the interpreter: small blocks for small rows, so that
    # splits and loops are exercised by the CPU tests
    cpu_block = 256 if n_cols <= 4096 else 2048
    block = CUDA_BYTES_PER_ITER // logits.element_size() if logits.is_cuda else cpu_block
    blocks = triton.cdiv(n_cols, block)
    splits = max(1, min(blocks, triton.cdiv(target_programs(logits.device), n_rows)))
    chunk = triton.cdiv(blocks, splits) * block
    splits = triton.cdiv(n_cols, chunk)
    _apply_bitmask_kernel[(n_rows, splits)](
        logits,
        bitmask,
        rows if rows is not None else logits,
        n_cols,
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
        chunk,
        HAS_ROWS=rows is not None,
        GROUP=group,
        BLOCK=block,
        num_warps=CUDA_NUM_WARPS if logits.is_cuda else 1,
    )
    return logits


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"logits must be float32/bfloat16/float16, got {logits.dtype}")
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise TypeError(f"bitmask must be int32 [rows, words], got {bitmask.dtype} {bitmask.shape}")
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask need unit stride along the vocabulary")
    if bitmask.device != logits.device or (rows is not None and rows.device != logits.device):
        raise ValueError("logits, bitmask and rows must be on one device")
    if rows is None and bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows, logits {logits.shape[0]}")
