"""Tiny random-weight models for the GPU tests, shaped for flashinfer (head_dim 64, GQA 4/2).

``gpu_config`` builds a Llama-family config (optionally with alternating sliding-window and
full layers) or a Gemma 3 one; ``gpu_state`` its random weights (CPU fp32, seeded, LM head
sharpened so that greedy choices are rarely near ties); ``gpu_runner`` a CUDA runner over them;
``tree_input`` a verify step's draft tree for a runner.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from espalier.engine.config import CacheConfig, ModelConfig, RopeConfig, RunnerConfig
from espalier.engine.model.runner import ModelRunner, SeqInput
from espalier.engine.spec.tree_builder import tree_attention_mask


def gpu_config(vocab_size: int, *, family: str = "llama", window: int | None = None) -> ModelConfig:
    """2 layers (layer 0 sliding when ``window`` is set), hidden 256, 4 heads of 64, 2 KV heads."""
    layer_types = ("sliding_attention", "full_attention") if window else ()
    common = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        layer_types=layer_types,
        sliding_window=window,
    )
    if family == "gemma3":
        return ModelConfig(
            model_type="gemma3_text",
            qk_norm=True,
            hidden_act="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            rope=RopeConfig(theta=1000.0),
            rope_local=RopeConfig(theta=50.0),
            attn_scale=48**-0.5,
            **common,  # type: ignore[arg-type]
        )
    return ModelConfig(model_type="llama", **common)  # type: ignore[arg-type]


def gpu_state(config: ModelConfig, seed: int, *, sharpen: float = 6.0) -> dict[str, torch.Tensor]:
    """Random weights with HF names (CPU fp32); the output head scaled by ``sharpen``."""
    from espalier.engine.model.models.gemma3 import Gemma3ForCausalLM
    from espalier.engine.model.models.llama import LlamaForCausalLM

    torch.manual_seed(seed)
    if config.family == "gemma3":
        model: torch.nn.Module = Gemma3ForCausalLM(config)
    else:
        model = LlamaForCausalLM(config, qkv_bias=False, o_bias=False)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, value in state.items():
        if "norm" in name:
            value.add_(torch.randn_like(value) * 0.1)
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    state[head] = torch.randn_like(state[head]) * sharpen / config.hidden_size**0.5
    return state


def gpu_runner(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    *,
    backend: str = "auto",
    graphs: Sequence[int] = (),
    trees: Sequence[int] = (),
    dtype: str = "bfloat16",
    block_size: int = 4,
    num_blocks: int = 512,
) -> ModelRunner:
    """A CUDA runner; ``graphs``: batch sizes captured as CUDA graphs (flashinfer) for decode
    steps and for verification steps of trees of ``trees`` nodes."""
    return ModelRunner(
        config,
        state,
        RunnerConfig(
            device="cuda",
            dtype=dtype,
            attention_backend=backend,
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
            cuda_graph_batch_sizes=tuple(graphs),
            cuda_graph_tree_sizes=tuple(trees),
        ),
    )


def depths(parents: list[int]) -> list[int]:
    """Each node's depth (``parents[i] < i``; the root, -1, at depth 0)."""
    out = [0] * len(parents)
    for i, p in enumerate(parents):
        out[i] = 0 if p < 0 else out[p] + 1
    return out


def tree_input(table: list[int], ctx: int, parents: list[int], first: int) -> SeqInput:
    """A verify step's draft tree over ``ctx`` cached entries: tokens ``first, first + 1, ...``,
    positions by depth, the tree's attention mask, logits for every node."""
    return SeqInput(
        table,
        [first + i for i in range(len(parents))],
        ctx,
        positions=[ctx + d for d in depths(parents)],
        custom_mask=tree_attention_mask(parents, ctx),
        logits="all",
    )
