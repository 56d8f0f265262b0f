"""The model interface the runner calls, and shared forward/logits plumbing.

A model maps packed token rows of one step to final normed hidden states, writing K/V into the
paged cache on the way; ``compute_logits`` applies the LM head (+ softcapping) in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from espalier.engine.config import ModelConfig, RopeConfig
from espalier.engine.kv_cache import KVCache
from espalier.engine.model.attention.base import AttentionBackend, AttentionMetadata
from espalier.engine.model.models.layers import (
    Linear,
    PagedAttention,
    RMSNormBase,
    UsesOptions,
    linear,
    rope_cos_sin,
)


class DecoderStack(nn.Module):
    """``embed_tokens`` + ``layers`` + final ``norm``: the ``model.*`` prefix of HF checkpoints."""

    def __init__(
        self, embed_tokens: nn.Embedding, layers: nn.ModuleList, norm: RMSNormBase
    ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = layers
        self.norm = norm


class DecoderLayer(nn.Module):
    """A decoder layer: its input norm and attention, then the family's ``after_attention``."""

    input_layernorm: RMSNormBase
    self_attn: PagedAttention

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        attention: AttentionBackend,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream ``x + delta`` (``[T, hidden]``; ``delta`` None: just ``x``) -> the
        stream after the layer, again as ``(x, delta)``: each residual add is left to the next
        norm, which on CUDA does both in one kernel (``RMSNormBase.add_norm``)."""
        x, h = self.input_layernorm.add_norm(x, delta)
        return self.after_attention(x, self.self_attn(h, cos_sin, kv_cache, attention, meta))

    def after_attention(
        self, x: torch.Tensor, attn: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream ``x`` and the attention output ``attn`` -> ``(x, delta)`` after the MLP."""
        raise NotImplementedError


class CausalLM(UsesOptions, nn.Module):
    """Base of every family: ``model.embed_tokens / layers / norm`` and ``lm_head`` (maybe tied).

    Subclasses pass their decoder layers and final norm, and may redefine ``embed(token_ids)``
    (default: the embedding lookup); each decoder layer is called as
    ``layer(x, delta, cos_sin, kv_cache, attention, meta) -> (x, delta)``: the residual stream
    is ``x + delta``, the add left to the next norm (``RMSNormBase.add_norm``: one kernel with
    the norm on CUDA); ``delta`` is None into layer 0.
    """

    config: ModelConfig
    model: DecoderStack
    lm_head: nn.Linear | None
    vocab_gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Tensor parallel: this rank's vocabulary-slice logits -> the full vocabulary
    (``parallel/layers.py``); None on one device."""

    def __init__(self, config: ModelConfig, layers: Iterable[nn.Module], norm: RMSNormBase) -> None:
        super().__init__()
        self.config = config
        embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model = DecoderStack(embed_tokens, nn.ModuleList(layers), norm)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[T]`` -> ``[T, hidden]`` in the model dtype."""
        out: torch.Tensor = self.model.embed_tokens(token_ids)
        return out

    def layer_cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer ``(cos, sin)``; layers sharing a rope config share the tensors."""
        cfg = self.config
        full = rope_cos_sin(self._inv_freq(cfg.rope, positions.device), positions, dtype)
        local = full
        if cfg.rope_local is not None:
            inv_freq = self._inv_freq(cfg.rope_local, positions.device)
            local = rope_cos_sin(inv_freq, positions, dtype)
        return [local if cfg.is_sliding(i) else full for i in range(cfg.num_layers)]

    def _inv_freq(self, rope: RopeConfig, device: torch.device) -> torch.Tensor:
        """``rope.inv_freq`` on ``device``, computed once (no host-to-device copy per step)."""
        cache: dict[tuple[RopeConfig, str], torch.Tensor] = self.__dict__.setdefault(
            "_inv_freq_cache", {}
        )
        key = (rope, str(device))
        if key not in cache:
            cache[key] = rope.inv_freq(self.config.head_dim).to(device)
        return cache[key]

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        attention: AttentionBackend,
        hidden_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Returns final normed hidden ``[T, hidden]`` and the requested captured layers.

        Capture index ``i < num_layers`` is the output of decoder layer i (residual stream);
        ``num_layers`` is the final normed hidden state.
        """
        hidden = self.embed(token_ids)
        cos_sin = self.layer_cos_sin(positions, hidden.dtype)
        wanted = set(hidden_layers)
        captured: dict[int, torch.Tensor] = {}
        delta: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            hidden, delta = layer(hidden, delta, cos_sin[i], kv_cache, attention, meta)
            if i in wanted:  # the stream itself: add now, the next norm has nothing to add
                hidden, delta = hidden + delta, None
                captured[i] = hidden
        _, hidden = self.model.norm.add_norm(hidden, delta)
        if self.config.num_layers in wanted:
            captured[self.config.num_layers] = hidden
        return hidden, captured

    def head_weight(self) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head.weight
        return self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> fp32 ``[n, V]`` (final softcapping applied when configured)."""
        logits = linear(hidden, self.head_weight(), None, self.options)
        if self.vocab_gather is not None:  # tensor parallel: every rank's vocabulary slice
            logits = self.vocab_gather(logits)
        logits = logits.float()
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
