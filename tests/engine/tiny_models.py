"""Tiny random-weight models built in-test from transformers configs (nothing from a hub).

``make_tiny_model(kind, directory)`` saves an HF checkpoint (config.json + model.safetensors) and
returns the transformers model, the reference for parity tests. Norm weights get random offsets
so that a (1 + w) vs w mix-up cannot hide.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 97
KINDS = ("llama", "qwen2", "qwen3", "mistral", "gemma3")


def tiny_config(kind: str, *, gguf_compatible: bool = False) -> Any:
    """A 2-3 layer config with GQA (4 heads, 2 kv heads, head_dim 16) and a 97-token vocab.

    ``gguf_compatible``: only what a GGUF file can state (Gemma 3: 6 layers in llama.cpp's fixed
    5-local-1-global pattern, local rope theta 10000, query scale 1/sqrt(head_dim), no softcap).
    """
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        return tf.LlamaConfig(num_hidden_layers=2, rope_theta=500.0, **common)
    if kind == "qwen2":
        return tf.Qwen2Config(num_hidden_layers=2, **common)
    if kind == "qwen3":
        return tf.Qwen3Config(num_hidden_layers=2, **common)
    if kind == "mistral":
        return tf.MistralConfig(num_hidden_layers=2, sliding_window=6, **common)
    if kind == "gemma3" and gguf_compatible:
        common["tie_word_embeddings"] = True
        return tf.Gemma3TextConfig(
            num_hidden_layers=6,
            sliding_window=6,
            query_pre_attn_scalar=16,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            **common,
        )
    if kind == "gemma3":
        common["tie_word_embeddings"] = True
        return tf.Gemma3TextConfig(
            num_hidden_layers=3,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
            },
            **common,
        )
    raise ValueError(kind)


def make_tiny_model(
    kind: str, directory: Path, *, seed: int = 0, gguf_compatible: bool = False
) -> Any:
    """Build, randomize and save the ``kind`` model under ``directory``; return it (eval, fp32)."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tiny_config(kind, gguf_compatible=gguf_compatible)
    config._attn_implementation = "eager"
    cls = {
        "llama": tf.LlamaForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "qwen3": tf.Qwen3ForCausalLM,
        "mistral": tf.MistralForCausalLM,
        "gemma3": tf.Gemma3ForCausalLM,
    }[kind]
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
            elif name.endswith("bias"):
                param.copy_(torch.randn_like(param) * 0.2)
            else:
                param.copy_(torch.randn_like(param) * 0.15)
    model.save_pretrained(str(directory))
    return model
