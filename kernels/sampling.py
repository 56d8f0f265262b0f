"""Constrained sampling: plain decoding and lossless speculative sampling over draft trees.

The distribution sampled is always :func:`espalier.kernels.reference.processed_probs` of the
masked logits (mask, temperature, top-k, top-p, min-p, in that order; temperature 0 = greedy).
Rows that allow no token yield -1 (never NaN, never a disallowed token).

Tree speculative sampling (:func:`tree_speculative_sample`) is the recursive rejection sampling of
SpecInfer (Miao et al., ASPLOS 2024, "multi-step speculative sampling", Algorithm 2) in the form
used by Sequoia (Chen et al., 2024) for drafts drawn without replacement. At a node with target
distribution ``p`` and children ``c_1, c_2, ...`` (sibling order) whose tokens ``x_i`` were drawn
from draft distributions ``q_i`` (``q_i`` may depend on ``x_1 .. x_{i-1}``; deterministic top-k
drafts have ``q_i = onehot(x_i)``):

    for i = 1, 2, ...: accept x_i with probability min(1, p(x_i) / q_i(x_i));
        on accept: emit x_i, move to c_i (p = target at c_i), restart with its children;
        on reject: p = normalise(max(p - q_i, 0)).
    when no child is left: emit one token drawn from p (the bonus token).

By induction over the siblings each step outputs an exact draw from the current ``p`` (accept mass
``min(p, q_i)`` plus reject mass times the normalised residual equals ``p``), so the emitted tokens
follow plain constrained sampling from the target exactly. A child that is not valid or not filled
(its mask row is unknown) is skipped without touching ``p``; that choice depends only on the tree,
never on the random draws, so the output stays exact (only acceptance drops).

Randomness: per-request ``torch.Generator`` s (reproducible per request, whatever the batch) or one
generator for the batch. The vectorised sampler runs torch ops over the batch, one iteration per
visited child (a host check per iteration), on CPU or GPU.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from espalier.kernels import reference
from espalier.kernels._dispatch import Backend
from espalier.kernels.bitmask import apply_bitmask_
from espalier.kernels.reference import NO_TOKEN

Generators = Sequence[torch.Generator] | torch.Generator | None


@dataclass(frozen=True)
class SamplingTensors:
    """Per-request sampling parameters, each ``[B]`` on the logits' device.

    temperature: float (<= 0: greedy). top_k: int (<= 0: off). top_p: float (>= 1: off).
    min_p: float (0: off).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor

    @staticmethod
    def build(
        batch: int,
        device: torch.device | str = "cpu",
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
    ) -> SamplingTensors:
        """The same parameters for every request of a batch."""
        return SamplingTensors(
            torch.full((batch,), temperature, dtype=torch.float32, device=device),
            torch.full((batch,), top_k, dtype=torch.int64, device=device),
            torch.full((batch,), top_p, dtype=torch.float32, device=device),
            torch.full((batch,), min_p, dtype=torch.float32, device=device),
        )

    def take(self, index: torch.Tensor) -> SamplingTensors:
        """Parameters of rows ``index`` (e.g. each tree node's request)."""
        return SamplingTensors(
            self.temperature[index], self.top_k[index], self.top_p[index], self.min_p[index]
        )


def uniforms(
    generators: Generators,
    batch: int,
    count: int,
    device: torch.device,
    own: Sequence[int] | None = None,
) -> torch.Tensor:
    """float64 ``[batch, count]`` in [0, 1): row b from ``generators[b]`` when a list is given.

    own: with a list, row b draws only ``own[b] + 1`` numbers from its generator, into columns
    ``0 .. own[b] - 1`` and the last (the rest hold 0.5, never read): how far a request's
    stream moves then depends on its own tree, not on the batch's largest (a seeded request's
    tokens must not depend on what shares its step; a root-only tree draws one, as
    :func:`sample` does)."""
    if isinstance(generators, Sequence):
        if len(generators) != batch:
            raise ValueError(f"{len(generators)} generators for {batch} requests")
        if own is None:
            rows = [
                torch.rand(count, generator=g, dtype=torch.float64, device=g.device)
                for g in generators
            ]
        else:
            rows = []
            for g, k in zip(generators, own):
                drawn = torch.rand(k + 1, generator=g, dtype=torch.float64, device=g.device)
                row = torch.full((count,), 0.5, dtype=torch.float64, device=g.device)
                row[:k] = drawn[:k]
                row[-1] = drawn[k]
                rows.append(row)
        return torch.stack(rows).to(device) if rows else torch.empty(0, count, device=device)
    return torch.rand(batch, count, generator=generators, dtype=torch.float64, device=device)


def _allowed(
    logits: torch.Tensor, bitmask: torch.Tensor | None, mask_rows: torch.Tensor | None
) -> torch.Tensor:
    n, vocab = logits.shape
    return reference.node_allowed(vocab, n, bitmask, mask_rows, vocab, logits.device)


def _flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def sample(
    logits: torch.Tensor,
    params: SamplingTensors,
    generators: Generators = None,
    *,
    bitmask: torch.Tensor | None = None,
    mask_rows: torch.Tensor | None = None,
    backend: Backend | str = "auto",
) -> torch.Tensor:
    """int64 ``[B]``: one token per row of ``logits`` ``[B, V]`` from its processed distribution.

    bitmask: int32 ``[M, W]`` (layout of :mod:`espalier.kernels.bitmask`); ``mask_rows`` ``[B]``
    picks row per request (-1: unconstrained; default row b). The final draw is an inverse-CDF
    draw with one uniform per request from its generator, so a request's token depends only on its
    own generator. ``backend``: "flashinfer" (CUDA; its softmax and top-k/top-p renorm kernels),
    "torch", or "auto" (flashinfer on CUDA when installed). ``logits`` are not modified.
    """
    batch = logits.shape[0]
    if batch == 0:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    use_fi = backend == "flashinfer" or (
        backend == "auto" and logits.is_cuda and _flashinfer_available()
    )
    if use_fi:
        probs = _flashinfer_probs(logits, params, bitmask, mask_rows)
    else:
        allowed = _allowed(logits, bitmask, mask_rows)
        probs = reference.processed_probs(
            logits, allowed, params.temperature, params.top_k, params.top_p, params.min_p
        )
    u = uniforms(generators, batch, 1, logits.device)[:, 0]
    return reference.sample_from_probs(probs, u)


def _flashinfer_probs(
    logits: torch.Tensor,
    params: SamplingTensors,
    bitmask: torch.Tensor | None,
    mask_rows: torch.Tensor | None,
) -> torch.Tensor:
    """Processed distribution through flashinfer's kernels (mask applied by our Triton kernel)."""
    import flashinfer.sampling as fis

    batch, vocab = logits.shape
    x = logits.float().clone()
    if bitmask is not None:
        rows = torch.arange(batch, device=x.device)
        src = rows if mask_rows is None else mask_rows.long()
        gathered = bitmask[src.clamp_min(0)]
        constrained = rows[src >= 0]
        apply_bitmask_(x, gathered, constrained)
    greedy = params.temperature <= 0
    temp = torch.where(greedy, torch.ones_like(params.temperature), params.temperature).float()
    dead = ~torch.isfinite(x.max(dim=1).values)
    x = x.masked_fill(dead[:, None], 0.0)
    probs = fis.softmax(x, temperature=temp)
    top_k = params.top_k.to(torch.int32)
    top_k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    probs = fis.top_k_renorm_probs(probs, top_k)
    probs = fis.top_p_renorm_probs(probs, params.top_p.float().clamp(0.0, 1.0))
    floor = params.min_p.float()[:, None] * probs.max(dim=1, keepdim=True).values
    probs = torch.where(probs >= floor, probs, 0.0)
    probs = probs / probs.sum(dim=1, keepdim=True).clamp_min(1e-30)
    best = torch.where(dead, NO_TOKEN, x.argmax(dim=1))
    onehot = torch.zeros_like(probs)
    onehot.scatter_(1, best.clamp_min(0)[:, None], (best >= 0).float()[:, None])
    probs = torch.where(greedy[:, None], onehot, probs)
    return probs.masked_fill(dead[:, None], 0.0)


@dataclass(frozen=True)
class TreeSample:
    """Result of tree speculative sampling (int64, on the logits' device).

    path: ``[B, max_nodes]`` accepted local node ids, root first, -1 padded.
    accept_length: ``[B]`` accepted draft tokens. bonus_token: ``[B]`` the final draw (-1 if the
    last node's distribution is empty). Emitted tokens: the accepted nodes' tokens, then the bonus.
    """

    path: torch.Tensor
    accept_length: torch.Tensor
    bonus_token: torch.Tensor


def tree_speculative_sample(
    logits: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    tokens: torch.Tensor,
    offsets: Sequence[int],
    params: SamplingTensors,
    generators: Generators = None,
    *,
    draft_probs: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
    mask_rows: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    filled: torch.Tensor | None = None,
) -> TreeSample:
    """Lossless speculative sampling over ``B`` draft trees (algorithm in the module docstring).

    logits: float ``[N, V]``, one target row per node; tree tensors int64 ``[N]`` (DraftTree
    encoding, local ids); offsets: ``B + 1`` host ints. params: per request ``[B]``.
    draft_probs: float ``[N, V]``, row i = the distribution node i's token was drawn from (given its
    earlier siblings); None = deterministic drafts (one-hot). bitmask / mask_rows / valid / filled
    as in :func:`espalier.kernels.verify.verify_greedy`. Uniforms: request b uses column t for its
    t-th visited child and the last column for the bonus draw.
    """
    dev = logits.device
    n, vocab = logits.shape
    batch = len(offsets) - 1
    sizes = [offsets[i + 1] - offsets[i] for i in range(batch)]
    max_nodes = max(sizes, default=0)
    if batch == 0:
        empty = torch.empty(0, dtype=torch.long, device=dev)
        return TreeSample(empty.view(0, 0), empty, empty)
    request = torch.repeat_interleave(
        torch.arange(batch, device=dev), torch.tensor(sizes, device=dev)
    )
    allowed = _allowed(logits, bitmask, mask_rows)
    node_params = params.take(request)
    target = reference.processed_probs(
        logits, allowed, node_params.temperature, node_params.top_k, node_params.top_p,
        node_params.min_p,
    ).double()  # fmt: skip
    active = torch.ones(n, dtype=torch.bool, device=dev)
    for flags in (valid, filled):
        if flags is not None:
            active = active & flags.bool()
    base = torch.tensor(list(offsets[:-1]), dtype=torch.long, device=dev)
    u = uniforms(generators, batch, max_nodes + 1, dev, own=[s - 1 for s in sizes])
    rows = torch.arange(batch, device=dev)
    p = target[base]
    child = torch.where(first_child[base] >= 0, base + first_child[base], -1)
    path = torch.full((batch, max_nodes), NO_TOKEN, dtype=torch.long, device=dev)
    path[:, 0] = 0
    length = torch.zeros(batch, dtype=torch.long, device=dev)
    for step in range(max_nodes):
        has = child >= 0
        if not bool(has.any()):  # host check once per visited-child step
            break
        g = child.clamp_min(0)
        x = tokens[g].clamp(0, vocab - 1)
        in_vocab = (tokens[g] >= 0) & (tokens[g] < vocab)
        eligible = has & active[g] & in_vocab
        if draft_probs is None:
            q = torch.zeros_like(p).scatter_(1, x[:, None], 1.0)
        else:
            q = draft_probs[g].double()
        px = p.gather(1, x[:, None])[:, 0]
        qx = q.gather(1, x[:, None])[:, 0]
        accept = eligible & (u[:, step] * qx < px)
        reject = eligible & ~accept
        resid = (p - q).clamp_min(0.0)
        mass = resid.sum(dim=1, keepdim=True)
        p = torch.where((reject[:, None]) & (mass > 0), resid / mass.clamp_min(1e-300), p)
        p = torch.where(accept[:, None], target[g], p)
        length = length + accept.long()
        local = g - base
        path[rows, length] = torch.where(accept, local, path[rows, length])
        down = torch.where(first_child[g] >= 0, base + first_child[g], -1)
        across = torch.where(next_sibling[g] >= 0, base + next_sibling[g], -1)
        child = torch.where(accept, down, torch.where(has, across, child))
    bonus = reference.sample_from_probs(p, u[:, -1])
    return TreeSample(path=path, accept_length=length, bonus_token=bonus)
