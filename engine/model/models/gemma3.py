"""Gemma 3 (text): sliding-window local layers + global layers (own rope theta), QK-norm,
GeGLU, sqrt(hidden) embedding scale, (1 + w) RMSNorms around attention and MLP, tied head."""

from __future__ import annotations

import torch

from espalier.engine.config import ModelConfig
from espalier.engine.model.models.base import CausalLM, DecoderLayer
from espalier.engine.model.models.layers import GatedMLP, GemmaRMSNorm, PagedAttention


class Gemma3DecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = PagedAttention(
            config,
            layer,
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            norm_cls=GemmaRMSNorm,
        )
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def after_attention(
        self, x: torch.Tensor, attn: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, h = self.pre_feedforward_layernorm.add_norm(x, self.post_attention_layernorm(attn))
        return x, self.post_feedforward_layernorm(self.mlp(h))


class Gemma3ForCausalLM(CausalLM):
    """Parameter names as in HF ``Gemma3ForCausalLM``."""

    def __init__(self, config: ModelConfig) -> None:
        layers = (Gemma3DecoderLayer(config, i) for i in range(config.num_layers))
        super().__init__(config, layers, GemmaRMSNorm(config.hidden_size, config.rms_norm_eps))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight
        # the scale is rounded to the weight dtype first, as in the reference implementation
        scale = float(torch.tensor(self.config.hidden_size**0.5, dtype=weight.dtype))
        out: torch.Tensor = self.model.embed_tokens(token_ids) * scale
        return out
