"""EAGLE draft heads over the target's hidden states, with their own paged KV cache.

Two published layouts (parameter names as in the SafeAILab/EAGLE checkpoints):

- **EAGLE** (``kind="eagle1"``, Li et al. 2024): ``fc`` (``[H, 2H]`` + bias) fuses the token
  embedding and the target's last (normed) hidden state; ``layers.{i}`` are Llama decoder layers
  (layer 0 has no ``input_layernorm``); the output hidden goes through the **target's** LM head.
- **EAGLE-3** (``kind="eagle3"``, Li et al. 2025): ``fc`` (``[H, 3·H_target]``, no bias) fuses
  the target's hidden states from three layers (low, middle, high); one ``midlayer`` whose
  attention reads ``cat(input_layernorm(embed), hidden_norm(hidden))`` (q/k/v take ``2H``);
  ``norm`` + its own ``lm_head`` over a small draft vocabulary, mapped to target ids by
  ``d2t`` (``target_id = draft_id + d2t[draft_id]``).

Alignment: draft cache index ``i`` holds the pair ``(token x_{i+1}, feature f_i)`` at position
``i``, where ``f_i`` is the target's feature at token ``i``; its output predicts ``f_{i+1}`` and
the head gives the distribution of ``x_{i+2}``. Inside a draft tree a node's input pairs its token
with the head's own output at the parent (the predicted feature).

``embed_tokens.weight`` comes from the checkpoint when present, else from the target.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from espalier.engine.config import ModelConfig, RopeConfig
from espalier.engine.kv_cache import KVCache
from espalier.engine.model.attention.base import AttentionBackend, AttentionMetadata
from espalier.engine.model.models.layers import (
    GatedMLP,
    Linear,
    PagedAttention,
    RMSNorm,
    rope_cos_sin,
)


@dataclass(frozen=True)
class EagleConfig:
    """Shape of a head. ``aux_layers``: target capture indices fused by EAGLE-3 (runner
    convention: index i = output of decoder layer i); EAGLE reads index ``target_layers``."""

    kind: str  # "eagle1" | "eagle3"
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    num_layers: int = 1
    draft_vocab_size: int = 0  # eagle3; 0 = the target's
    target_hidden_size: int = 0  # 0 = hidden_size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    fc_bias: bool = True  # eagle1 checkpoints have one
    aux_layers: tuple[int, ...] = ()

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    def model_config(self) -> ModelConfig:
        """The attention/KV geometry as a ModelConfig (for the cache and the backend)."""
        return ModelConfig(
            model_type="llama",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope=RopeConfig(theta=self.rope_theta),
            hidden_act=self.hidden_act,
        )

    def target_layers(self, target_num_layers: int) -> tuple[int, ...]:
        """Target capture indices this head reads."""
        if self.kind == "eagle1":
            return (target_num_layers,)
        if self.aux_layers:
            return self.aux_layers
        n = target_num_layers
        # EAGLE-3 reads the inputs of layers 2, n//2 and n-3, i.e. the outputs of the ones before
        return (1, n // 2 - 1, n - 4) if n >= 5 else (0, max(n // 2 - 1, 0), n - 1)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], kind: str) -> EagleConfig:
        heads = int(cfg["num_attention_heads"])
        aux = cfg.get("eagle_aux_hidden_state_layer_ids") or ()
        return cls(
            kind=kind,
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            vocab_size=int(cfg["vocab_size"]),
            num_layers=int(cfg.get("num_hidden_layers", 1)) if kind == "eagle1" else 1,
            draft_vocab_size=int(cfg.get("draft_vocab_size") or 0),
            target_hidden_size=int(cfg.get("target_hidden_size") or 0),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            # HF capture indices count the embeddings as 0: ours are one lower
            aux_layers=tuple(int(i) - 1 for i in aux),
        )


class _Layer(nn.Module):
    """A Llama decoder layer; ``eagle3``: attention over ``cat(norm(embed), norm(hidden))``."""

    def __init__(self, config: EagleConfig, index: int) -> None:
        super().__init__()
        mc = config.model_config()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.eagle3 = config.kind == "eagle3"
        self.self_attn = PagedAttention(mc, index, qkv_bias=False, o_bias=False, norm_cls=None)
        if self.eagle3:
            attn = self.self_attn
            attn.q_proj = Linear(2 * h, config.num_heads * config.head_dim, bias=False)
            attn.k_proj = Linear(2 * h, config.num_kv_heads * config.head_dim, bias=False)
            attn.v_proj = Linear(2 * h, config.num_kv_heads * config.head_dim, bias=False)
            self.hidden_norm = RMSNorm(h, eps)
        if self.eagle3 or index != 0:
            self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act)

    def forward(
        self,
        x: torch.Tensor,
        embeds: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        attention: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.eagle3:
            attn_in = torch.cat((self.input_layernorm(embeds), self.hidden_norm(x)), dim=-1)
        elif hasattr(self, "input_layernorm"):
            attn_in = self.input_layernorm(x)
        else:
            attn_in = x
        x = x + self.self_attn(attn_in, cos_sin, kv_cache, attention, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """The head's parameters (checkpoint names) and its forward over packed rows."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        if config.kind == "eagle3":
            target_h = config.target_hidden_size or h
            self.fc = nn.Linear(3 * target_h, h, bias=False)
            self.midlayer = _Layer(config, 0)
            self.norm = RMSNorm(h, config.rms_norm_eps)
            self.lm_head = nn.Linear(h, config.draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab, dtype=torch.int64))
        elif config.kind == "eagle1":
            self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
            self.layers = nn.ModuleList(_Layer(config, i) for i in range(config.num_layers))
        else:
            raise ValueError(f"unknown EAGLE kind {config.kind!r}")

    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """Target features (``[T, F]``, F = H or 3·H_target) -> head input hidden ``[T, H]``."""
        if self.config.kind == "eagle3":
            return self.fc(target_features)
        return target_features

    def forward(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """token_ids int64 ``[T]``, hidden ``[T, H]`` (fused) -> output hidden ``[T, H]``."""
        embeds = self.embed_tokens(token_ids)
        inv_freq = RopeConfig(theta=self.config.rope_theta).inv_freq(self.config.head_dim)
        cos_sin = rope_cos_sin(inv_freq.to(positions.device), positions, hidden.dtype)
        if self.config.kind == "eagle3":
            return self.midlayer(hidden, embeds, cos_sin, kv_cache, attention, meta)
        x = self.fc(torch.cat((embeds, hidden), dim=-1))
        for layer in self.layers:
            x = layer(x, embeds, cos_sin, kv_cache, attention, meta)
        return x

    def draft_logits(self, out: torch.Tensor, target_head: Any) -> torch.Tensor:
        """fp32 ``[T, draft_vocab]`` logits (eagle1: the target's LM head, target vocabulary)."""
        if self.config.kind == "eagle3":
            return self.lm_head(self.norm(out)).float()
        logits: torch.Tensor = target_head(out)
        return logits

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if self.config.kind == "eagle3":
            return ids + self.get_buffer("d2t")[ids]
        return ids


def load_eagle(path: str | os.PathLike[str], target_embed: torch.Tensor) -> EagleHead:
    """Load a head from a local directory (``config.json`` + ``model.safetensors`` or
    ``pytorch_model.bin``); its kind comes from the keys (``midlayer.*`` = eagle3, else eagle1).
    ``target_embed``: the target's ``embed_tokens`` weight, used when the checkpoint has none."""
    directory = Path(path)
    cfg = json.loads((directory / "config.json").read_text())
    state = _read_state(directory)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    kind = "eagle3" if any(k.startswith("midlayer.") for k in state) else "eagle1"
    config = EagleConfig.from_hf(cfg, kind)
    if kind == "eagle1" and "fc.bias" not in state:
        config = EagleConfig(**{**config.__dict__, "fc_bias": False})
    state.pop("t2d", None)
    state.setdefault("embed_tokens.weight", target_embed.detach().to("cpu"))
    with torch.device("meta"):
        head = EagleHead(config)
    if "d2t" not in state and kind == "eagle3":
        state["d2t"] = torch.zeros(config.draft_vocab, dtype=torch.int64)
    head.load_state_dict(state, strict=True, assign=True)
    return head.eval()


def _read_state(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        return state
    binary = directory / "pytorch_model.bin"
    if binary.exists():
        loaded: dict[str, torch.Tensor] = torch.load(binary, map_location="cpu", weights_only=True)
        return loaded
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in {directory}")
