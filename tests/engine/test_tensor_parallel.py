"""Tensor parallelism on CPU (gloo, TP=2): the same greedy tokens as one process, plain,
constrained and speculative; a rank that dies fails the step and every later one.

Real ranks: ``start_tensor_parallel`` spawns rank 1 and rank 0 runs here; the models are the
random-weight loaders of ``tests/fixtures/tensor_parallel.py`` (Llama with 4 KV heads, the
Qwen3 shape).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import (
    ConstraintOptions,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    SpeculativeOptions,
)
from espalier.engine.config import CacheConfig, RunnerConfig
from espalier.engine.engine import Engine, EngineConfig
from espalier.engine.model.parallel import ParallelConfig, TensorParallelError
from espalier.engine.model.parallel.launch import start_tensor_parallel
from espalier.engine.model.parallel.shard import local_config, shard_state_dict
from espalier.engine.model.runner import ModelRunner
from tests.fixtures import tensor_parallel as tp_fixtures
from tests.fixtures.tensor_parallel import run, speculative
from tests.fixtures.tokenizers import build_byte_level_hf

# compile time is not under test: a loaded CI machine may take long for the first compile
ENGINE = EngineConfig(compile_timeout_s=600.0)
CACHE = RunnerConfig(cache=CacheConfig(block_size=4, num_blocks=256))
PARALLEL = ParallelConfig(world_size=2, timeout_s=60.0)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["math", "code"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
Loader = Callable[[], tuple[Any, dict[str, torch.Tensor]]]


def tokenizer(vocab_size: int) -> Any:
    from espalier.constrained.tokenizer import TokenizerInfo

    hf = build_byte_level_hf()
    stop = [hf.convert_tokens_to_ids("<eos>")]
    return TokenizerInfo(hf, vocab_size=vocab_size, stop_token_ids=stop, name="toy-bpe")


def requests() -> list[GenerationRequest]:
    """Plain and constrained (both backends' default and xgrammar), each speculating or not."""
    schema = GrammarSpec.json_schema(SCHEMA)
    # (xgrammar does not enforce the name's maxLength exactly: raw control characters)
    xgr = ConstraintOptions(backend="xgrammar", allow_weakening=True)
    prompts = [(5, 6, 7, 8, 5, 6, 7, 8), (40, 41, 42, 43, 40, 41), (9,) * 12, (70, 71, 72)]
    cases = [
        (prompts[0], None, ConstraintOptions()),
        (prompts[1], schema, ConstraintOptions()),
        (prompts[2], schema, xgr),
        (prompts[3], None, ConstraintOptions()),
        (prompts[2], None, ConstraintOptions()),
    ]
    return [
        GenerationRequest(
            f"r{i}",
            prompt_token_ids=p,
            sampling=SamplingParams(max_tokens=20),
            grammar=g,
            constraint=c,
            speculative=SpeculativeOptions(),
        )
        for i, (p, g, c) in enumerate(cases)
    ]


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Rank 0 and rank 1 share the CI's cores: one torch thread each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def check_same_greedy_tokens(loader: Loader) -> None:
    model_config, state = loader()
    tok = tokenizer(model_config.vocab_size)
    single = ModelRunner(model_config, state, CACHE)
    reference = run(Engine(ENGINE, single, tok), requests())
    runner = start_tensor_parallel(loader, CACHE, PARALLEL)
    try:
        plain = run(Engine(ENGINE, runner, tok), requests())
        spec = run(speculative(Engine(ENGINE, runner, tok)), requests())
    finally:
        runner.close()
    assert len(reference) == len(requests())
    for rid, (tokens, text, out) in reference.items():
        assert out.finish_reason != FinishReason.ERROR, out.error
        assert plain[rid][0] == tokens, rid
        assert spec[rid][0] == tokens, rid
        if rid in ("r1", "r2") and out.finish_reason == FinishReason.STOP:
            assert set(json.loads(text)) == {"name", "age", "tags"}
    drafted = sum(out.speculative.draft_tokens for *_, out in spec.values() if out.speculative)
    assert drafted > 0  # the speculative engine did speculate under TP


def test_llama_kv4_same_greedy_tokens(one_thread: None) -> None:
    check_same_greedy_tokens(tp_fixtures.llama_kv4)


@pytest.mark.slow
def test_qwen3_shape_same_greedy_tokens(one_thread: None) -> None:
    check_same_greedy_tokens(tp_fixtures.qwen3_shape)


def test_killed_rank_fails_the_step_then_every_step(one_thread: None) -> None:
    failures: list[str] = []
    called = threading.Event()

    def on_failure(why: str) -> None:
        failures.append(why)
        called.set()

    model_config, _ = tp_fixtures.llama_kv4()
    runner = start_tensor_parallel(tp_fixtures.llama_kv4, CACHE, PARALLEL, on_failure=on_failure)
    try:
        engine = Engine(ENGINE, runner, tokenizer(model_config.vocab_size))
        request = requests()[0]
        engine.add_request(request)
        engine.step()  # the prefill ran on both ranks
        os.kill(runner.watch.processes[0].pid, signal.SIGKILL)  # type: ignore[arg-type]
        assert called.wait(10.0), "the watch did not see rank 1 die"
        outs = []
        while engine.has_unfinished():
            outs.extend(engine.step())
        assert outs[-1].finish_reason == FinishReason.ERROR
        assert "rank 1" in (outs[-1].error or "")
        assert "rank 1 exited" in failures[0]
        with pytest.raises(TensorParallelError, match="rank 1"):
            runner.forward([])
    finally:
        runner.close()


@pytest.mark.parametrize("loader", [tp_fixtures.llama_kv4, tp_fixtures.qwen3_shape])
def test_shards_partition_the_weights(loader: Loader) -> None:
    """Concatenating the ranks' slices gives back every sharded weight; the rest is replicated."""
    config, state = loader()
    shards = [shard_state_dict(config, state, rank, 2) for rank in range(2)]
    local = local_config(config, 2)
    assert local.num_heads * 2 == config.num_heads
    for name, full in state.items():
        parts = [s[name] for s in shards]
        if "o_proj" in name or "down_proj" in name:
            torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=0)
        elif any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            torch.testing.assert_close(torch.cat(parts), full, rtol=0, atol=0)
        elif "embed_tokens" in name or "lm_head" in name:
            assert parts[0].shape[0] == local.vocab_size
            torch.testing.assert_close(torch.cat(parts)[: full.shape[0]], full, rtol=0, atol=0)
        else:
            assert all(torch.equal(p, full) for p in parts), name


def test_fewer_kv_heads_than_ranks_replicates_the_kv_head_each_rank_reads() -> None:
    """One KV head (Gemma 3 270M) over 2 ranks: both keep it; 2 KV heads over 4 ranks: ranks
    0-1 keep head 0, ranks 2-3 head 1 (the head their query heads read)."""
    config, state = tp_fixtures.qwen3_shape()  # 8 query heads, 2 KV heads of 32
    k = state["model.layers.0.self_attn.k_proj.weight"]
    for rank in range(4):
        got = shard_state_dict(config, state, rank, 4)["model.layers.0.self_attn.k_proj.weight"]
        head = rank // 2
        assert torch.equal(got, k[head * 32 : (head + 1) * 32])
    assert local_config(config, 4).num_kv_heads == 1


@pytest.mark.parametrize("world", [3, 16])
def test_unshardable_model_is_refused_with_the_reason(world: int) -> None:
    config, _ = tp_fixtures.llama_kv4()
    with pytest.raises(ValueError, match=f"--tensor-parallel {world} does not divide"):
        local_config(config, world)


@pytest.mark.slow
def test_a_rank_that_cannot_load_fails_start_up_with_its_reason(one_thread: None) -> None:
    loader = tp_fixtures.llama_kv4_unreadable_in_workers
    with pytest.raises(TensorParallelError, match="rank 1 did not start: OSError: no checkpoint"):
        start_tensor_parallel(loader, CACHE, PARALLEL)
