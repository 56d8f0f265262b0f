"""Nothing is compiled while requests run: after a runner's construction (its attention warm-up
and graph captures) and the verification warm-up, eager steps of new shapes (prefill chunks of
every short length mixed with decodes, batches of every size, draft trees larger than any
captured one) and verifications of new tree sizes build no new Triton variant. Before issue 28
the first such step of a run stalled every stream for 0.7-1.5 s on the H200."""

from __future__ import annotations

import random

import pytest
import torch

from espalier.engine.model.runner import SeqInput
from espalier.kernels import verify
from tests.fixtures.gpu_models import depths, gpu_config, gpu_runner, gpu_state
from tests.fixtures.triton_keys import compiled_variants

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _tree(table: list[int], ctx: int, size: int) -> SeqInput:
    """A chain-and-branches tree of ``size`` nodes over ``ctx`` cached entries."""
    from espalier.engine.spec.tree_builder import tree_attention_mask

    parents = [-1] + [max(0, i - 2) for i in range(1, size)]
    return SeqInput(
        table,
        list(range(1, size + 1)),
        ctx,
        positions=[ctx + d for d in depths(parents)],
        custom_mask=tree_attention_mask(parents, ctx),
        logits="all",
    )


@pytest.mark.parametrize("window", [None, 6])
def test_eager_steps_of_new_shapes_compile_nothing(window: int | None) -> None:
    config = gpu_config(97, window=window)
    runner = gpu_runner(
        config, gpu_state(config, seed=0), backend="flashinfer", graphs=(1, 2, 4), trees=(4,)
    )
    before = compiled_variants()
    assert sum(before.values()) > 0, "the warm-up compiled nothing"
    rng = random.Random(0)
    for _ in range(40):
        batch = []
        for i in range(rng.randint(1, 24)):
            table = list(range(i * 16, (i + 1) * 16))  # 64 entries of 4-token blocks
            ctx = rng.randint(0, 40)
            kind = rng.random()
            if kind < 0.4:  # a (prefix-cache hit's) short prefill chunk
                batch.append(SeqInput(table, [3] * rng.randint(1, 16), ctx, logits="last"))
            elif kind < 0.8:
                batch.append(SeqInput(table, [5], ctx + 1))
            else:
                batch.append(_tree(table, ctx + 1, rng.randint(2, 9)))
        runner.forward(batch)
    torch.cuda.synchronize()
    after = compiled_variants()
    built = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    assert not built, built


def test_verification_of_new_tree_sizes_compiles_nothing() -> None:
    device = torch.device("cuda")
    vocab, words, max_nodes = 1000, 32, 65
    verify.warm_up(device, vocab, words, max_nodes, logits_width=vocab)
    before = compiled_variants()
    rng = random.Random(2)
    for _ in range(30):
        sizes = [rng.randint(1, max_nodes) for _ in range(rng.randint(1, 40))]
        n = sum(sizes)
        chain = torch.cat([torch.arange(s) for s in sizes]).to(device)
        sizes_of = torch.tensor([s for s in sizes for _ in range(s)], device=device)
        offsets = [0]
        for s in sizes:
            offsets.append(offsets[-1] + s)
        flags = torch.ones(n, dtype=torch.bool, device=device)
        bitmask = None
        if rng.random() < 0.5:
            bitmask = torch.full((n, words), -1, dtype=torch.int32, device=device)
        verify.verify_greedy(
            torch.randn(n, vocab, device=device),
            torch.where(chain + 1 < sizes_of, chain + 1, -1),
            torch.full((n,), -1, device=device),
            chain,
            offsets,
            bitmask=bitmask,
            mask_rows=torch.arange(n, device=device),
            valid=flags,
            filled=flags,
            vocab_size=vocab,
        )
    torch.cuda.synchronize()
    assert compiled_variants() == before
