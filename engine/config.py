"""Frozen configs of the engine's components, built once at the composition root.

``ModelConfig`` describes the architecture (read from an HF ``config.json`` or GGUF metadata);
``CacheConfig`` the paged KV cache geometry; ``RunnerConfig`` device, dtype and attention backend;
``ModelOptions`` which path each of the model's kernel decisions takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from espalier.kernels.options import KernelOptions

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
GEMMA3_FAMILY = ("gemma3_text", "gemma3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one layer type. ``kind``: "default" | "linear" | "llama3"."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    freq_factors: tuple[float, ...] = ()  # llama.cpp ``rope_freqs``: inv_freq / factor per pair

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """fp32 ``[head_dim // 2]`` inverse frequencies (same formulas as transformers)."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        inv = 1.0 / (self.theta**exponents)
        if self.freq_factors:
            return inv / torch.tensor(self.freq_factors, dtype=torch.float32)
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        if self.kind != "default":
            raise ValueError(f"unsupported rope type {self.kind!r}")
        return inv

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None, default_theta: float) -> RopeConfig:
        params = dict(params or {})
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        return cls(
            theta=float(params.get("rope_theta", default_theta)),
            kind=str(kind),
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts every model family reads.

    ``layer_types[i]`` is "full_attention" or "sliding_attention"; sliding layers attend to keys
    with ``q_pos - k_pos < sliding_window`` and use ``rope_local``. ``attn_scale`` multiplies q·k.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_local: RopeConfig | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attn_scale: float = 0.0  # 0 = head_dim ** -0.5
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def family(self) -> str:
        if self.model_type in LLAMA_FAMILY:
            return "llama"
        if self.model_type in GEMMA3_FAMILY:
            return "gemma3"
        raise ValueError(f"unsupported model_type {self.model_type!r}")

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def window(self, layer: int) -> int | None:
        """Sliding window of ``layer`` (None = full attention)."""
        return self.sliding_window if self.is_sliding(layer) else None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From an HF ``config.json`` dict (a multimodal Gemma 3 uses its ``text_config``)."""
        if "text_config" in cfg and cfg.get("model_type") == "gemma3":
            cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
        model_type = str(cfg["model_type"])
        if model_type in GEMMA3_FAMILY:
            return _gemma3_from_hf(cfg)
        if model_type not in LLAMA_FAMILY:
            raise ValueError(f"unsupported model_type {model_type!r}")
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        layers = int(cfg["num_hidden_layers"])
        rope_params = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        rope = RopeConfig.from_hf(rope_params, float(cfg.get("rope_theta", 10000.0)))
        if cfg.get("rope_freq_factors"):
            rope = replace(rope, freq_factors=tuple(cfg["rope_freq_factors"]))
        window = cfg.get("sliding_window")
        layer_types: tuple[str, ...] = ()
        if model_type in ("qwen2", "qwen3"):
            if not cfg.get("use_sliding_window", False):
                window = None
            types = cfg.get("layer_types")
            if window is not None and types:
                layer_types = tuple(types)
        if window is not None and not layer_types:
            layer_types = ("sliding_attention",) * layers
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope,
            layer_types=layer_types,
            sliding_window=int(window) if window is not None else None,
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            hidden_act=str(cfg.get("hidden_act", "silu")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_ids(cfg.get("eos_token_id")),
        )


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _gemma3_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if not types:
        pattern = int(cfg.get("sliding_window_pattern", 6))
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full_params, local_params = params.get("full_attention"), params.get("sliding_attention")
    else:
        full_params, local_params = cfg.get("rope_scaling"), None
    heads = int(cfg["num_attention_heads"])
    return ModelConfig(
        model_type="gemma3_text",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim", 256)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=RopeConfig.from_hf(full_params, float(cfg.get("rope_theta", 1_000_000.0))),
        rope_local=RopeConfig.from_hf(
            local_params, float(cfg.get("rope_local_base_freq", 10000.0))
        ),
        layer_types=tuple(types),
        sliding_window=int(cfg.get("sliding_window") or 4096),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=True,
        hidden_act=str(
            cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        ),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_ids(cfg.get("eos_token_id")),
    )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry.

    ``num_blocks`` fixes the block count; when 0, it is sized from ``memory_fraction`` of the free
    device memory (CUDA) or ``cpu_memory_bytes`` (CPU) after the weights are loaded.
    """

    block_size: int = 16
    num_blocks: int = 0
    memory_fraction: float = 0.85
    cpu_memory_bytes: int = 1 << 30


@dataclass(frozen=True)
class ModelOptions:
    """Which path each of the model's kernel decisions takes, fixed when the model and its
    attention backend are built (a CUDA graph keeps the paths it was captured with). The
    defaults are the measured winners (``docs/decisions/``); the other values are the anchors
    of ``bench/gpu.py`` / ``bench/attention.py`` and the ablations of tests.

    - ``skinny_gemv``: on CUDA, projections of a few rows run the Triton skinny GEMM where it
      beats cuBLAS (``kernels.gemv.preferred``); False: cuBLAS always.
    - ``fuse_residual_add``: where the norms run as kernels, the residual add before a norm is
      folded into its kernel (``RMSNormBase.add_norm``); False: two launches.
    - ``fuse_rope_store``: on CUDA, q/k rotation and the K/V cache write are one kernel
      (``kernels.fused.rope_store``); False: the rope kernel, then ``KVCache.write``.
    - ``norm_kernels_on_cpu``: the Triton norm kernels run on CPU tensors too (tests only:
      Triton's CPU interpreter).
    - ``small_query_up_to``: flashinfer backend steps whose every sequence has at most this
      many new tokens attend with espalier's small-query kernel
      (``engine/model/attention/small_query.py``); 0: every step on flashinfer's kernels.
    - ``decode_kernel_up_to``: one-token causal steps of at most this many sequences that reach
      flashinfer run its decode kernel, bigger ones its prefill kernel. 0 (off): in bf16 the
      decode kernel's logits differ in the last bits from the prefill kernel's for the same row
      of a verified tree, so speculative output could part from plain decoding at a near-tie
      (``docs/decisions/flashinfer-plan-and-kernels.md``).
    - ``kernels``: the launch-level paths (``kernels/options.py``).
    """

    skinny_gemv: bool = True
    fuse_residual_add: bool = True
    fuse_rope_store: bool = True
    norm_kernels_on_cpu: bool = False
    small_query_up_to: int = 16
    decode_kernel_up_to: int = 0
    kernels: KernelOptions = field(default_factory=KernelOptions)


@dataclass(frozen=True)
class RunnerConfig:
    """Where and how the model runs. ``dtype`` "auto" = fp32 on CPU, bf16 on CUDA.

    ``attention_backend``: "auto" = flashinfer on CUDA when it imports and supports the model
    (bf16/fp16, head_dim 64/128/256), torch SDPA otherwise; or "sdpa" / "flashinfer".
    ``cuda_graph_batch_sizes``: decode batch sizes captured as CUDA graphs (flashinfer on CUDA
    only; a batch in between replays the next larger graph, padded); () = eager only.
    ``cuda_graph_tree_sizes``: draft-tree sizes (nodes per sequence, at most the block size)
    whose verification steps are captured too, for the same batch sizes (the speculative
    default: 8 draft tokens + the root).
    ``options``: the model's kernel paths (``ModelOptions``; the defaults are the product's).
    """

    device: str = "cpu"
    dtype: str = "auto"
    attention_backend: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    cuda_graph_tree_sizes: tuple[int, ...] = (9,)
    options: ModelOptions = field(default_factory=ModelOptions)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            self.dtype
        ]
