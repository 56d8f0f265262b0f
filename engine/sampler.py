"""Batched sampling: grammar masks, greedy, temperature, top-k, top-p, min-p, per-request seeds.

One call handles a mixed batch (constrained and unconstrained rows, greedy and sampled rows). The
pipeline per row, in this order (each filter renormalizes what the previous one kept):

1. grammar mask: disallowed tokens get ``-inf`` (rows without a grammar keep an all-ones row);
2. greedy rows (``temperature == 0``): argmax, done;
3. ``logits / temperature``; top-k (keep logits >= the k-th largest; ties at the threshold stay);
   top-p (keep the smallest prefix of the sorted distribution whose mass reaches p; the most likely
   token always stays); min-p (keep tokens with ``p >= min_p * max p``);
4. draw with the row's own ``torch.Generator`` (exponential race ``argmax(p / q)``, ``q ~ Exp(1)``,
   computed as the Gumbel race ``argmax(logits / T - log q)`` over the kept tokens), so a seeded
   request draws the same random stream whatever else shares its batch;
5. certify the draw: logits are batch-variant in their last bits (a CPU GEMM's summation order
   depends on how many rows share it), so a draw whose winner leads the best other candidate by
   less than ``margin`` (in ``logits / T`` units), or whose filters (top-k, top-p, min-p) might
   keep or drop a contender under such a perturbation, is reported in
   :attr:`SamplerOutput.uncertain` with its noise; the caller recomputes that row's logits in a
   canonical way and calls :meth:`Sampler.redraw`. Every other draw is the one the canonical
   logits give, whenever the batch logits stay within ``margin / 2`` of them.

Logprobs (when asked) come from the grammar-masked logits before temperature and truncation:
``log_softmax(masked logits)``, i.e. the model's distribution restricted to what the grammar allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from espalier.engine.api import TokenLogprob

DEFAULT_MARGIN = 1e-3
"""Certification lead of a local draw, in ``logits / temperature`` units (``Sampler``)."""


@dataclass(frozen=True)
class RowParams:
    """Sampling parameters of one batch row (a request's ``SamplingParams`` plus its generator)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    generator: torch.Generator | None = None
    logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class SamplerOutput:
    """token_ids: one sampled id per row (python ints). logprobs: per row, None unless asked.

    uncertain: sampled rows whose draw a ``margin / 2`` perturbation of their logits could change
    -> the row's Gumbel noise (fp32 ``[V]``, ``-log q``), to pass to :meth:`Sampler.redraw`.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    uncertain: dict[int, torch.Tensor] = field(default_factory=dict)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set disallowed logits of ``rows`` to ``-inf`` in place (``espalier.kernels``).

    logits: fp32 ``[B, V]`` (any device). bitmask: int32 ``[B, W]`` per ``constrained/bitmask.py``,
    CPU or the logits' device; row ``r`` of the bitmask masks logits row ``r``; rows not listed
    in ``rows`` are ignored. Ids past ``32 * W`` are disallowed.
    """
    if not rows:
        return
    from espalier.kernels.bitmask import apply_bitmask_

    device = logits.device
    index = torch.tensor(list(rows), dtype=torch.int64, device=device)
    # Triton on CUDA; on CPU the torch twin (the Triton interpreter is for kernel tests only).
    backend: Literal["auto", "torch"] = "auto" if logits.is_cuda else "torch"
    apply_bitmask_(logits, bitmask.to(device, non_blocking=True), index, backend=backend)


class Sampler:
    """Stateless; one instance per engine.

    use_kernels: draw sampled rows with ``espalier.kernels.sampling.sample`` (flashinfer on CUDA,
    the same distribution as tree speculative sampling, one uniform per request and step) instead
    of the local exponential race. ``None``: on CUDA only; on CPU the local path is ~10x faster
    at V = 262,144 (no full-vocabulary sorts when top-k/top-p are off).

    margin: certify local draws (module docstring, step 5) with this lead, in ``logits / T``
    units; 0 = report none. It must exceed twice the largest batch-to-batch difference of
    ``logits / T`` (fp32 rounding: ~1e-6); each draw is uncertain with probability ~``margin``.
    Kernel draws (CUDA) are not certified.
    """

    def __init__(self, use_kernels: bool | None = None, *, margin: float = DEFAULT_MARGIN) -> None:
        self.use_kernels = use_kernels
        self.margin = margin

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[RowParams],
        *,
        bitmask: torch.Tensor | None = None,
        masked_rows: Sequence[int] = (),
    ) -> SamplerOutput:
        """Sample one token per row of ``logits`` (fp32 ``[B, V]``, modified in place)."""
        assert logits.shape[0] == len(params)
        tokens = [0] * len(params)
        chosen: dict[int, int] = {}  # greedy rows decided before masking
        if bitmask is not None and masked_rows:
            if not logits.is_cuda:
                chosen = _allowed_argmax(logits, params, bitmask, masked_rows)
            apply_token_bitmask(logits, bitmask, [r for r in masked_rows if r not in chosen])
        logprobs = self._logprobs(logits, params)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy and i not in chosen]
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        for row, token in chosen.items():
            tokens[row] = token
        if greedy_rows:
            sub = logits if len(greedy_rows) == len(params) else logits[greedy_rows]
            # host sync: the chosen ids go back to python (grammar, detokenizer), once per step
            for row, token in zip(greedy_rows, sub.argmax(dim=-1).tolist()):
                tokens[row] = int(token)
        uncertain: dict[int, torch.Tensor] = {}
        if sampled_rows:
            sub = logits[sampled_rows] if len(sampled_rows) < len(params) else logits
            rows = [params[i] for i in sampled_rows]
            use_kernels = logits.is_cuda if self.use_kernels is None else self.use_kernels
            if use_kernels:
                drawn = _kernel_draw(sub, rows)
            else:
                drawn, unsure = draw(sub, rows, self.margin)
                uncertain = {sampled_rows[j]: noise for j, noise in unsure.items()}
            for row, token in zip(sampled_rows, drawn):
                tokens[row] = token
        return SamplerOutput(tokens, _attach_chosen(logprobs, tokens), uncertain)

    @staticmethod
    def redraw(logits: torch.Tensor, params: RowParams, noise: torch.Tensor) -> int:
        """The draw of one sampled row from canonical ``logits`` (fp32 ``[V]``, grammar-masked)
        with the ``noise`` its batch draw used (:attr:`SamplerOutput.uncertain`)."""
        scaled = logits.unsqueeze(0) / params.temperature
        keep = keep_mask(scaled, [params])
        scores = (scaled + noise.unsqueeze(0)).masked_fill(~keep, float("-inf"))
        return int(scores.argmax(dim=-1).item())

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, params: Sequence[RowParams]
    ) -> list[tuple[torch.Tensor, int] | None]:
        out: list[tuple[torch.Tensor, int] | None] = [None] * len(params)
        rows = [i for i, p in enumerate(params) if p.logprobs > 0]
        if not rows:
            return out
        lp = torch.log_softmax(logits[rows].float(), dim=-1)
        for j, row in enumerate(rows):
            out[row] = (lp[j], params[row].logprobs)
        return out


def _allowed_argmax(
    logits: torch.Tensor,
    params: Sequence[RowParams],
    bitmask: torch.Tensor,
    masked_rows: Sequence[int],
) -> dict[int, int]:
    """Greedy rows (no logprobs) of ``masked_rows`` whose unmasked argmax the mask allows:
    row -> token. Masking such a row cannot change its argmax (the first index of the maximum
    stays the first among allowed ids), so the full-vocabulary mask is skipped for it.
    ``bitmask`` on the CPU; one argmax over the candidate rows."""
    rows = [r for r in masked_rows if params[r].greedy and params[r].logprobs == 0]
    if not rows:
        return {}
    # host sync: candidate ids back to python to test their mask bits (CPU logits: no wait)
    tops = logits[rows].argmax(dim=-1).tolist()
    words = bitmask.shape[1]
    out: dict[int, int] = {}
    for row, token in zip(rows, tops):
        word = token // 32
        if word < words and (int(bitmask[row, word]) >> (token % 32)) & 1:
            out[row] = int(token)
    return out


def processed_probs(logits: torch.Tensor, params: Sequence[RowParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p: fp32 ``[B, V]``, rows sum to 1.

    ``logits``: fp32 ``[B, V]`` (already grammar-masked), not modified.
    """
    scaled = logits / _temperatures(params, logits.device).unsqueeze(1)
    keep = keep_mask(scaled, params)
    return torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)


def keep_mask(scaled: torch.Tensor, params: Sequence[RowParams]) -> torch.Tensor:
    """bool ``[B, V]``: the tokens top-k, top-p and min-p keep (``_keep_sorted``) from ``scaled``
    (fp32 ``[B, V]``, grammar-masked logits / temperature)."""
    if not any(_filtered(p) for p in params):
        return scaled > float("-inf")
    values, order = scaled.sort(dim=-1, descending=True)
    return torch.zeros_like(values, dtype=torch.bool).scatter_(
        1, order, _keep_sorted(values, params, [0.0])[0]
    )


def _filtered(p: RowParams) -> bool:
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0


def _keep_sorted(
    values: torch.Tensor, params: Sequence[RowParams], slacks: Sequence[float]
) -> list[torch.Tensor]:
    """bool ``[B, V]`` per slack, over ``values`` (each row sorted descending): what top-k (keep
    values >= the k-th largest, ties stay), then top-p (the smallest prefix whose mass reaches p;
    the first token always stays), then min-p (``p >= min_p * max p``) keep, each on what the
    previous kept.

    A slack widens (> 0) or narrows (< 0) every threshold: top-k's by it in ``values`` units,
    top-p's by it in probability mass, min-p's by the factor ``1 - slack``; a filter a row does
    not use keeps everything. Widening keeps a superset (more tail lowers every token's mass
    before it), narrowing a subset. Without top-k one softmax serves every slack's top-p.
    """
    device, inf = values.device, float("inf")
    vocab = values.shape[-1]
    finite = values > -inf
    keeps = [finite.clone() for _ in slacks]
    if any(0 < p.top_k < vocab for p in params):
        index = torch.tensor([[min(max(p.top_k, 1), vocab) - 1] for p in params], device=device)
        off = torch.tensor([[not 0 < p.top_k < vocab] for p in params], device=device)
        threshold = values.gather(1, index).masked_fill(off, -inf)
        for keep, slack in zip(keeps, slacks):
            keep &= values >= threshold - slack
    if any(p.top_p < 1.0 for p in params):
        basis, mass_before = None, finite
        for keep, slack in zip(keeps, slacks):
            if basis is None or not torch.equal(keep, basis):
                basis = keep.clone()
                probs = values.masked_fill(~keep, -inf).softmax(dim=-1)
                mass_before = probs.cumsum(dim=-1) - probs
            tops = [[p.top_p + slack if p.top_p < 1.0 else inf] for p in params]
            within = mass_before < torch.tensor(tops, dtype=torch.float32, device=device)
            within[:, 0] = True
            keep &= within
    if any(p.min_p > 0.0 for p in params):
        for keep, slack in zip(keeps, slacks):
            probs = values.masked_fill(~keep, -inf).softmax(dim=-1)
            min_p = torch.tensor([[max(p.min_p * (1.0 - slack), 0.0)] for p in params])
            keep &= probs >= probs[:, :1] * min_p.to(device)
    return keeps


def _temperatures(params: Sequence[RowParams], device: torch.device) -> torch.Tensor:
    return torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)


def draw(
    logits: torch.Tensor, params: Sequence[RowParams], margin: float = 0.0
) -> tuple[list[int], dict[int, torch.Tensor]]:
    """One id per row of ``logits`` (fp32 ``[B, V]``, grammar-masked, sampled rows) by the
    Gumbel race ``argmax(logits / T - log q)`` over the kept tokens, ``q ~ Exp(1)`` drawn from
    the row's generator (V draws per row and step, independent of the logits): the exponential
    race ``argmax(p / q)`` without normalizing ``p``.

    With ``margin > 0``, also the rows whose winner a perturbation of ``logits / T`` below
    ``margin / 2`` could change -> their noise ``-log q`` (fp32 ``[V]``): the winner leads every
    other token the widened filters keep by less than ``margin``, or the narrowed filters drop it.
    """
    scaled = logits / _temperatures(params, logits.device).unsqueeze(1)
    noise = torch.empty_like(scaled)
    for i, p in enumerate(params):
        noise[i].exponential_(generator=p.generator)
    noise.log_().neg_()
    chosen = [0] * len(params)
    unsure: list[int] = []
    plain = [i for i, p in enumerate(params) if not _filtered(p)]
    filtered = [i for i, p in enumerate(params) if _filtered(p)]
    for rows, race in ((plain, _race_plain), (filtered, _race_filtered)):
        if not rows:
            continue
        sub = [params[i] for i in rows]
        if len(rows) == len(params):
            won, flagged = race(scaled, noise, sub, margin)
        else:
            index = torch.tensor(rows, device=scaled.device)
            pair = scaled.index_select(0, index), noise.index_select(0, index)
            won, flagged = race(*pair, sub, margin)
        for row, token in zip(rows, won):
            chosen[row] = token
        unsure += [rows[j] for j in flagged]
    return chosen, {row: noise[row].clone() for row in unsure}


def _race_plain(
    scaled: torch.Tensor, noise: torch.Tensor, params: Sequence[RowParams], margin: float
) -> tuple[list[int], list[int]]:
    """Rows without filters: every allowed token races (masked ones are ``-inf``)."""
    top = (scaled + noise).topk(min(2, scaled.shape[-1]), dim=-1)
    # host sync: sampled ids go back to python once per step
    chosen: list[int] = top.indices[:, 0].tolist()
    if margin <= 0.0 or top.values.shape[-1] < 2:
        return chosen, []
    gaps = top.values[:, 0] - top.values[:, 1]
    return chosen, (gaps < margin).nonzero().flatten().tolist()


def _race_filtered(
    scaled: torch.Tensor, noise: torch.Tensor, params: Sequence[RowParams], margin: float
) -> tuple[list[int], list[int]]:
    """Rows with top-k, top-p or min-p, raced in sorted order (one sort serves the filters at
    all three slacks)."""
    inf = float("inf")
    values, order = scaled.sort(dim=-1, descending=True)
    race = values + noise.gather(1, order)
    slacks = [0.0, margin, -margin] if margin > 0.0 else [0.0]
    keeps = _keep_sorted(values, params, slacks)
    scores = race.masked_fill(~keeps[0], -inf)
    winners = scores.argmax(dim=-1, keepdim=True)  # positions in sorted order
    # host sync: sampled ids go back to python once per step
    chosen: list[int] = order.gather(1, winners).squeeze(1).tolist()
    if margin <= 0.0:
        return chosen, []
    others = race.masked_fill(~keeps[1], -inf)
    others.scatter_(1, winners, -inf)
    unsure = (others.amax(dim=-1, keepdim=True) > scores.gather(1, winners) - margin).squeeze(1)
    unsure |= ~keeps[2].gather(1, winners).squeeze(1)
    return chosen, unsure.nonzero().flatten().tolist()


def _kernel_draw(logits: torch.Tensor, params: Sequence[RowParams]) -> list[int]:
    """Sampled rows through ``espalier.kernels.sampling.sample`` (logits already masked)."""
    from espalier.kernels.sampling import SamplingTensors, sample

    device = logits.device
    tensors = SamplingTensors(
        torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
        torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
        torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
    )
    generators = [p.generator or make_generator(None, device) for p in params]
    # host sync: sampled ids go back to python once per step
    chosen: list[int] = sample(logits, tensors, generators).tolist()
    return chosen


def _attach_chosen(
    logprobs: list[tuple[torch.Tensor, int] | None], tokens: list[int]
) -> list[TokenLogprob | None]:
    out: list[TokenLogprob | None] = []
    for entry, token in zip(logprobs, tokens):
        if entry is None:
            out.append(None)
            continue
        row, n = entry
        values, ids = row.topk(n)
        top = tuple(zip(ids.tolist(), values.tolist()))
        out.append(TokenLogprob(token, float(row[token]), top))
    return out


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's generator: seeded when ``seed`` is given, otherwise from fresh entropy."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
