"""Model families and a registry by ``model_type`` (``build_model``)."""

from __future__ import annotations

import torch

from espalier.engine.config import ModelConfig, ModelOptions
from espalier.engine.model.models.base import CausalLM
from espalier.engine.model.models.layers import use_options


def _build_llama(config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> CausalLM:
    from espalier.engine.model.models.llama import LlamaForCausalLM

    # bias presence follows the checkpoint (Qwen2: q/k/v only; Llama attention_bias: all four)
    qkv_bias = "model.layers.0.self_attn.q_proj.bias" in state_dict
    o_bias = "model.layers.0.self_attn.o_proj.bias" in state_dict
    return LlamaForCausalLM(config, qkv_bias=qkv_bias, o_bias=o_bias)


def _build_gemma3(config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> CausalLM:
    from espalier.engine.model.models.gemma3 import Gemma3ForCausalLM

    return Gemma3ForCausalLM(config)


_FAMILIES = {"llama": _build_llama, "gemma3": _build_gemma3}


def build_model(
    config: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    *,
    device: torch.device,
    dtype: torch.dtype,
    options: ModelOptions | None = None,
) -> CausalLM:
    """Instantiate the family of ``config.model_type`` and load ``state_dict`` (HF names) strictly.

    The module is built on the meta device and takes the checkpoint tensors as its parameters,
    converted to ``dtype`` on ``device``; a tied LM head has no ``lm_head.weight`` key.
    ``options``: the kernel paths of every layer (``ModelOptions``; None: the defaults).
    """
    with torch.device("meta"):
        model = _FAMILIES[config.family](config, state_dict)
    state = {k: v for k, v in state_dict.items() if not k.startswith("model.rotary_emb")}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    if options is not None:
        use_options(model, options)
    return model.eval()


__all__ = ["CausalLM", "build_model"]
