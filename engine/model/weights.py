"""Model weights and tokenizers from a local HF directory, a GGUF file, or the embedded default.

HF directory: ``config.json`` + ``*.safetensors`` (sharded or not) + tokenizer files.
GGUF file: converted once (dequantized, fp32) into an HF directory under
``<cache_root>/models/<stem>-<key>/`` with a progress bar; later loads read that directory.
(The CLI's ``default`` model is resolved to a GGUF path in ``server/default_model.py``.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from espalier.engine.config import ModelConfig

if TYPE_CHECKING:
    from espalier.constrained.tokenizer import TokenizerInfo

# prefixes of multimodal checkpoints whose text backbone we load (new and old HF layouts)
_TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_SKIP_PREFIXES = (
    "model.vision_tower.",
    "vision_tower.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
)


def resolve_model_dir(path: str | os.PathLike[str]) -> Path:
    """The HF directory to load for ``path``: itself, or the converted cache of a GGUF file."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return converted_gguf_dir(p)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if not (p / "config.json").exists() and len(ggufs) == 1:
            return converted_gguf_dir(ggufs[0])
        if (p / "config.json").exists():
            return p
    raise FileNotFoundError(f"{path}: neither an HF model directory nor a .gguf file")


def load_weights(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, state dict with HF parameter names, CPU tensors in the checkpoint dtype)."""
    model_dir = resolve_model_dir(path)
    config = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    return config, load_safetensors_dir(model_dir)


def load_tokenizer(path: str | os.PathLike[str], vocab_size: int | None = None) -> TokenizerInfo:
    """The tokenizer of a model (HF dir or GGUF file), sized to the model's vocab."""
    from espalier.constrained.tokenizer import TokenizerInfo

    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return TokenizerInfo.from_gguf(p, vocab_size=vocab_size)
    return TokenizerInfo.from_pretrained(resolve_model_dir(p), vocab_size=vocab_size)


def load_safetensors_dir(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``*.safetensors`` in ``model_dir`` (memory-mapped), text-backbone names."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            if name.startswith(_SKIP_PREFIXES):
                continue
            for old, new in _TEXT_PREFIXES:
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            state[name] = tensor
    return state


def converted_gguf_dir(gguf_path: Path, *, progress: bool = True) -> Path:
    """Convert ``gguf_path`` once into an HF directory (config.json, model.safetensors in fp32,
    tokenizer files) under the cache root; return it. Keyed by path, size and mtime."""
    from espalier.constrained.tokenizer import cache_root, converted_gguf_tokenizer_dir

    stat = gguf_path.stat()
    ident = f"{gguf_path.resolve()}|{stat.st_size}|{int(stat.st_mtime)}|v1"
    key = hashlib.sha256(ident.encode()).hexdigest()[:12]
    target = cache_root() / "models" / f"{gguf_path.stem}-{key}"
    if (target / "config.json").exists():
        return target
    from safetensors.torch import save_file

    from espalier.engine.model.gguf_loader import load_gguf

    cfg, state = load_gguf(gguf_path, progress=progress)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp / "model.safetensors"))
    tokenizer_dir = converted_gguf_tokenizer_dir(gguf_path)
    for file in tokenizer_dir.iterdir():
        if file.is_file():
            shutil.copy2(file, tmp / file.name)
    # config.json last: its presence marks a complete conversion
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished first; its result is equivalent
        shutil.rmtree(tmp, ignore_errors=True)
    return target
