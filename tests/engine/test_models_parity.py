"""Logit parity of our models + paged SDPA attention against transformers (eager attention).

Tiny random-weight models (tests/fixtures/tiny_models.py) are saved as safetensors, loaded through
our loader, and run through the paged cache: whole prefills, chunked prefills mixed with decodes
across several sequences of different lengths (sliding windows of 6 are crossed), and draft trees
with custom masks (each node checked against a plain forward over its root-to-node path).
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from espalier.engine.config import CacheConfig, RunnerConfig
from espalier.engine.kv_cache import BlockAllocator, blocks_needed
from espalier.engine.model.runner import ModelRunner, SeqInput
from tests.fixtures.tiny_models import KINDS, VOCAB, make_tiny_model

BLOCK = 4

DEVICES = [
    pytest.param("cpu", "float32", id="cpu-fp32"),
    pytest.param("cpu", "bfloat16", id="cpu-bf16"),
    pytest.param("cuda", "bfloat16", id="cuda-bf16", marks=pytest.mark.gpu),
]


def tolerance(dtype: str) -> dict[str, float]:
    return {"rtol": 1e-4, "atol": 1e-4} if dtype == "float32" else {"rtol": 0.05, "atol": 0.15}


@pytest.fixture(scope="module", params=KINDS)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, make_tiny_model(request.param, directory)


def make_runner(directory: Path, device: str, dtype: str) -> ModelRunner:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    config = RunnerConfig(
        device=device, dtype=dtype, cache=CacheConfig(block_size=BLOCK, num_blocks=96)
    )
    return ModelRunner.from_pretrained(directory, config)


def reference_logits(model: Any, token_ids: list[int], dtype: str) -> torch.Tensor:
    """fp32 [len, V] logits of the transformers model over the whole sequence."""
    ref = model if dtype == "float32" else copy.deepcopy(model).to(getattr(torch, dtype))
    with torch.no_grad():
        return ref(torch.tensor([token_ids])).logits[0].float()


class PagedSeq:
    """A sequence's tokens and blocks, grown step by step through a shared allocator."""

    def __init__(self, tokens: list[int], allocator: BlockAllocator) -> None:
        self.tokens = tokens
        self.cached = 0
        self.blocks: list[int] = []
        self.allocator = allocator

    def step(self, n: int, *, logits: str = "all") -> SeqInput:
        need = max(0, blocks_needed(self.cached + n, BLOCK) - len(self.blocks))
        self.blocks += self.allocator.allocate(need)
        seq = SeqInput(
            block_table=list(self.blocks),
            token_ids=self.tokens[self.cached : self.cached + n],
            context_len=self.cached,
            logits=logits,  # type: ignore[arg-type]
        )
        self.cached += n
        return seq


def scrambled_allocator(num_blocks: int = 96) -> BlockAllocator:
    """An allocator whose free list is shuffled, so block tables are far from contiguous."""
    allocator = BlockAllocator(num_blocks)
    blocks = allocator.allocate(num_blocks)
    random.Random(1).shuffle(blocks)
    allocator.free(blocks)
    return allocator


@pytest.mark.parametrize(("device", "dtype"), DEVICES)
def test_prefill_matches_transformers(tiny: Any, device: str, dtype: str) -> None:
    _kind, directory, model = tiny
    runner = make_runner(directory, device, dtype)
    tokens = random.Random(0).choices(range(VOCAB), k=17)
    out = runner.forward([SeqInput(block_table=list(range(5)), token_ids=tokens, logits="all")])
    assert out.logits.dtype == torch.float32 and out.logits.shape == (17, VOCAB)
    assert out.logits_indptr == [0, 17]
    expected = reference_logits(model, tokens, dtype)
    torch.testing.assert_close(out.logits.cpu(), expected, **tolerance(dtype))


@pytest.mark.parametrize(("device", "dtype"), DEVICES)
def test_chunked_prefill_and_decode_batched(tiny: Any, device: str, dtype: str) -> None:
    """Three sequences (13, 7, 19 prompt tokens, then 4 decodes) share the steps; 0 = absent."""
    _kind, directory, model = tiny
    runner = make_runner(directory, device, dtype)
    rng = random.Random(2)
    allocator = scrambled_allocator()
    seqs = [PagedSeq(rng.choices(range(VOCAB), k=n + 4), allocator) for n in (13, 7, 19)]
    plan = [(5, 7, 8), (8, 1, 6), (1, 1, 5), (1, 1, 1), (1, 1, 1), (1, 0, 1), (0, 0, 1)]
    got: list[list[torch.Tensor]] = [[], [], []]
    for chunk_sizes in plan:
        members = [b for b in range(3) if chunk_sizes[b]]
        out = runner.forward([seqs[b].step(chunk_sizes[b]) for b in members])
        for i, b in enumerate(members):
            got[b].append(out.logits[out.logits_indptr[i] : out.logits_indptr[i + 1]].cpu())
    for b, seq in enumerate(seqs):
        assert seq.cached == len(seq.tokens)
        expected = reference_logits(model, seq.tokens, dtype)
        torch.testing.assert_close(torch.cat(got[b]), expected, **tolerance(dtype))


def test_last_logits_default_and_none(tiny: Any) -> None:
    _kind, directory, model = tiny
    runner = make_runner(directory, "cpu", "float32")
    allocator = scrambled_allocator()
    a = PagedSeq(random.Random(3).choices(range(VOCAB), k=9), allocator)
    b = PagedSeq(random.Random(4).choices(range(VOCAB), k=5), allocator)
    out = runner.forward([a.step(9, logits="last"), b.step(5, logits="none")])
    assert out.logits.shape == (1, VOCAB) and out.logits_indptr == [0, 1, 1]
    expected = reference_logits(model, a.tokens, "float32")[-1:]
    torch.testing.assert_close(out.logits, expected, rtol=1e-4, atol=1e-4)


# A draft tree hanging off the last context token (node: parent), drawn root-first:
#
#   ctx ─ 0 ─┬─ 1 ─┬─ 3
#            │     └─ 4
#            └─ 2 ─── 5 ─── 6
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 5]


def tree_path(node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = TREE_PARENTS[node]
    return path[::-1]


@pytest.mark.parametrize(("device", "dtype"), DEVICES)
def test_tree_with_custom_mask(tiny: Any, device: str, dtype: str) -> None:
    """Each tree node's logits == a plain forward over context + its root-to-node path."""
    _kind, directory, model = tiny
    runner = make_runner(directory, device, dtype)
    rng = random.Random(5)
    allocator = scrambled_allocator()
    context = PagedSeq(rng.choices(range(VOCAB), k=9), allocator)
    other = PagedSeq(rng.choices(range(VOCAB), k=12), allocator)
    runner.forward([context.step(9), other.step(11)])
    tree_tokens = rng.choices(range(VOCAB), k=len(TREE_PARENTS))
    n, ctx = len(TREE_PARENTS), context.cached
    mask = torch.zeros(n, ctx + n, dtype=torch.bool)
    mask[:, :ctx] = True
    for node in range(n):
        mask[node, [ctx + a for a in tree_path(node)]] = True
    context.blocks += allocator.allocate(blocks_needed(ctx + n, BLOCK) - len(context.blocks))
    tree = SeqInput(
        block_table=list(context.blocks),
        token_ids=tree_tokens,
        context_len=ctx,
        positions=[ctx + len(tree_path(node)) - 1 for node in range(n)],
        custom_mask=mask,
        logits="all",
    )
    out = runner.forward([other.step(1), tree])
    tree_logits = out.logits[out.logits_indptr[1] : out.logits_indptr[2]].cpu()
    for node in range(n):
        path_tokens = context.tokens + [tree_tokens[a] for a in tree_path(node)]
        expected = reference_logits(model, path_tokens, dtype)[-1]
        torch.testing.assert_close(tree_logits[node], expected, **tolerance(dtype))
    expected_other = reference_logits(model, other.tokens, dtype)[-1]
    torch.testing.assert_close(out.logits[0].cpu(), expected_other, **tolerance(dtype))


def test_hidden_states_capture(tiny: Any) -> None:
    _kind, directory, model = tiny
    runner = make_runner(directory, "cpu", "float32")
    tokens = random.Random(6).choices(range(VOCAB), k=8)
    layers = runner.model_config.num_layers
    out = runner.forward(
        [SeqInput(block_table=[0, 1], token_ids=tokens, logits="all")],
        hidden_layers=(0, layers),
    )
    with torch.no_grad():
        ref = model(torch.tensor([tokens]), output_hidden_states=True)
    torch.testing.assert_close(out.hidden_states[0], ref.hidden_states[1][0], rtol=1e-4, atol=1e-4)
    final = out.hidden_states[layers]
    assert final.shape == (8, runner.model_config.hidden_size)
    torch.testing.assert_close(runner.model.compute_logits(final), out.logits)


def test_copy_slots_compacts_accepted_tree_nodes(tiny: Any) -> None:
    """After verifying a tree, copying the accepted path's K/V into place continues exactly."""
    _kind, directory, model = tiny
    runner = make_runner(directory, "cpu", "float32")
    rng = random.Random(7)
    allocator = scrambled_allocator()
    seq = PagedSeq(rng.choices(range(VOCAB), k=6), allocator)
    runner.forward([seq.step(6)])
    tree_tokens = rng.choices(range(VOCAB), k=len(TREE_PARENTS))
    n, ctx = len(TREE_PARENTS), seq.cached
    mask = torch.zeros(n, ctx + n, dtype=torch.bool)
    mask[:, :ctx] = True
    for node in range(n):
        mask[node, [ctx + a for a in tree_path(node)]] = True
    seq.blocks += allocator.allocate(blocks_needed(ctx + n, BLOCK) - len(seq.blocks))
    runner.forward(
        [
            SeqInput(
                block_table=list(seq.blocks),
                token_ids=tree_tokens,
                context_len=ctx,
                positions=[ctx + len(tree_path(node)) - 1 for node in range(n)],
                custom_mask=mask,
            )
        ]
    )
    accepted = tree_path(6)  # nodes 0, 2, 5, 6 -> cache indices ctx + 0, 1, 2, 3

    def slot(i: int) -> int:
        return seq.blocks[i // BLOCK] * BLOCK + i % BLOCK

    runner.copy_slots([slot(ctx + a) for a in accepted], [slot(ctx + i) for i in range(4)])
    seq.tokens += [tree_tokens[a] for a in accepted] + [rng.randrange(VOCAB)]
    seq.cached += len(accepted)
    out = runner.forward([seq.step(1)])
    expected = reference_logits(model, seq.tokens, "float32")[-1]
    torch.testing.assert_close(out.logits[0], expected, rtol=1e-4, atol=1e-4)


def test_batched_steps_equal_each_sequence_alone(tiny: Any) -> None:
    """Oracle for grouping/padding: 8 sequences with random chunk sizes (decodes, prefill chunks
    and skipped steps mixed) give the same logits batched as when each runs alone."""
    _kind, directory, _model = tiny
    batched, alone = (make_runner(directory, "cpu", "float32") for _ in range(2))
    rng = random.Random(8)
    allocator = scrambled_allocator()
    seqs = [PagedSeq(rng.choices(range(VOCAB), k=rng.randint(1, 30)), allocator) for _ in range(8)]
    while any(s.cached < len(s.tokens) for s in seqs):
        steps: list[SeqInput] = []
        for seq in seqs:
            left = len(seq.tokens) - seq.cached
            if left and rng.random() < 0.8:
                n = rng.choice([1, 1, 2, rng.randint(1, 8)])
                steps.append(seq.step(min(n, left)))
        if not steps:
            continue
        out = batched.forward(steps)
        for i, step in enumerate(steps):
            single = alone.forward([step])
            rows = out.logits[out.logits_indptr[i] : out.logits_indptr[i + 1]]
            torch.testing.assert_close(rows, single.logits, rtol=1e-5, atol=1e-5)
