"""The layers that talk to the other ranks, swapped into a model built from a rank's shard.

``parallelize`` replaces, in a model whose config and weights came from ``shard.py``:
every ``o_proj`` and ``down_proj`` with a ``RowParallelLinear`` (all-reduce of the partial
sums), ``model.embed_tokens`` with a ``VocabParallelEmbedding``, and sets the model's
``vocab_gather`` so ``compute_logits`` returns full-vocabulary logits on every rank.
Column-parallel projections need nothing: each rank's q/k/v/gate/up are ordinary linears of its
heads and MLP slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from espalier.engine.model.models.base import CausalLM
from espalier.engine.model.models.layers import Linear
from espalier.engine.model.parallel.group import RankGroup


class RowParallelLinear(Linear):
    """``Linear`` over this rank's input columns, then the sum over ranks (all-reduce).

    x: ``[T, in / world]`` -> ``[T, out]``, identical on every rank. A bias lives on rank 0
    only (``shard.py``), so the sum adds it once."""

    group: RankGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + Vp)`` of the embedding; ids elsewhere give zeros, and the sum over
    ranks (all-reduce) is the full lookup. ``weight [Vp, hidden]`` is also the tied LM head's
    slice. int64 ``ids [T]`` -> ``[T, hidden]`` in the weight dtype, on every rank."""

    def __init__(self, weight: torch.Tensor, start: int, group: RankGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))


class VocabGather:
    """Logits of this rank's vocabulary slice ``[n, Vp]`` -> all ranks' ``[n, vocab_size]``
    (the padding of the last slice cut off); same dtype and device."""

    def __init__(self, group: RankGroup, vocab_size: int) -> None:
        self.group = group
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_rows(logits)[:, : self.vocab_size]


def parallelize(model: CausalLM, group: RankGroup, vocab_size: int) -> None:
    """Swap the communicating layers into ``model`` (built from rank ``group.rank``'s shard of
    a model of ``vocab_size`` tokens); its parameters are kept, not copied."""
    for module in list(model.modules()):
        for name in ("o_proj", "down_proj"):
            old = getattr(module, name, None)
            if isinstance(old, Linear) and not isinstance(old, RowParallelLinear):
                setattr(module, name, _row_parallel(old, group))
    embed = model.model.embed_tokens
    start = group.rank * embed.weight.shape[0]
    model.model.embed_tokens = VocabParallelEmbedding(embed.weight, start, group)  # type: ignore[assignment]
    model.vocab_gather = VocabGather(group, vocab_size)


def _row_parallel(old: Linear, group: RankGroup) -> RowParallelLinear:
    with torch.device("meta"):
        new = RowParallelLinear(old.in_features, old.out_features, bias=old.bias is not None)
    new.weight = old.weight
    new.bias = old.bias
    new.options = old.options
    new.group = group
    return new
