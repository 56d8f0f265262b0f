"""Fused masked greedy verification of draft trees: the logits are read once.

Inputs describe ``B`` requests' draft trees stacked into ``N`` nodes; request ``b`` owns nodes
``offsets[b] .. offsets[b + 1] - 1`` (rows of the verify logits, in the same order). Trees use the
``DraftTree`` encoding (int64, local ids, node 0 = root = last verified token, -1 = none):
``first_child``, ``next_sibling``, ``tokens``. Bitmask layout: see :mod:`espalier.kernels.bitmask`.

Two launches:

1. ``_masked_argmax_kernel``, grid ``(N, splits)``: each program reads a slice of one row's logits
   and mask words and keeps a per-lane running (max, first index) over allowed tokens; it writes one
   partial (value, index). Rows of inactive nodes (not valid or not filled) are not read at all.
2. ``_tree_walk_kernel``, grid ``(B,)``: combines the partials into each node's argmax, loads the
   request's tree into registers once, finds for every node its chosen child (the first child in
   sibling order that is active and whose token is the node's argmax) with a vector loop over
   sibling positions (register gathers), then follows chosen children from the root. Output:
   the accepted path, its length and the bonus token (the last node's argmax).

Result equals: mask the logits, take the constrained argmax per node (lowest id among maxima), walk
from the root (see :func:`espalier.kernels.reference.verify_greedy`, the twin).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from espalier.kernels import reference
from espalier.kernels._dispatch import Backend, next_power_of_2, target_programs, use_triton
from espalier.kernels.reference import VerifyResult

# Launch shape of the argmax kernel on CUDA (bench/kernels.py sweeps these).
CUDA_BYTES_PER_ITER = 16384
CUDA_NUM_WARPS = 8

_NONE: tl.constexpr = tl.constexpr(2147483647)  # index sentinel: no allowed token seen


@triton.jit
def _is_active(valid_ptr, filled_ptr, index, HAS_VALID: tl.constexpr, HAS_FILLED: tl.constexpr):
    """Whether node(s) ``index`` may be accepted: valid and filled (absent flags count as True)."""
    ok = index >= 0
    if HAS_VALID:
        ok = ok & (tl.load(valid_ptr + index, mask=index >= 0, other=0) != 0)
    if HAS_FILLED:
        ok = ok & (tl.load(filled_ptr + index, mask=index >= 0, other=0) != 0)
    return ok


@triton.jit(do_not_specialize=["n_splits"])
def _masked_argmax_kernel(
    logits_ptr,
    mask_ptr,
    mask_rows_ptr,
    valid_ptr,
    filled_ptr,
    part_val_ptr,
    part_idx_ptr,
    n_cols,
    mask_words,
    logits_stride,
    mask_stride,
    chunk,
    n_splits,
    HAS_MASK: tl.constexpr,
    HAS_MASK_ROWS: tl.constexpr,
    HAS_VALID: tl.constexpr,
    HAS_FILLED: tl.constexpr,
    WORDS: tl.constexpr,
):
    """Program (r, s): partial constrained argmax of row r over its s-th column chunk.

    Per lane, a running (max, first index) over allowed tokens; an allowed ``-inf`` still beats
    "nothing seen yet", so a row whose allowed logits are all ``-inf`` yields its lowest allowed id.
    """
    r = tl.program_id(0)
    split = tl.program_id(1)
    active = _is_active(valid_ptr, filled_ptr, r, HAS_VALID, HAS_FILLED)
    logits_row = logits_ptr + r.to(tl.int64) * logits_stride
    mrow = tl.load(mask_rows_ptr + r).to(tl.int64) if HAS_MASK_ROWS else r.to(tl.int64)
    mask_row = mask_ptr + tl.maximum(mrow, 0) * mask_stride
    words_to_read = tl.where(mrow >= 0, mask_words, 0)
    start = split * chunk
    end = tl.minimum(start + chunk, n_cols)
    n_iter = tl.where(active, (end - start + WORDS * 32 - 1) // (WORDS * 32), 0)
    word_off = tl.arange(0, WORDS)
    bit = tl.arange(0, 32)
    best_val = tl.full((WORDS, 32), float("-inf"), tl.float32)
    best_idx = tl.full((WORDS, 32), _NONE, tl.int32)
    for i in range(0, n_iter):
        word = (start + i * WORDS * 32) // 32 + word_off
        cols = word[:, None] * 32 + bit[None, :]
        in_range = cols < end
        x = tl.load(logits_row + cols, mask=in_range, other=float("-inf")).to(tl.float32)
        allowed = in_range
        if HAS_MASK:
            # unconstrained rows (mask row -1) read no words and allow everything
            bits = tl.load(mask_row + word, mask=word < words_to_read, other=0)
            bits = tl.where(mrow >= 0, bits, -1)
            allowed = allowed & (((bits[:, None] >> bit[None, :]) & 1) != 0)
        take = allowed & ((x > best_val) | (best_idx == _NONE))
        best_val = tl.where(take, x, best_val)
        best_idx = tl.where(take, cols, best_idx)
    row_max = tl.max(tl.max(best_val, axis=1), axis=0)
    hit = (best_idx != _NONE) & (best_val == row_max)
    first = tl.min(tl.min(tl.where(hit, best_idx, _NONE), axis=1), axis=0)
    tl.store(part_val_ptr + r * n_splits + split, row_max)
    tl.store(part_idx_ptr + r * n_splits + split, first)


@triton.jit(do_not_specialize=["n_splits", "max_nodes"])
def _tree_walk_kernel(
    part_val_ptr,
    part_idx_ptr,
    n_splits,
    offsets_ptr,
    valid_ptr,
    filled_ptr,
    first_child_ptr,
    next_sibling_ptr,
    tokens_ptr,
    argmax_ptr,
    packed_ptr,
    max_nodes,
    HAS_VALID: tl.constexpr,
    HAS_FILLED: tl.constexpr,
    MAX_NODES: tl.constexpr,
    SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    base = tl.load(offsets_ptr + b)
    n = (tl.load(offsets_ptr + b + 1) - base).to(tl.int32)
    node = tl.arange(0, MAX_NODES)
    in_tree = node < n
    split = tl.arange(0, SPLITS)
    part = (base + node)[:, None] * n_splits + split[None, :]
    part_mask = in_tree[:, None] & (split < n_splits)[None, :]
    pval = tl.load(part_val_ptr + part, mask=part_mask, other=float("-inf"))
    pidx = tl.load(part_idx_ptr + part, mask=part_mask, other=_NONE)
    node_max = tl.max(pval, axis=1)
    first = tl.min(tl.where((pidx != _NONE) & (pval == node_max[:, None]), pidx, _NONE), axis=1)
    argmax = tl.where(first != _NONE, first, -1)
    tl.store(argmax_ptr + base + node, argmax.to(tl.int64), mask=in_tree)
    # the tree in registers (one load of each array), then gathers instead of dependent loads
    first_child = tl.load(first_child_ptr + base + node, mask=in_tree, other=-1).to(tl.int32)
    next_sibling = tl.load(next_sibling_ptr + base + node, mask=in_tree, other=-1).to(tl.int32)
    tokens = tl.load(tokens_ptr + base + node, mask=in_tree, other=-1).to(tl.int32)
    ok = _is_active(valid_ptr, filled_ptr, base + node, HAS_VALID, HAS_FILLED) & in_tree
    # node tokens, -2 where the node may not be accepted (never equal to an argmax)
    key = tl.where(ok, tokens, -2)
    # chosen child of every node: scan sibling positions for all nodes at once
    child = first_child
    chosen = tl.full((MAX_NODES,), -1, tl.int32)
    steps = 0
    while (tl.max(child, axis=0) >= 0) & (steps < n):
        has = child >= 0
        at = tl.maximum(child, 0)
        hit = has & (chosen < 0) & (argmax >= 0) & (tl.gather(key, at, 0) == argmax)
        chosen = tl.where(hit, child, chosen)
        child = tl.where(has, tl.gather(next_sibling, at, 0), -1)
        steps += 1
    # follow chosen children from the root, collecting the path in registers
    path = tl.where(node == 0, 0, -1)
    cur = 0
    length = 0
    nxt = tl.max(tl.where(node == 0, chosen, -1), axis=0)
    while (nxt >= 0) & (length < n):
        length += 1
        path = tl.where(node == length, nxt, path)
        cur = nxt
        nxt = tl.max(tl.where(node == cur, chosen, -1), axis=0)
    bonus = tl.max(tl.where(node == cur, argmax, -1), axis=0)
    out = packed_ptr + b.to(tl.int64) * (max_nodes + 2)  # [accept_length, bonus, path...]
    tl.store(out, length)  # stored as int64 (the pointer type)
    tl.store(out + 1, bonus.to(tl.int64))
    tl.store(out + 2 + node, path.to(tl.int64), mask=node < max_nodes)


def verify_greedy(
    logits: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    tokens: torch.Tensor,
    offsets: Sequence[int] | torch.Tensor,
    *,
    max_nodes: int | None = None,
    bitmask: torch.Tensor | None = None,
    mask_rows: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    filled: torch.Tensor | None = None,
    vocab_size: int | None = None,
    backend: Backend = "auto",
) -> VerifyResult:
    """Constrained greedy verification of ``B`` draft trees, reading the logits once.

    logits: float32/bfloat16/float16 ``[N, Vl]`` (unit stride along the vocabulary), one row per
        node. first_child, next_sibling, tokens: int64 ``[N]``, local ids per tree (DraftTree).
    offsets: ``B + 1`` ints, ``offsets[0] == 0``, ``offsets[-1] == N``: a host sequence (the engine
        knows its tree sizes), or an int64 tensor on the logits' device with ``max_nodes`` (at least
        the largest tree; no host transfer: usable inside CUDA graph capture).
    bitmask: int32 ``[M, W]`` or None (nothing constrained).
    mask_rows: int ``[N]``: bitmask row of each node, -1 = unconstrained (default: row i).
    valid, filled: bool ``[N]`` from the tree masks; a node missing either is never accepted and
        its logits are not read (default all True). The root must be valid and filled.
    vocab_size: tokens ``>= vocab_size`` are never chosen (default ``Vl``).
    All tensors on the logits' device. Returns :class:`VerifyResult`; its ``path`` has
    ``max_nodes`` (default: the largest tree) columns.
    """
    n, n_cols = logits.shape
    dev = logits.device
    if isinstance(offsets, torch.Tensor):
        if max_nodes is None:
            raise ValueError("offsets given as a tensor need max_nodes")
        batch = offsets.shape[0] - 1
        offsets_t = offsets
    else:
        batch = len(offsets) - 1
        sizes = [offsets[i + 1] - offsets[i] for i in range(batch)]
        max_nodes = max(sizes, default=0) if max_nodes is None else max_nodes
        offsets_t = torch.tensor(list(offsets), dtype=torch.int64).to(dev, non_blocking=True)
    vocab = n_cols if vocab_size is None else min(vocab_size, n_cols)
    if not use_triton(logits, backend) or n == 0 or batch == 0:
        active = torch.ones(n, dtype=torch.bool, device=dev)
        for flags in (valid, filled):
            if flags is not None:
                active = active & flags.bool()
        host_offsets = offsets.tolist() if isinstance(offsets, torch.Tensor) else list(offsets)
        return reference.verify_greedy(
            logits, bitmask, mask_rows, active, first_child, next_sibling, tokens,
            host_offsets, max_nodes, vocab,
        )  # fmt: skip
    if logits.stride(1) != 1:
        raise ValueError("logits need unit stride along the vocabulary")
    # CUDA: 16 KiB of logits per program iteration keeps enough bytes in flight per SM; the
    # interpreter: small blocks for small rows, so that splits and loops are exercised
    cpu_words = 8 if vocab <= 4096 else 64
    words = CUDA_BYTES_PER_ITER // 32 // logits.element_size() if logits.is_cuda else cpu_words
    block = words * 32
    blocks = triton.cdiv(vocab, block)
    splits = max(1, min(blocks, triton.cdiv(target_programs(dev), n)))
    chunk = triton.cdiv(blocks, splits) * block
    splits = triton.cdiv(vocab, chunk)
    part_val = torch.empty((n, splits), dtype=torch.float32, device=dev)
    part_idx = torch.empty((n, splits), dtype=torch.int32, device=dev)
    _masked_argmax_kernel[(n, splits)](
        logits,
        bitmask if bitmask is not None else logits,
        mask_rows if mask_rows is not None else logits,
        valid if valid is not None else logits,
        filled if filled is not None else logits,
        part_val,
        part_idx,
        vocab,
        bitmask.shape[1] if bitmask is not None else 0,
        logits.stride(0),
        bitmask.stride(0) if bitmask is not None else 0,
        chunk,
        splits,
        HAS_MASK=bitmask is not None,
        HAS_MASK_ROWS=mask_rows is not None,
        HAS_VALID=valid is not None,
        HAS_FILLED=filled is not None,
        WORDS=words,
        num_warps=CUDA_NUM_WARPS if logits.is_cuda else 1,
    )
    argmax = torch.empty(n, dtype=torch.int64, device=dev)
    packed = torch.empty((batch, max_nodes + 2), dtype=torch.int64, device=dev)
    # the walk's tile: every split the vocabulary can have (not this step's count) and the
    # largest tree rounded up, so a step's sizes pick one of few variants (``warm_up``)
    tile_nodes, tile_splits = next_power_of_2(max_nodes), next_power_of_2(blocks)
    _tree_walk_kernel[(batch,)](
        part_val,
        part_idx,
        splits,
        offsets_t,
        valid if valid is not None else logits,
        filled if filled is not None else logits,
        first_child,
        next_sibling,
        tokens,
        argmax,
        packed,
        max_nodes,
        HAS_VALID=valid is not None,
        HAS_FILLED=filled is not None,
        MAX_NODES=tile_nodes,
        SPLITS=tile_splits,
        # one warp for small trees (cheap reductions); more when the partials block is large
        num_warps=4 if tile_nodes > 128 or tile_nodes * tile_splits > 1024 else 1,
    )
    return VerifyResult(argmax=argmax, packed=packed)


def warm_up(
    device: torch.device,
    vocab_size: int,
    mask_words: int,
    max_nodes: int,
    *,
    logits_width: int,
    backend: Backend = "auto",
) -> int:
    """Launch (so compile) every variant of both kernels that :func:`verify_greedy` can take on
    ``device`` for fp32 logits ``[N, logits_width]`` (tokens ``>= vocab_size`` never chosen) and
    int32 bitmasks of ``mask_words`` words, with per-node mask rows, valid and filled flags (the
    engine's calls), constrained or not, for trees of up to ``max_nodes`` nodes; tiny dummy
    trees. Returns the number of calls (none where ``backend`` resolves to the torch twin,
    which compiles nothing: "auto" off CUDA).

    A step's node, split and tree counts are not specialized on; only the walk's power-of-two
    tree tile varies, so a step after this compiles nothing (a new tree size mid-run cost a
    0.2-0.3 s compile on the H200, issue 28)."""
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return 0
    calls = 0
    nodes = 1
    while True:
        size = min(nodes, max_nodes)
        logits = torch.zeros((size, logits_width), dtype=torch.float32, device=device)
        chain = torch.arange(size, dtype=torch.int64, device=device)
        first_child = torch.where(chain + 1 < size, chain + 1, -1)
        next_sibling = torch.full_like(chain, -1)
        flags = torch.ones(size, dtype=torch.bool, device=device)
        rows = torch.zeros(size, dtype=torch.int64, device=device)
        for bitmask in (None, torch.full((1, mask_words), -1, dtype=torch.int32, device=device)):
            verify_greedy(
                logits, first_child, next_sibling, chain, [0, size], bitmask=bitmask,
                mask_rows=rows, valid=flags, filled=flags, vocab_size=vocab_size, backend=backend,
            )  # fmt: skip
            calls += 1
        if size == max_nodes:
            return calls
        nodes *= 2
