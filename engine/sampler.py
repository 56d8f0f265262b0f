"""Batched sampling: grammar masks, greedy, temperature, top-k, top-p, min-p, per-request seeds.

One call handles a mixed batch (constrained and unconstrained rows, greedy and sampled rows). The
pipeline per row, in this order (each filter renormalizes what the previous one kept):

1. grammar mask: disallowed tokens get ``-inf`` (rows without a grammar keep an all-ones row);
2. greedy rows (``temperature == 0``): argmax, done;
3. ``logits / temperature``; top-k (keep logits >= the k-th largest; ties at the threshold stay);
   top-p (keep the smallest prefix of the sorted distribution whose mass reaches p; the most likely
   token always stays); min-p (keep tokens with ``p >= min_p * max p``);
4. draw with the row's own ``torch.Generator`` (exponential race: ``argmax(p / q)``,
   ``q ~ Exp(1)``), so a seeded request draws the same random stream whatever else shares its batch.

Logprobs (when asked) come from the grammar-masked logits before temperature and truncation:
``log_softmax(masked logits)``, i.e. the model's distribution restricted to what the grammar allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from espalier.engine.api import TokenLogprob


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
    """token_ids: one sampled id per row (python ints). logprobs: per row, None unless asked."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


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
    """

    def __init__(self, use_kernels: bool | None = None) -> None:
        self.use_kernels = use_kernels

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
        if sampled_rows:
            sub = logits[sampled_rows] if len(sampled_rows) < len(params) else logits
            rows = [params[i] for i in sampled_rows]
            use_kernels = logits.is_cuda if self.use_kernels is None else self.use_kernels
            drawn = (
                _kernel_draw(sub, rows)
                if use_kernels
                else draw(processed_probs(sub, rows), [p.generator for p in rows])
            )
            for row, token in zip(sampled_rows, drawn):
                tokens[row] = token
        return SamplerOutput(tokens, _attach_chosen(logprobs, tokens))

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
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    scaled = logits / temps.unsqueeze(1)
    if any(p.top_k > 0 for p in params):
        scaled = _top_k(scaled, [p.top_k for p in params])
    if any(p.top_p < 1.0 for p in params):
        scaled = _top_p(scaled, [p.top_p for p in params])
    probs = torch.softmax(scaled, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    k_eff = [k if 0 < k < vocab else vocab for k in ks]
    kmax = max(k_eff)
    top = logits.topk(kmax, dim=-1).values  # [B, kmax], descending
    index = torch.tensor([k - 1 for k in k_eff], device=logits.device).unsqueeze(1)
    threshold = top.gather(1, index)
    return logits.masked_fill(logits < threshold, float("-inf"))


def _top_p(logits: torch.Tensor, ps: list[float]) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    p = torch.tensor(ps, dtype=torch.float32, device=logits.device).unsqueeze(1)
    drop_sorted = mass_before >= p
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> list[int]:
    """One id per row by the exponential race ``argmax(p / q)``, ``q ~ Exp(1)`` drawn from the row's
    generator (V draws per row and step, independent of ``p``)."""
    q = torch.empty_like(probs)
    for i, gen in enumerate(generators):
        q[i].exponential_(generator=gen)
    # host sync: sampled ids go back to python once per step
    chosen: list[int] = (probs / q).argmax(dim=-1).tolist()
    return chosen


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
