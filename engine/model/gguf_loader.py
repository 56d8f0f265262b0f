"""GGUF files: hyperparameters from metadata, tensors dequantized with the ``gguf`` package and
renamed to Hugging Face parameter names, undoing llama.cpp's conversions.

llama.cpp's converter (1) permutes the rows of Q and K of ``llama``-architecture files for its
interleaved rope (undone here, as transformers' GGUF loader does), (2) stores Gemma 3's
zero-centred RMSNorm weights as ``w + 1`` (we subtract 1), (3) omits ``output.weight`` when the
LM head is tied to the embedding.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 has four norms per layer; llama-style models call their second norm ffn_norm.
_GEMMA3_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LLAMA_LAYER_NAMES = {"ffn_norm": "post_attention_layernorm"}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def read_metadata(reader: Any) -> dict[str, Any]:
    """All scalar / string / small-array fields of a ``gguf.GGUFReader`` (token lists skipped)."""
    meta: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key in (
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.scores",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.merges",
        ):
            meta[key + ".len"] = len(f.data)
            continue
        try:
            meta[key] = f.contents()
        except Exception:  # exotic field types we never need
            continue
    return meta


def hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """An HF-style ``config.json`` dict for the file's architecture."""
    arch = meta["general.architecture"]
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {SUPPORTED_ARCHS}")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    vocab = int(meta.get("tokenizer.ggml.tokens.len") or key("vocab_size"))
    cfg: dict[str, Any] = {
        "model_type": "gemma3_text" if arch == "gemma3" else arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(key("context_length", 8192)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    theta = key("rope.freq_base")
    if arch == "gemma3":
        cfg["rope_theta"] = float(theta if theta is not None else 1_000_000.0)
        cfg["rope_local_base_freq"] = 10000.0  # llama.cpp's fixed value for Gemma 3
        cfg["sliding_window"] = int(key("attention.sliding_window", 512))
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
        scaling = key("rope.scaling.factor")
        if scaling and key("rope.scaling.type") == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(scaling)}
    else:
        cfg["rope_theta"] = float(theta if theta is not None else 10000.0)
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names and arch != "qwen2"
        window = key("attention.sliding_window")
        if window:
            cfg["sliding_window"] = int(window)
            cfg["use_sliding_window"] = True
    return cfg


def _hf_name(gguf_name: str, arch: str) -> str | None:
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    match = _BLOCK.match(gguf_name)
    if match is None:
        return None
    layer, part, kind = match.groups()
    local = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LLAMA_LAYER_NAMES
    name = local.get(part) or _LAYER_NAMES.get(part)
    return None if name is None else f"model.layers.{layer}.{name}.{kind}"


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute`` (rows grouped per head as interleaved pairs)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def load_gguf(
    path: str | os.PathLike[str], *, progress: bool = True
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a GGUF file: (HF-style config dict, fp32 CPU state dict with HF names).

    ``rope_freqs.weight`` (Llama 3.1 frequency factors) is returned in the config as
    ``rope_freq_factors``.
    """
    import gguf
    from tqdm.auto import tqdm

    reader = gguf.GGUFReader(str(path))
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    cfg = hf_config_from_gguf(meta, names)
    arch = meta["general.architecture"]
    state: dict[str, torch.Tensor] = {}
    bar = tqdm(
        reader.tensors, desc=f"converting {Path(path).name}", unit="tensor", disable=not progress
    )
    for tensor in bar:
        values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        values = values.reshape([int(d) for d in reversed(tensor.shape)])
        if tensor.name == "rope_freqs.weight":
            cfg["rope_freq_factors"] = [float(x) for x in values.reshape(-1)]
            continue
        name = _hf_name(tensor.name, arch)
        if name is None:
            raise ValueError(f"unexpected GGUF tensor {tensor.name!r} in a {arch} file")
        if arch == "llama" and ".attn_q." in tensor.name:
            values = _unpermute_qk(values, cfg["num_attention_heads"])
        elif arch == "llama" and ".attn_k." in tensor.name:
            values = _unpermute_qk(values, cfg["num_key_value_heads"])
        if arch == "gemma3" and tensor.name.endswith("norm.weight"):
            values = values - 1.0
        state[name] = torch.from_numpy(np.array(values, dtype=np.float32, order="C", copy=True))
    return cfg, state
