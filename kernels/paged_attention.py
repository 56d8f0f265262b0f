"""Paged attention for steps of a few new tokens per sequence: decode steps and tree verification.

One kernel serves both, so a decode row and the verify row of the same token run the same code
(the flashinfer path runs a decode row and a tree row through differently shaped tiles).

Contract (all device tensors; ``B`` sequences, ``T`` packed query rows, ``H`` query heads, ``KVH``
K/V heads, ``G = H / KVH``, head dim ``D``):

- q: ``[T, H, D]`` bf16/fp16 (rows of sequence ``b`` at ``qo_indptr[b] : qo_indptr[b + 1]``, each
  a new token whose K/V is already in the cache); out: ``[T, H, D]``, q's dtype.
- k, v: ``[slots, KVH, D]`` (``KVCache.flat``); entry ``j`` of sequence ``b`` lives in slot
  ``kv_indices[kv_indptr[b] + j // page] * page + j % page``.
- ``kv_lens[b]``: the sequence's entries after the step (its ``q_len`` new ones last).
- Masks: causal (row ``t`` sees ``j <= kv_len - q_len + t``), with an optional window
  (``j >= kv_len - q_len + t - window_left``); or explicit (``HAS_MASK``, ``pack_row_masks``):
  int32 words, each row's bits starting at a word, row ``t`` of sequence ``b`` at word
  ``mask_indptr[b] + t * ceil(kv_len / 32)``, entry ``j`` at bit ``j % 32`` of its word ``j //
  32`` (1 = visible). Row-aligned words let a program read a row's ``BLOCK_N`` bits as one or
  two words instead of a byte per entry.

Work split: program ``(tile, kv head, split)`` takes ``BLOCK_Q`` rows of one sequence for the
``G`` query heads of one K/V head (``BLOCK_M = BLOCK_Q * G`` rows of ``q`` against shared K/V
tiles, GQA without repeated loads) over the entries ``[split * split_len, (split + 1) *
split_len)`` in ``BLOCK_N`` steps: ``S = Q K^T`` on tensor cores (fp32 accumulation), online
softmax in fp32 (base 2), ``P`` rounded to the cache dtype for ``P V`` (as flash attention does).
One split: the program writes ``out``. More: each program stores fp32 partials ``(acc, max,
sum)`` in a workspace and takes a ticket (an atomic add on its tile's counter); the program
that takes the last ticket merges the tile's partials and writes ``out`` (no second launch: at
batch 1 a merge kernel cost as much as the attention). ``split_len`` is read
from the device (a CUDA graph keeps its grid and re-plans the split); splits past a sequence's
end write empty partials. A row that sees no entry writes zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from espalier.kernels import reference
from espalier.kernels._dispatch import (
    Backend,
    interpreter_on,
    next_power_of_2,
    sm_count,
    use_triton,
)
from espalier.kernels.options import DEFAULT_KERNELS, AttentionLaunch, KernelOptions
from espalier.kernels.pdl import launch_dependents, pdl, wait_previous

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
"""Most KV splits one launch has (and the partials' workspace holds per row)."""
MIN_SPLIT = 64
"""Fewest entries a split takes: shorter ones spend more on their partials than they save."""


@dataclass(frozen=True)
class StepPlan:
    """One step's device layout for :func:`paged_attention` (int32 on the kernel's device).

    meta: ``[3B + 3]`` = qo_indptr ``[B + 1]``, kv_indptr ``[B + 1]``, kv_lens ``[B]``,
    split_len ``[1]``. kv_indices: ``[pages]``. ``max_q_len``: most rows of one sequence;
    ``splits``: the launch's split dimension. A CUDA graph's plan keeps its tensors and rewrites
    them in place (``engine/model/attention/small_query.py``)."""

    meta: torch.Tensor
    kv_indices: torch.Tensor
    batch: int
    max_q_len: int
    splits: int


def launch_config(head_dim: int, options: KernelOptions = DEFAULT_KERNELS) -> AttentionLaunch:
    """The launch shape for ``head_dim``: ``options.attention_launch`` where set, else 64-entry
    steps up to dim 128 (registers: ``[BLOCK_N, D]`` K and V tiles), 32 beyond."""
    if options.attention_launch is not None:
        return options.attention_launch
    return AttentionLaunch(64 if head_dim <= 128 else 32)


def split_len_for(
    max_kv_len: int,
    splits: int,
    head_dim: int,
    min_split: int = MIN_SPLIT,
    options: KernelOptions = DEFAULT_KERNELS,
) -> int:
    """Entries per split so that ``splits`` splits cover ``max_kv_len`` (a multiple of the loop
    step of ``launch_config(head_dim, options)``, at least ``min_split``: tests give a small one
    to split short sequences)."""
    step = launch_config(head_dim, options).block_n
    per = max(-(-max(max_kv_len, 1) // splits), min_split, step)
    return -(-per // step) * step


def choose_splits(
    programs: int, max_kv_len: int, device: torch.device, options: KernelOptions = DEFAULT_KERNELS
) -> int:
    """Splits for a launch of ``programs`` (tiles x K/V heads) over at most ``max_kv_len``
    entries: enough for ``options.attention_programs_per_sm`` programs per SM, no split under
    ``MIN_SPLIT`` entries."""
    want = -(-options.attention_programs_per_sm * sm_count(device) // max(programs, 1))
    by_length = max(-(-max_kv_len // MIN_SPLIT), 1)
    return max(1, min(want, by_length, MAX_SPLITS))


def host_meta(q_lens: list[int], kv_lens: list[int], pages: list[int], split_len: int) -> list[int]:
    """The int32 ``meta`` of ``StepPlan`` as a python list (``pages[b]``: pages of sequence b)."""
    qo, kv = [0], [0]
    for q_len, n_pages in zip(q_lens, pages):
        qo.append(qo[-1] + q_len)
        kv.append(kv[-1] + n_pages)
    return qo + kv + list(kv_lens) + [split_len]


def pack_row_masks(segments: list[np.ndarray], kv_lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Explicit masks in the kernel's layout: ``segments[b]`` is sequence b's bool mask
    ``[q_len, kv_len]`` flattened row-major. Returns int32 words and int32 word offsets
    ``[B + 1]`` (module docstring)."""
    words, offsets = [], [0]
    for flat, kv_len in zip(segments, kv_lens):
        width = -(-kv_len // 32) * 32
        rows = np.zeros((len(flat) // kv_len, width), dtype=bool)
        rows[:, :kv_len] = np.asarray(flat, dtype=bool).reshape(-1, kv_len)
        packed = np.packbits(rows, axis=1, bitorder="little").view("<i4").ravel()
        words.append(packed)
        offsets.append(offsets[-1] + len(packed))
    return np.concatenate(words).astype(np.int32), np.asarray(offsets, dtype=np.int32)


def tiles_per_sequence(num_heads: int, num_kv_heads: int, max_q_len: int) -> int:
    """Query tiles of one sequence (``tile_shape``'s ``BLOCK_Q`` rows each)."""
    return -(-max_q_len // tile_shape(num_heads, num_kv_heads, max_q_len)[1])


def tile_shape(num_heads: int, num_kv_heads: int, max_q_len: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): rows of a program's q tile (>= 16 for tensor cores, <= 64) and the
    query tokens they hold (``BLOCK_M // G`` with ``G`` query heads per K/V head)."""
    group = num_heads // num_kv_heads
    block_m = min(max(16, next_power_of_2(max_q_len * group)), max(64, next_power_of_2(group)))
    return block_m, max(block_m // group, 1)


@triton.jit(do_not_specialize=["batch", "num_rows", "window_left"])
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_o_ptr,
    part_ml_ptr,
    counter_ptr,
    meta_ptr,
    kv_indices_ptr,
    mask_ptr,
    mask_indptr_ptr,
    batch,
    num_rows,
    scale_log2,
    window_left,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    PAGE: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILES: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b = pid // TILES
    t0 = (pid % TILES) * BLOCK_Q
    q_start = tl.load(meta_ptr + b)
    q_len = tl.load(meta_ptr + b + 1) - q_start
    page0 = tl.load(meta_ptr + batch + 1 + b)
    kv_len = tl.load(meta_ptr + 2 * batch + 2 + b)
    split_len = tl.load(meta_ptr + 3 * batch + 2)
    diag = kv_len - q_len  # row t sees j <= diag + t (causal)
    # The step's metadata is uploaded before the step (no kernel writes it): read above, before
    # the wait. q, the new K/V entries and the split workspace come from kernels: below.
    launch_dependents(USE_PDL)
    wait_previous(USE_PDL)

    r = tl.arange(0, BLOCK_M)
    t = t0 + r // G
    head = kvh * G + r % G
    row_ok = (r < BLOCK_Q * G) & (t < q_len)
    d = tl.arange(0, D)
    q_ptrs = q_ptr + (q_start + t)[:, None].to(tl.int64) * stride_qt
    q = tl.load(q_ptrs + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)

    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_len)
    if not HAS_MASK:  # nothing past the tile's last row's diagonal
        hi = tl.minimum(hi, diag + tl.minimum(t0 + BLOCK_Q, q_len))
        if HAS_WINDOW:  # nothing before its first row's window (kept on the split's grid)
            first = diag + t0 - window_left
            lo = tl.maximum(lo, lo + ((first - lo) // BLOCK_N) * BLOCK_N)
    hi = tl.where(t0 < q_len, hi, lo)  # a tile past the sequence's rows: no loop

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    if HAS_MASK:  # each row's first word
        row_word = tl.load(mask_indptr_ptr + b) + t.to(tl.int64) * ((kv_len + 31) // 32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        page = tl.load(kv_indices_ptr + page0 + j // PAGE, mask=j_ok, other=0)
        slot = page.to(tl.int64) * PAGE + j % PAGE
        k = tl.load(
            k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
            mask=j_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
            mask=j_ok[:, None],
            other=0.0,
        )
        if DOT_FP32:  # the interpreter: its bf16 tl.dot is wrong
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        allowed = row_ok[:, None] & j_ok[None, :]
        if HAS_MASK:  # start is a multiple of BLOCK_N: the tile's bits are whole words
            jl = tl.arange(0, BLOCK_N)
            if BLOCK_N > 64:  # each entry reads its word (a row's lanes share few addresses)
                words = tl.load(
                    mask_ptr + row_word[:, None] + (j // 32)[None, :], mask=allowed, other=0
                )
            else:  # one or two words per row
                word = tl.load(mask_ptr + row_word + start // 32, mask=row_ok, other=0)
                words = word[:, None]
                if BLOCK_N == 64:
                    high_ok = row_ok & ((r * 0 + start + 32) < hi)  # a row's second word exists
                    high = tl.load(mask_ptr + row_word + start // 32 + 1, mask=high_ok, other=0)
                    words = tl.where(jl[None, :] < 32, word[:, None], high[:, None])
            allowed = allowed & (((words >> (jl % 32)[None, :]) & 1) != 0)
        else:
            allowed = allowed & (j[None, :] <= diag + t[:, None])
            if HAS_WINDOW:
                allowed = allowed & (j[None, :] >= diag + t[:, None] - window_left)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    row = (q_start + t).to(tl.int64)
    o_ptrs = out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if SPLIT:
        used = (kv_len + split_len - 1) // split_len  # this sequence's splits
        if (split < used) & (t0 < q_len):
            cell = (split * num_rows + row) * NUM_HEADS + head  # [BLOCK_M]
            tl.store(part_o_ptr + cell[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
            tl.store(part_ml_ptr + cell * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + cell * 2 + 1, l_i, mask=row_ok)
            tl.debug_barrier()  # every thread's partials stored before the ticket is taken
            counter = counter_ptr + pid * tl.num_programs(1) + kvh
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == used - 1:  # the last split of this tile: merge them all
                _merge_splits(
                    part_o_ptr, part_ml_ptr, o_ptrs, row, head, row_ok, used, num_rows,
                    NUM_HEADS, BLOCK_M, D,
                )  # fmt: skip
                tl.atomic_xchg(counter, 0)  # ready for the next launch
    else:
        o = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_splits(
    part_o_ptr, part_ml_ptr, o_ptrs, row, head, row_ok, used, num_rows,
    NUM_HEADS: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """``out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s`` over a tile's ``used`` splits
    (partials read from L2: other programs wrote them)."""
    d = tl.arange(0, D)
    m_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    for s in range(0, used):
        cell = (s * num_rows + row) * NUM_HEADS + head
        m = tl.load(part_ml_ptr + cell * 2, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        m_max = tl.maximum(m_max, m)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for s in range(0, used):
        cell = (s * num_rows + row) * NUM_HEADS + head
        m = tl.load(part_ml_ptr + cell * 2, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        w = tl.exp2(m - m_use)
        sums = tl.load(part_ml_ptr + cell * 2 + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
        total += w * sums
        part = tl.load(
            part_o_ptr + cell[:, None] * D + d[None, :],
            mask=row_ok[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
        acc += part * w[:, None]
    o = tl.where(total[:, None] > 0, acc / tl.where(total > 0, total, 1.0)[:, None], 0.0)
    tl.store(o_ptrs, o.to(o_ptrs.dtype.element_ty), mask=row_ok[:, None])


@dataclass
class Workspace:
    """Split partials, fp32: o ``[splits * T * H * D]``, (max, sum) ``[splits * T * H * 2]``;
    and the int32 tickets of the tiles ``[programs]`` (zero between launches). Grown on demand;
    what it outgrows stays allocated (a CUDA graph captured on it keeps its addresses)."""

    o: torch.Tensor
    ml: torch.Tensor
    counters: torch.Tensor
    retired: list[torch.Tensor]

    @classmethod
    def empty(cls, device: torch.device) -> Workspace:
        none = torch.empty(0, device=device)
        return cls(none, none, torch.zeros(0, dtype=torch.int32, device=device), [])

    def ensure(self, cells: int, head_dim: int, programs: int) -> None:
        device = self.ml.device
        if self.ml.numel() < 2 * cells:
            self.retired += [self.o, self.ml]
            self.o = torch.empty(cells * head_dim, dtype=torch.float32, device=device)
            self.ml = torch.empty(2 * cells, dtype=torch.float32, device=device)
        if self.counters.numel() < programs:
            self.retired.append(self.counters)
            self.counters = torch.zeros(programs, dtype=torch.int32, device=device)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: StepPlan,
    *,
    page_size: int,
    scale: float,
    window_left: int = -1,
    mask: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    workspace: Workspace | None = None,
    backend: Backend = "auto",
    options: KernelOptions = DEFAULT_KERNELS,
) -> torch.Tensor:
    """Attention of ``q [T, H, D]`` over the paged ``k``/``v`` (module docstring) -> ``out``.

    ``window_left``: -1 for none (ignored with ``mask``, which folds any window in).
    ``mask``: (int32 words, int32 word offsets ``[B + 1]``: ``pack_row_masks``) or None (causal).
    ``out``: optional ``[T, H, D]`` to write into (a CUDA graph's fixed output).
    ``options``: the model's launch paths; the plan's split length was made with the same ones.
    """
    if out is None:
        out = torch.empty_like(q)
    if not use_triton(q, backend):
        meta = plan.meta.tolist()  # the CPU twin: host values (CPU tensors, no device sync)
        b = plan.batch
        out.copy_(
            reference.paged_attention(
                q,
                k,
                v,
                meta[: b + 1],
                meta[b + 1 : 2 * b + 2],
                plan.kv_indices.tolist(),
                meta[2 * b + 2 : 3 * b + 2],
                page_size=page_size,
                scale=scale,
                window_left=window_left,
                mask=None if mask is None else (mask[0].cpu(), mask[1].tolist()),
            )
        )
        return out
    t, h, d = q.shape
    kvh = k.shape[1]
    launch = launch_config(d, options)
    block_m, block_q = tile_shape(h, kvh, plan.max_q_len)
    tiles = tiles_per_sequence(h, kvh, plan.max_q_len)
    split = plan.splits > 1
    counters = plan.meta  # unused without splits
    if split:
        workspace = workspace or Workspace.empty(q.device)
        workspace.ensure(plan.splits * t * h, d, plan.batch * tiles * kvh)
        part_o, part_ml, counters = workspace.o, workspace.ml, workspace.counters
    else:
        part_o = part_ml = out  # unused
    mask_bits, mask_indptr = mask if mask is not None else (plan.meta, plan.meta)
    grid = (plan.batch * tiles, kvh, plan.splits)
    use_pdl = pdl(q.device, t, options)
    _attention_kernel[grid](
        q,
        k,
        v,
        out,
        part_o,
        part_ml,
        counters,
        plan.meta,
        plan.kv_indices,
        mask_bits,
        mask_indptr,
        plan.batch,
        t,
        scale * LOG2E,
        window_left,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        PAGE=page_size,
        G=h // kvh,
        D=d,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=launch.block_n,
        TILES=tiles,
        NUM_HEADS=h,
        HAS_MASK=mask is not None,
        HAS_WINDOW=mask is None and window_left >= 0,
        SPLIT=split,
        DOT_FP32=interpreter_on() and not q.is_cuda,
        USE_PDL=use_pdl,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        launch_pdl=use_pdl,
    )
    return out


def warm_up(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_q_len: int,
    window_lefts: Sequence[int] = (-1,),
    options: KernelOptions = DEFAULT_KERNELS,
    max_rows: int | None = None,
) -> int:
    """Launch (so compile) every kernel variant a step of at most ``max_q_len`` new tokens per
    sequence can take for this model, on tiny dummy data; returns the number of launches.
    ``max_rows``: the most token rows one step can hold (the cache's slots; None: no bound):
    the variant past PDL's row limit is built only where a step can pass it.

    A variant is the launch's constexprs: the tile shape (``tile_shape`` of the step's longest
    sequence), explicit masks or causal with each layer window (``window_lefts``), KV splits or
    not, PDL or not (``pdl`` of the step's rows). The step's sizes (sequences, rows, window)
    are not specialized on (``do_not_specialize``), and the strides and pointer alignments are
    those of every real step (contiguous ``q``, the cache's flat ``[slots, KVH, D]`` views), so
    after this no step compiles anything: a new prefill length or batch size mid-run stalled
    every stream for 0.7-1.5 s on the H200 (issue 28)."""
    block_n = launch_config(head_dim, options).block_n
    shapes: dict[tuple[int, int, int], int] = {}  # (BLOCK_M, BLOCK_Q, TILES) -> a q_len
    for q_len in range(1, max_q_len + 1):
        tiles = tiles_per_sequence(num_heads, num_kv_heads, q_len)
        shapes.setdefault((*tile_shape(num_heads, num_kv_heads, q_len), tiles), q_len)
    workspace = Workspace.empty(device)
    launches = 0
    for q_len in shapes.values():
        kv_len = 2 * block_n * -(-q_len // block_n)  # two splits of whole loop steps
        pages = -(-kv_len // page_size)
        k = torch.zeros(pages * page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        # one sequence, then enough that the rows pass PDL's limit (where one sequence is under)
        over = options.pdl_max_rows // q_len + 1
        reach = max_rows is None or over * q_len <= max_rows
        counts = [1] + ([over] if reach and pdl(device, q_len, options) else [])
        for batch in counts:
            q = torch.zeros(batch * q_len, num_heads, head_dim, dtype=dtype, device=device)
            flat = np.ones(q_len * kv_len, dtype=bool)
            words, offsets = pack_row_masks([flat] * batch, [kv_len] * batch)
            explicit = (
                torch.from_numpy(words).to(device),
                torch.from_numpy(offsets).to(device),
            )
            for splits in (1, 2):
                plan = make_plan(
                    [q_len] * batch,
                    [kv_len] * batch,
                    [list(range(pages))] * batch,
                    page_size,
                    head_dim=head_dim,
                    splits=splits,
                    device=device,
                    min_split=block_n,
                    options=options,
                )
                masks = [(w, None) for w in window_lefts] + [(-1, explicit)]
                for window_left, mask in masks:
                    paged_attention(
                        q, k, k, plan, page_size=page_size, scale=1.0,
                        window_left=window_left, mask=mask, workspace=workspace,
                        backend="triton", options=options,
                    )  # fmt: skip
                    launches += 1
    return launches


def build_plan(
    q_lens: list[int],
    kv_lens: list[int],
    pages: list[int],
    kv_indices: torch.Tensor,
    *,
    head_dim: int,
    splits: int,
    device: torch.device,
    min_split: int = MIN_SPLIT,
    options: KernelOptions = DEFAULT_KERNELS,
) -> StepPlan:
    """A fresh ``StepPlan`` on ``device`` (one host-to-device copy per tensor) of at most
    ``splits`` splits: as many as ``split_len_for``'s length needs to cover the longest
    sequence. ``pages[b]``: pages of sequence b; kv_indices: int32 CPU ``[sum(pages)]``."""
    max_kv = max(kv_lens)
    split_len = split_len_for(max_kv, splits, head_dim, min_split, options)
    meta = host_meta(q_lens, kv_lens, pages, split_len)
    return StepPlan(
        torch.tensor(meta, dtype=torch.int32).to(device, non_blocking=True),
        kv_indices.to(device, non_blocking=True),
        batch=len(q_lens),
        max_q_len=max(q_lens),
        splits=-(-max_kv // split_len),
    )


def make_plan(
    q_lens: list[int],
    kv_lens: list[int],
    block_tables: list[list[int]],
    page_size: int,
    *,
    head_dim: int,
    splits: int,
    device: torch.device,
    min_split: int = MIN_SPLIT,
    options: KernelOptions = DEFAULT_KERNELS,
) -> StepPlan:
    """``build_plan`` from per-sequence block tables (tests, benchmarks)."""
    pages = [-(-n // page_size) for n in kv_lens]
    indices = [p for table, n in zip(block_tables, pages) for p in table[:n]]
    kv_indices = torch.tensor(indices or [0], dtype=torch.int32)
    return build_plan(
        q_lens,
        kv_lens,
        pages,
        kv_indices,
        head_dim=head_dim,
        splits=splits,
        device=device,
        min_split=min_split,
        options=options,
    )
