"""The engine and speculative decoding on CUDA (tiny random models, the toy tokenizer).

- Constrained generation in bf16 (flashinfer + CUDA graphs, and SDPA): several JSON schemas;
  every finished output parses and post-validates; graphs and eager give the same tokens.
- Lossless speculation on CUDA: fp32 (SDPA) against the full-recompute greedy oracle, exactly as
  the CPU tests; bf16 (flashinfer) against plain decoding on the same runner. Why not the oracle
  in bf16: the oracle recomputes the whole prefix with a prefill-shaped forward, whose bf16
  rounding differs from the incremental one, so a near-tie can go the other way — a difference
  of numerics, not of speculation.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import FinishReason, GenerationRequest, SamplingParams
from espalier.engine.engine import Engine, EngineConfig
from espalier.engine.scheduler import SchedulerConfig
from espalier.engine.spec.combine import Proposer
from espalier.engine.spec.decoder import SpeculativeDecoder
from espalier.engine.spec.masks import MaskBuilder
from espalier.engine.spec.ngram import NgramConfig, NgramDrafter
from tests.fixtures.engine_fixtures import run_all, text_of, tokens_of
from tests.fixtures.gpu_models import gpu_config, gpu_runner, gpu_state
from tests.fixtures.spec_helpers import SCHEMA, compile_matcher, plain_greedy
from tests.fixtures.spec_loop import LoopRequest, SpecLoop

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SCHEMAS = [
    SCHEMA,
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    {"enum": ["red", "green", {"rgb": [1, 2, 3]}]},
    {
        "type": "object",
        "properties": {"n": {"type": "number"}, "s": {"type": "string", "maxLength": 4}},
        "required": ["n", "s"],
        "additionalProperties": False,
    },
]


def engine_outputs(runner: Any, tokenizer: Any) -> dict[str, list[Any]]:
    engine = Engine(
        EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256)),
        runner,
        tokenizer,
    )
    requests = [
        GenerationRequest(
            f"s{i}",
            prompt=f"JSON number {i}: ",
            sampling=SamplingParams(max_tokens=64),
            grammar=GrammarSpec.json_schema(schema),
        )
        for i, schema in enumerate(SCHEMAS * 2)
    ]
    chunks = run_all(engine, requests)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    engine.close()
    return chunks


def test_constrained_generation_cuda_bf16(toy_tokenizer: Any) -> None:
    config = gpu_config(toy_tokenizer.vocab_size, family="gemma3", window=8)
    state = gpu_state(config, seed=11)
    graphs = gpu_runner(config, state, graphs=(1, 2, 4, 8))
    assert graphs.attention.name == "flashinfer" and graphs.graphs is not None
    fast = engine_outputs(graphs, toy_tokenizer)
    eager = engine_outputs(gpu_runner(config, state, backend="flashinfer"), toy_tokenizer)
    sdpa = engine_outputs(gpu_runner(config, state, backend="sdpa"), toy_tokenizer)
    assert sum(graphs.graphs.replays.values()) > 0
    finished = 0
    for rid, chunks in fast.items():
        assert tokens_of(chunks) == tokens_of(eager[rid]) == tokens_of(sdpa[rid]), rid
        last = chunks[-1]
        if last.finish_reason in (FinishReason.LENGTH, FinishReason.LENGTH_UNCLOSED):
            continue  # a random model may run out of tokens inside a long string
        finished += 1
        assert last.validation is not None and last.validation.valid, (text_of(chunks), last)
        json.loads(text_of(chunks))
    assert finished >= 3


def make_loop(runner: Any) -> SpecLoop:
    proposer = Proposer({"ngram": NgramDrafter(NgramConfig(min_n=1, max_n=3))})
    return SpecLoop(SpeculativeDecoder(runner, proposer, MaskBuilder(runner.vocab_size)))


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44, 45, 40, 41, 42], [99]]


@pytest.mark.parametrize("backend", [None, "llguidance", "xgrammar"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_lossless_cuda(toy_tokenizer: Any, backend: str | None, dtype: str) -> None:
    config = gpu_config(toy_tokenizer.vocab_size, window=6)
    state = gpu_state(config, seed=3)
    graphs = (1, 2, 4) if dtype == "bfloat16" else ()
    runner = gpu_runner(config, state, dtype=dtype, graphs=graphs)
    assert runner.attention.name == ("flashinfer" if dtype == "bfloat16" else "sdpa")
    stops = frozenset(toy_tokenizer.stop_token_ids)

    def requests(draft: int) -> list[LoopRequest]:
        return [
            LoopRequest(
                f"r{i}",
                prompt,
                24,
                compile_matcher(toy_tokenizer, backend) if backend else None,
                ("ngram", "forced"),
                draft,
                stops,
            )
            for i, prompt in enumerate(PROMPTS)
        ]

    spec = make_loop(runner).generate(requests(6))
    if dtype == "float32":
        expected = [
            plain_greedy(
                runner,
                prompt,
                24,
                matcher=compile_matcher(toy_tokenizer, backend) if backend else None,
                stop_ids=stops,
            )
            for prompt in PROMPTS
        ]
    else:
        expected = [r.output_ids for r in make_loop(runner).generate(requests(0))]
    assert [r.output_ids for r in spec] == expected
    assert sum(r.stats.draft_tokens for r in spec) > 0
