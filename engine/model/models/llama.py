"""Llama family: Llama 2/3.x, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (per-head QK-norm)."""

from __future__ import annotations

import torch

from espalier.engine.config import ModelConfig
from espalier.engine.model.models.base import CausalLM, DecoderLayer
from espalier.engine.model.models.layers import GatedMLP, PagedAttention, RMSNorm


class LlamaDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer: int, *, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = PagedAttention(
            config,
            layer,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            norm_cls=RMSNorm if config.qk_norm else None,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def after_attention(
        self, x: torch.Tensor, attn: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, h = self.post_attention_layernorm.add_norm(x, attn)
        return x, self.mlp(h)


class LlamaForCausalLM(CausalLM):
    """Parameter names as in HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3...``."""

    def __init__(self, config: ModelConfig, *, qkv_bias: bool, o_bias: bool) -> None:
        layers = (
            LlamaDecoderLayer(config, i, qkv_bias=qkv_bias, o_bias=o_bias)
            for i in range(config.num_layers)
        )
        super().__init__(config, layers, RMSNorm(config.hidden_size, config.rms_norm_eps))
