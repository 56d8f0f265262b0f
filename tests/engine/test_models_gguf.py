"""GGUF loading: tiny models written the way llama.cpp's converter writes them load back exactly.

The writer below follows llama.cpp's ``convert_hf_to_gguf.py`` conventions independently of our
loader: tensor names (``blk.N.attn_q`` ...), Q/K rows permuted for the ``llama`` architecture,
Gemma 3 norms stored as ``w + 1``, no ``output.weight`` when the head is tied, hyperparameters in
``<arch>.*`` metadata. Loading must give transformers' logits for the original checkpoint.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from espalier.engine.config import CacheConfig, RunnerConfig
from espalier.engine.model.runner import ModelRunner, SeqInput
from tests.fixtures.tiny_models import VOCAB, make_tiny_model

LAYER_PARTS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GEMMA3_PARTS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: per head, interleave the two rotary halves."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf_name: str, arch: str) -> str:
    stem, _, kind = hf_name.rpartition(".")
    if stem == "model.embed_tokens":
        return f"token_embd.{kind}"
    if stem == "model.norm":
        return f"output_norm.{kind}"
    if stem == "lm_head":
        return f"output.{kind}"
    _, _, layer, part = stem.split(".", 3)
    parts = {**LAYER_PARTS, **(GEMMA3_PARTS if arch == "gemma3" else {})}
    if arch != "gemma3":
        parts["post_attention_layernorm"] = "ffn_norm"
    return f"blk.{layer}.{parts[part]}.{kind}"


def write_gguf(model: Any, path: Path, arch: str) -> None:
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(
        rope["full_attention"]["rope_theta"] if arch == "gemma3" else rope["rope_theta"]
    )
    if arch == "gemma3":
        writer.add_sliding_window(cfg.sliding_window)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<t{i}>" for i in range(VOCAB)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        values = tensor.detach().float().numpy().copy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            values = llama_cpp_permute(values, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            values = llama_cpp_permute(values, cfg.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            values = values + 1.0
        writer.add_tensor(gguf_name(name, arch), values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_gguf_written_like_llama_cpp_loads_exactly(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from espalier.constrained import tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "_cache_root", tmp_path / "cache")
    model = make_tiny_model(kind, tmp_path / "hf", gguf_compatible=True)
    path = tmp_path / f"tiny-{kind}.gguf"
    write_gguf(model, path, kind)

    from espalier.engine.model.gguf_loader import load_gguf

    cfg, state = load_gguf(path, progress=False)
    assert cfg["vocab_size"] == VOCAB and cfg["num_hidden_layers"] == model.config.num_hidden_layers
    tied = model.config.tie_word_embeddings
    reference = {
        k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")
    }
    assert set(state) == set(reference)
    for name, tensor in state.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)

    from espalier.engine.model.weights import converted_gguf_dir

    monkeypatch.setattr(
        "espalier.constrained.tokenizer.converted_gguf_tokenizer_dir", lambda p: tmp_path / "none"
    )
    (tmp_path / "none").mkdir()
    converted = converted_gguf_dir(path, progress=False)
    runner = ModelRunner.from_pretrained(
        converted, RunnerConfig(cache=CacheConfig(block_size=4, num_blocks=16))
    )
    tokens = random.Random(0).choices(range(VOCAB), k=14)
    out = runner.forward([SeqInput(block_table=[0, 1, 2, 3], token_ids=tokens, logits="all")])
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(out.logits, expected, rtol=1e-4, atol=1e-4)
