"""A tiny random-weight Llama over the toy byte-level tokenizer, and helpers to run an engine.

Used by ``test_engine*.py``: real components end to end (runner, paged cache, grammar backends),
only the weights are random.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Any

import torch

from espalier.engine.api import GenerationRequest, RequestOutput
from espalier.engine.engine import Engine, EngineConfig
from espalier.engine.scheduler import SchedulerConfig
from tests.fixtures.tokenizers import build_byte_level_hf


@lru_cache(maxsize=1)
def toy_tokenizer() -> Any:
    from espalier.constrained.tokenizer import TokenizerInfo

    hf = build_byte_level_hf()
    return TokenizerInfo(hf, stop_token_ids=[hf.convert_tokens_to_ids("<eos>")], name="toy-bpe")


@lru_cache(maxsize=1)
def tiny_weights() -> tuple[Any, dict[str, torch.Tensor]]:
    """(ModelConfig, state_dict) of a 2-layer Llama with the toy vocabulary, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from espalier.engine.config import ModelConfig

    cfg = LlamaConfig(
        vocab_size=len(build_byte_level_hf()),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,  # peaky distributions: greedy outputs are not all ties
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return ModelConfig.from_hf(cfg.to_dict()), state


def make_engine(
    *,
    num_blocks: int = 128,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    overlap_masks: bool = True,
    sparse_head: bool = True,
    close_within_budget: bool = True,
    prefix_caching: bool = True,
) -> Engine:
    from espalier.engine.config import CacheConfig, RunnerConfig
    from espalier.engine.model.runner import ModelRunner

    model_config, state = tiny_weights()
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks)
    runner = ModelRunner(model_config, state, RunnerConfig(cache=cache))
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            prefix_caching=prefix_caching,
        ),
        overlap_masks=overlap_masks,
        sparse_head=sparse_head,
        close_within_budget=close_within_budget,
    )
    return Engine(config, runner, toy_tokenizer())


def run_all(
    engine: Engine, requests: Iterable[GenerationRequest]
) -> dict[str, list[RequestOutput]]:
    """Add every request, step until done; chunks per request id."""
    for request in requests:
        engine.add_request(request)
    return drain(engine)


def drain(engine: Engine, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    chunks: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            chunks.setdefault(out.request_id, []).append(out)
    assert not engine.has_unfinished()
    return chunks


def tokens_of(chunks: list[RequestOutput]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def text_of(chunks: list[RequestOutput]) -> str:
    return "".join(c.text_delta for c in chunks)


CLOSING_SCHEMA = {
    "type": "object",
    "properties": {
        "names": {"type": "array", "items": {"type": "string"}},
        "n": {"type": "integer"},
    },
    "required": ["names", "n"],
}
"""A schema whose outputs can loop (an array of strings) and need the budget closer to end."""
