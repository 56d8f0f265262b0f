"""Padded graph steps (``engine/model/graph_padding.py``) on the CPU: a step laid out as a captured
shape, with smaller trees, root-only trees, plain decodes and dummy sequences padded in, run
through the model with the small-query wrappers (the kernel's torch twin; the same planning a
CUDA-graph replay does) gives the real rows the logits of the eager SDPA step, writes the same
K/V into their slots and nothing outside them but the scratch block."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from espalier.engine.config import CacheConfig, RunnerConfig
from espalier.engine.kv_cache import KVCache
from espalier.engine.model.attention.base import AttentionMetadata, LayerSpec
from espalier.engine.model.attention.small_query import plan_windows, window_wrappers
from espalier.engine.model.graph_padding import PaddedStep, pad_step, step_tokens
from espalier.engine.model.runner import ModelRunner, SeqInput
from espalier.kernels.paged_attention import Workspace
from tests.fixtures.gpu_models import gpu_config, gpu_state, tree_input

BLOCK = 16
N = 9  # the captured tree size
BUCKET = 6  # 4 sequences + 2 dummy ones
SCRATCH = 31  # the last block: no sequence's table names it
CPU = torch.device("cpu")


@dataclass
class _Wrapped:
    """The backend surface the model calls: ``attend`` through the planned wrappers."""

    name: str = "padded"

    def attend(
        self, spec: LayerSpec, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        wrapper = meta.backend_state[spec.sliding_window]
        out: torch.Tensor = wrapper.run(q, (kv_cache.k[spec.layer], kv_cache.v[spec.layer]))
        return out


def _runner(config: Any, state: dict[str, torch.Tensor]) -> ModelRunner:
    cache = CacheConfig(block_size=BLOCK, num_blocks=SCRATCH + 1)
    return ModelRunner(
        config, state, RunnerConfig(device="cpu", attention_backend="sdpa", cache=cache)
    )


def _windows(runner: ModelRunner) -> list[int | None]:
    config = runner.model_config
    return list({config.window(i): None for i in range(config.num_layers)})


def _padded_forward(runner: ModelRunner, step: PaddedStep) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of ``step.logits_rows``, final hidden states of ``step.rows``): the replay's
    forward, eagerly, with the wrappers planned as ``StepGraphs._plan`` plans them."""
    wrappers = window_wrappers(runner.model_config, _windows(runner), CPU, Workspace.empty(CPU))
    plan_windows(wrappers, step.layout(BLOCK), BLOCK, step.masks)
    total = step.bucket * step.n
    meta = AttentionMetadata(
        token_ids=step.inputs[0],
        positions=step.inputs[1],
        slot_mapping=step.inputs[2],
        q_indptr=list(range(0, total + 1, step.n)),
        context_lens=[0] * step.bucket,
        kv_lens=step.kv_lens,
        block_tables=step.tables,
        positions_list=[],
        custom_masks=[None] * step.bucket,
        logits_rows=torch.arange(total),
        logits_indptr=list(range(0, total + 1, step.n)),
        block_size=BLOCK,
        device=CPU,
        backend_state=wrappers,
    )
    with torch.inference_mode():
        hidden, _ = runner.model(step.inputs[0], step.inputs[1], meta, runner.kv_cache, _Wrapped())
        logits = runner.model.compute_logits(hidden[step.logits_rows])
    return logits, hidden[step.rows]


@pytest.mark.parametrize(("family", "window"), [("llama", None), ("gemma3", 5)])
def test_padded_step_gives_the_eager_logits_and_cache(family: str, window: int | None) -> None:
    config = gpu_config(97, family=family, window=window)
    state = gpu_state(config, seed=3)
    eager, padded = _runner(config, state), _runner(config, state)
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33, 34], [40] * 9]
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(len(prompts))]
    for runner in (eager, padded):
        runner.forward([SeqInput(t, p, 0, logits="none") for t, p in zip(tables, prompts)])
    ctx = [len(p) for p in prompts]
    full = [-1, 0, 0, 0, 1, 1, 3, 4, 6]  # 9 nodes: fills the shape
    small = [-1, 0, 1]  # 3 nodes: 6 dummy rows
    for step in range(3):
        batch = [
            tree_input(tables[0], ctx[0], full, 50 + step),
            tree_input(tables[1], ctx[1], small, 60 + step),
            tree_input(tables[2], ctx[2], [-1], 70 + step),  # a root-only tree
            SeqInput(tables[3], [80 + step], ctx[3]),  # a plain decode sharing the step
        ]
        assert step_tokens(batch) == N
        want = eager.forward(batch, hidden_layers=[config.num_layers])
        layout = pad_step(
            batch, BUCKET, N, block_size=BLOCK, scratch_block=SCRATCH, windows=_windows(padded)
        )
        assert layout.padded == (N - 3) + (N - 1) + (N - 1)
        assert layout.logits_indptr == want.logits_indptr == [0, 9, 12, 13, 14]
        logits, hidden = _padded_forward(padded, layout)
        assert torch.allclose(logits, want.logits, atol=1e-4, rtol=1e-4), step
        assert torch.allclose(hidden, want.hidden_states[config.num_layers], atol=1e-4), step
        for layer in range(config.num_layers):  # the same K/V outside the scratch block
            for got, ref in (
                (padded.kv_cache.k, eager.kv_cache.k),
                (padded.kv_cache.v, eager.kv_cache.v),
            ):
                assert torch.allclose(got[layer][:SCRATCH], ref[layer][:SCRATCH], atol=1e-5)
                assert not torch.equal(got[layer][SCRATCH], ref[layer][SCRATCH])
        ctx = [c + a for c, a in zip(ctx, (3, 2, 1, 1))]  # accepted prefixes, as if compacted


def test_step_tokens_picks_the_shape() -> None:
    tree = tree_input([0], 2, [-1, 0, 1, 1], 5)
    decode = SeqInput([1], [7], 3)
    root_only = tree_input([2], 4, [-1], 9)
    prefill = SeqInput([3], [1, 2, 3], 0)
    assert step_tokens([decode, decode]) == 1
    assert step_tokens([tree, decode]) == 4
    assert step_tokens([root_only, decode]) == 2  # a tree shape (n > 1), not a decode one
    assert step_tokens([tree, prefill]) is None
    assert step_tokens([SeqInput([4], [5], 6, logits="none"), tree]) is None
    assert step_tokens([]) is None
