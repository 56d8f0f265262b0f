"""Pure-torch twins of the kernels: the CPU fallback and the test oracle.

Bitmask layout as in ``espalier/constrained/bitmask.py`` (see :mod:`espalier.kernels.bitmask`).
Conventions shared with the kernels:

- Constrained argmax of a row: the lowest token id among the allowed tokens with the largest logit
  (an allowed ``-inf`` still beats a disallowed token); ``-1`` when the row allows no token.
- Rows of a verify batch whose node is not valid or not filled get argmax ``-1``: they can never be
  accepted, so their logits are not read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

NO_TOKEN = -1


def allowed_from_bitmask(bitmask: torch.Tensor, n_cols: int) -> torch.Tensor:
    """bool ``[R, n_cols]`` from int32 ``[R, W]``; columns ``>= 32 * W`` are disallowed."""
    words = bitmask.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(bitmask.shape[0], words * 32)
    if words * 32 >= n_cols:
        return bits[:, :n_cols]
    pad = torch.zeros(bitmask.shape[0], n_cols - words * 32, dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)


def clip_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Copy of ``bitmask`` with the bits of tokens ``>= vocab_size`` cleared."""
    out = bitmask.clone()
    first_word = vocab_size // 32
    rem = vocab_size % 32
    if rem and first_word < out.shape[1]:
        out[:, first_word] &= (1 << rem) - 1
        first_word += 1
    out[:, first_word:] = 0
    return out


def apply_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Twin of :func:`espalier.kernels.bitmask.apply_bitmask_` (rows already validated)."""
    if rows is None:
        allowed = allowed_from_bitmask(bitmask, logits.shape[1])
        logits.masked_fill_(~allowed, float("-inf"))
        return logits
    rows = rows.long()
    allowed = allowed_from_bitmask(bitmask[rows], logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits


def node_allowed(
    n_cols: int,
    n_rows: int,
    bitmask: torch.Tensor | None,
    mask_rows: torch.Tensor | None,
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor:
    """bool ``[n_rows, n_cols]``: row i uses bitmask row ``mask_rows[i]`` (i if None; -1: none)."""
    cols = torch.arange(n_cols, device=device)
    allowed = (cols < vocab_size)[None, :].expand(n_rows, n_cols).clone()
    if bitmask is None:
        return allowed
    idx = torch.arange(n_rows, device=device) if mask_rows is None else mask_rows.long()
    masked = idx >= 0
    bits = allowed_from_bitmask(bitmask[idx.clamp_min(0)], n_cols)
    return allowed & (bits | ~masked[:, None])


def constrained_argmax(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """int64 ``[R]``: lowest id among allowed tokens with the largest logit; -1 if none allowed."""
    values = logits.float().masked_fill(~allowed, float("-inf"))
    best = values.max(dim=1, keepdim=True).values if values.shape[1] else values[:, :1]
    ids = torch.arange(logits.shape[1], device=logits.device).expand_as(values)
    big = logits.shape[1]
    cand = torch.where(allowed & (values == best), ids, big)
    first = cand.min(dim=1).values if values.shape[1] else torch.full_like(best[:, 0], big).long()
    return torch.where(first < big, first, NO_TOKEN).long()


@dataclass(frozen=True)
class VerifyResult:
    """Greedy verification of a batch of draft trees (all int64, on the logits' device).

    argmax: ``[N]`` constrained argmax per node (-1: node not valid/filled, or nothing allowed).
    packed: ``[B, 2 + max_nodes]``, per request ``accept_length, bonus_token, path...``, so one
    device-to-host copy fetches everything; the properties below are views of it.
    """

    argmax: torch.Tensor
    packed: torch.Tensor

    @property
    def accept_length(self) -> torch.Tensor:
        """``[B]`` accepted draft tokens (path length minus the root)."""
        return self.packed[:, 0]

    @property
    def bonus_token(self) -> torch.Tensor:
        """``[B]`` argmax at the last accepted node (-1 if its row allows nothing)."""
        return self.packed[:, 1]

    @property
    def path(self) -> torch.Tensor:
        """``[B, max_nodes]`` local node ids of the accepted path, root (0) first, -1 padded."""
        return self.packed[:, 2:]


def walk_greedy(
    argmax: Sequence[int],
    active: Sequence[bool],
    first_child: Sequence[int],
    next_sibling: Sequence[int],
    tokens: Sequence[int],
    offsets: Sequence[int],
) -> tuple[list[list[int]], list[int]]:
    """Accepted path per request (local ids, root first) and bonus token, on plain lists.

    From the root, follow the first child in sibling order that is active (valid and filled) and
    whose token equals the current node's argmax; stop when there is none.
    """
    paths: list[list[int]] = []
    bonus: list[int] = []
    for b in range(len(offsets) - 1):
        base, n = offsets[b], offsets[b + 1] - offsets[b]
        cur, path = 0, [0]
        while True:
            target = argmax[base + cur]
            child, nxt = first_child[base + cur], -1
            for _ in range(n):
                if child < 0:
                    break
                if active[base + child] and target >= 0 and tokens[base + child] == target:
                    nxt = child
                    break
                child = next_sibling[base + child]
            if nxt < 0 or len(path) > n:
                break
            path.append(nxt)
            cur = nxt
        paths.append(path)
        bonus.append(argmax[base + cur])
    return paths, bonus


def verify_greedy(
    logits: torch.Tensor,
    bitmask: torch.Tensor | None,
    mask_rows: torch.Tensor | None,
    active: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    tokens: torch.Tensor,
    offsets: Sequence[int],
    max_nodes: int,
    vocab_size: int,
) -> VerifyResult:
    """Twin of :func:`espalier.kernels.verify.verify_greedy`: mask, argmax, walk on the host."""
    n = logits.shape[0]
    allowed = node_allowed(logits.shape[1], n, bitmask, mask_rows, vocab_size, logits.device)
    argmax = constrained_argmax(logits, allowed)
    argmax = torch.where(active.bool(), argmax, NO_TOKEN)
    # one declared host sync: the walk runs on lists
    paths, bonus = walk_greedy(
        argmax.tolist(),
        active.bool().tolist(),
        first_child.tolist(),
        next_sibling.tolist(),
        tokens.tolist(),
        list(offsets),
    )
    batch = len(offsets) - 1
    packed = torch.full((batch, 2 + max_nodes), NO_TOKEN, dtype=torch.long)
    for b, p in enumerate(paths):
        packed[b, 0] = len(p) - 1
        packed[b, 1] = bonus[b]
        packed[b, 2 : 2 + len(p)] = torch.tensor(p, dtype=torch.long)
    return VerifyResult(argmax=argmax, packed=packed.to(logits.device))


def processed_probs(
    logits: torch.Tensor,
    allowed: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """float32 ``[R, V]``: the distribution that constrained sampling draws from.

    In order: disallowed tokens dropped; temperature ``<= 0`` means greedy (one-hot at the
    constrained argmax); logits / temperature; top-k (``<= 0`` or ``>= V``: off) keeps tokens
    whose scaled logit is ``>=`` the k-th largest (ties at the boundary kept); softmax; top-p
    (``>= 1``: off) keeps tokens whose probability is ``>=`` the smallest probability of the
    shortest prefix of the sorted distribution whose mass reaches ``top_p``; min-p keeps tokens
    with probability ``>= min_p * max``; renormalise. A row with no allowed token with a finite
    logit is all zeros (samplers return -1 for it). Parameters are per row: float/int ``[R]``.
    """
    rows, vocab = logits.shape
    if rows == 0 or vocab == 0:
        return torch.zeros(rows, vocab, dtype=torch.float32, device=logits.device)
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    x = logits.float().masked_fill(~allowed, float("-inf")) / scale[:, None]
    k = top_k.long()
    k = torch.where((k <= 0) | (k > vocab), vocab, k)
    # the two sorts only where some row asks for them: a sort of every row of a speculative
    # tree (262,144 ids each) took most of a CPU step
    if bool((k < vocab).any()):
        kth = x.sort(dim=1, descending=True).values.gather(1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    row_max = x.max(dim=1, keepdim=True).values
    finite = torch.isfinite(row_max)
    e = torch.exp(x - torch.where(finite, row_max, 0.0)).masked_fill(~finite, 0.0)
    probs = e / e.sum(dim=1, keepdim=True).clamp_min(1e-30)
    mass = top_p.float()
    cut = mass < 1
    if bool(cut.any()):
        srt = probs.sort(dim=1, descending=True).values
        before = srt.cumsum(dim=1) - srt
        n_keep = (before < mass[:, None]).sum(dim=1).clamp(1, vocab)
        kept = probs >= srt.gather(1, (n_keep - 1)[:, None])
        probs = torch.where(kept | ~cut[:, None], probs, 0.0)
    floor = min_p.float()[:, None] * probs.max(dim=1, keepdim=True).values
    probs = torch.where(probs >= floor, probs, 0.0)
    probs = probs / probs.sum(dim=1, keepdim=True).clamp_min(1e-30)
    best = constrained_argmax(logits, allowed)
    onehot = torch.zeros_like(probs)
    onehot.scatter_(1, best.clamp_min(0)[:, None], (best >= 0).float()[:, None])
    return torch.where(greedy[:, None], onehot, probs)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """int64 ``[R]``: inverse-CDF draw from each row of ``probs`` with ``uniforms`` in [0, 1).

    Never returns a zero-probability token; -1 for an all-zero row.
    """
    if probs.shape[1] == 0:
        return torch.full((probs.shape[0],), NO_TOKEN, dtype=torch.long, device=probs.device)
    cdf = probs.double().cumsum(dim=1)
    total = cdf[:, -1:]
    target = uniforms.double()[:, None] * total
    idx = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_max(probs.shape[1] - 1)
    # rounding can land on a trailing zero: step back to the last token with mass
    last = (probs > 0).long().cumsum(dim=1).argmax(dim=1)
    idx = torch.minimum(idx, last)
    return torch.where(total[:, 0] > 0, idx, NO_TOKEN).long()


def tree_sample_oracle(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    active: Sequence[bool],
    first_child: Sequence[int],
    next_sibling: Sequence[int],
    tokens: Sequence[int],
    offsets: Sequence[int],
    uniforms: torch.Tensor,
) -> tuple[list[list[int]], list[int]]:
    """Scalar, per-request recursive rejection sampling (oracle for the vectorised sampler).

    Consumes ``uniforms[b, t]`` for the t-th child visited by request b and ``uniforms[b, -1]``
    for the final draw; see :func:`espalier.kernels.sampling.tree_speculative_sample`.
    """
    paths: list[list[int]] = []
    bonus: list[int] = []
    vocab = target_probs.shape[1]
    for b in range(len(offsets) - 1):
        base = offsets[b]
        p = target_probs[base].double().clone()
        path, child, t = [0], first_child[base], 0
        while child >= 0:
            g = base + child
            x = tokens[g]
            if not active[g] or not 0 <= x < vocab:
                child, t = next_sibling[g], t + 1
                continue
            q = torch.zeros(vocab, dtype=torch.float64)
            if draft_probs is None:
                q[x] = 1.0
            else:
                q = draft_probs[g].double()
            px, qx = float(p[x]), float(q[x])
            if float(uniforms[b, t]) * qx < px:
                path.append(child)
                p = target_probs[g].double().clone()
                child, t = first_child[g], t + 1
                continue
            resid = (p - q).clamp_min(0.0)
            if float(resid.sum()) > 0:
                p = resid / resid.sum()
            child, t = next_sibling[g], t + 1
        paths.append(path)
        bonus.append(int(sample_from_probs(p[None], uniforms[b, -1:])[0]))
    return paths, bonus


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of :func:`espalier.kernels.gemv.gemv`: fp32 products and sums, one rounding.

    x ``[M, K]``, weight ``[N, K]``, bias ``[N]`` or None -> ``[M, N]`` in x's dtype.
    """
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def gated_linear(x: torch.Tensor, gate_up: torch.Tensor, *, gelu: bool) -> torch.Tensor:
    """Twin of :func:`espalier.kernels.gemv.gated_gemv`: ``act(gate) * up`` of ``linear(x,
    gate_up)`` (``[M, 2I]``), each step rounded to x's dtype; act SiLU or tanh-GELU."""
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    act = (
        torch.nn.functional.gelu(gate, approximate="tanh")
        if gelu
        else torch.nn.functional.silu(gate)
    )
    return act * up


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qo_indptr: Sequence[int],
    kv_indptr: Sequence[int],
    kv_indices: Sequence[int],
    kv_lens: Sequence[int],
    *,
    page_size: int,
    scale: float,
    window_left: int = -1,
    mask: tuple[torch.Tensor, Sequence[int]] | None = None,
) -> torch.Tensor:
    """Twin of :func:`espalier.kernels.paged_attention.paged_attention` (its docstring has the
    layout), sequence by sequence in fp32: ``q [T, H, D]`` -> ``[T, H, D]`` in q's dtype.
    ``mask``: (int32 row-aligned words, word offset of each sequence) or None (causal, optional
    window). A row that sees no entry gets zeros."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.zeros_like(q, dtype=torch.float32)
    for b in range(len(kv_lens)):
        lo, hi, kv_len = qo_indptr[b], qo_indptr[b + 1], kv_lens[b]
        q_len = hi - lo
        entries = torch.arange(kv_len)
        pages = torch.tensor(kv_indices[kv_indptr[b] : kv_indptr[b + 1]], dtype=torch.int64)
        slots = pages[entries // page_size] * page_size + entries % page_size
        keys = k[slots].float().repeat_interleave(heads // kv_heads, dim=1)  # [kv, H, D]
        values = v[slots].float().repeat_interleave(heads // kv_heads, dim=1)
        rows = torch.arange(q_len)
        if mask is not None:
            width = -(-kv_len // 32)
            start = int(mask[1][b])
            words = mask[0][start : start + q_len * width].cpu().numpy().astype("<i4")
            row_words = words.reshape(q_len, width)
            unpacked = np.unpackbits(row_words.view(np.uint8), axis=1, bitorder="little")
            seen = torch.from_numpy(unpacked[:, :kv_len].astype(bool))
        else:
            last = kv_len - q_len + rows[:, None]
            seen = entries[None, :] <= last
            if window_left >= 0:
                seen &= entries[None, :] >= last - window_left
        scores = torch.einsum("thd,jhd->htj", q[lo:hi].float(), keys) * scale
        scores = scores.masked_fill(~seen[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[lo:hi] = torch.einsum("htj,jhd->thd", probs, values)
    return out.to(q.dtype)
