"""Shared pieces of the speculative decoding tests: tiny random models, grammars, and the plain
greedy oracle (full recompute every step: no KV reuse, no trees, no compaction)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from espalier.constrained import bitmask as bm
from espalier.engine.config import CacheConfig, ModelConfig, RunnerConfig
from espalier.engine.model.runner import ModelRunner, SeqInput


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """torch on one thread for the test (modules that import it): the mask threads and the
    tiny models' forwards do not fight over the 2 cores, and results do not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["math", "code"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


def tiny_config(vocab_size: int, *, layers: int = 2, window: int | None = None) -> ModelConfig:
    """A llama-family config small enough for many CPU steps (optionally sliding-window)."""
    return ModelConfig(
        model_type="llama",
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        layer_types=("sliding_attention",) * layers if window else (),
        sliding_window=window,
    )


def random_runner(
    config: ModelConfig,
    seed: int,
    *,
    num_blocks: int = 256,
    block_size: int = 4,
    scale: float = 4.0,
) -> ModelRunner:
    """A runner over random weights (``scale`` sharpens the logits so greedy ties are rare)."""
    from espalier.engine.model.models.llama import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config, qkv_bias=False, o_bias=False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] *= scale
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks)
    return ModelRunner(config, state, RunnerConfig(cache=cache))


def plain_greedy(
    runner: ModelRunner,
    prompt: list[int],
    max_tokens: int,
    *,
    matcher: Any = None,
    stop_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """Constrained greedy decoding by recomputing the whole sequence each step (the oracle)."""
    tokens = list(prompt)
    out: list[int] = []
    blocks = list(range(-(-(len(prompt) + max_tokens) // runner.block_size)))
    row = bm.allocate(1, runner.vocab_size, fill=0)
    while len(out) < max_tokens:
        logits = runner.forward([SeqInput(blocks, tokens, 0)]).logits[0]
        if matcher is not None:
            matcher.fill_bitmask(row, 0)
            allowed = torch.from_numpy(bm.unpack_allowed(row[0], runner.vocab_size))
            allowed = allowed.to(logits.device)
            logits = logits.masked_fill(~allowed, float("-inf"))
        token = int(logits.argmax())
        out.append(token)
        tokens.append(token)
        if matcher is not None:
            assert matcher.accept(token)
        if token in stop_ids or (matcher is not None and matcher.is_terminated()):
            break
    return out


def compile_matcher(tokenizer: Any, backend: str, schema: dict[str, Any] = SCHEMA) -> Any:
    """A fresh matcher for ``schema`` from the named backend (compact JSON: more forcing)."""
    from espalier.constrained.backends.common import BackendOptions
    from espalier.constrained.spec import GrammarSpec

    module = __import__(f"espalier.constrained.backends.{backend}", fromlist=["Backend"])
    compiled = module.Backend(tokenizer, BackendOptions(json_max_whitespace=0)).compile(
        GrammarSpec.json_schema(schema)
    )
    return compiled.matcher()


def random_eagle(target: ModelRunner, kind: str, seed: int, draft_vocab: int = 0) -> Any:
    """A random-weight EAGLE / EAGLE-3 head for ``target`` (EAGLE-3: a random vocab map)."""
    from espalier.engine.spec.eagle import EagleConfig, EagleHead

    mc = target.model_config
    config = EagleConfig(
        kind=kind,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_heads=mc.num_heads,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        vocab_size=mc.vocab_size,
        draft_vocab_size=draft_vocab,
    )
    torch.manual_seed(seed)
    head = EagleHead(config)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.model.model.embed_tokens.weight)
        if kind == "eagle3" and draft_vocab:
            targets = torch.randperm(mc.vocab_size)[:draft_vocab].sort().values
            head.d2t.copy_(targets - torch.arange(draft_vocab))
            head.lm_head.weight.mul_(4.0)
    return head
