"""The embedded Gemma 3 270M (4 query heads over 1 KV head, replicated on both ranks) at TP=2 on
CPU (gloo): the same greedy tokens as one process, plain, constrained and speculative."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import FinishReason, GenerationRequest, SamplingParams
from espalier.engine.config import CacheConfig, RunnerConfig
from espalier.engine.engine import Engine, EngineConfig
from espalier.engine.model.parallel import ParallelConfig
from espalier.engine.model.parallel.launch import start_tensor_parallel
from espalier.engine.model.runner import ModelRunner
from espalier.engine.model.weights import load_weights
from espalier.server.default_model import default_gguf
from tests.fixtures.tensor_parallel import run, speculative

pytestmark = [pytest.mark.model, pytest.mark.slow]

# compile time is not under test: a loaded CI machine may take long for the first compile
ENGINE = EngineConfig(compile_timeout_s=600.0)
CONFIG = RunnerConfig(cache=CacheConfig(num_blocks=64))
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


def requests(tokenizer: Any) -> list[GenerationRequest]:
    bos = tokenizer.hf.bos_token_id
    cases = [
        ("The capital of France is", None),
        ("The weather in Paris as JSON:", GrammarSpec.json_schema(SCHEMA)),
        ("Count: 1, 2, 3,", GrammarSpec.regex(r"( [0-9]{1,2},){3}")),
    ]
    return [
        GenerationRequest(
            f"g{i}",
            prompt_token_ids=[bos, *tokenizer.encode(text)],
            sampling=SamplingParams(max_tokens=12),
            grammar=grammar,
        )
        for i, (text, grammar) in enumerate(cases)
    ]


def test_default_model_same_greedy_tokens(gemma_tokenizer: Any) -> None:
    loader = functools.partial(load_weights, default_gguf())
    model_config, state = loader()
    assert model_config.num_kv_heads == 1  # the case where KV heads are replicated
    single = ModelRunner(model_config, state, CONFIG)
    del state
    reference = run(Engine(ENGINE, single, gemma_tokenizer), requests(gemma_tokenizer))
    del single
    runner = start_tensor_parallel(loader, CONFIG, ParallelConfig(world_size=2, timeout_s=300))
    try:
        plain = run(Engine(ENGINE, runner, gemma_tokenizer), requests(gemma_tokenizer))
        engine = speculative(Engine(ENGINE, runner, gemma_tokenizer))
        spec = run(engine, requests(gemma_tokenizer))
    finally:
        runner.close()
    assert len(reference) == 3
    for rid, (tokens, _text, out) in reference.items():
        assert out.finish_reason != FinishReason.ERROR, out.error
        assert plain[rid][0] == tokens, rid
        assert spec[rid][0] == tokens, rid
    assert any(out.speculative and out.speculative.draft_tokens for *_, out in spec.values())
