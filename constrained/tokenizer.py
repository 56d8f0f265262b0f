"""Tokenizer adapter: one object every backend builds its own vocabulary view from.

Sources: a Hugging Face tokenizer (a directory with tokenizer.json, or a transformers tokenizer
object) or the tokenizer embedded in a GGUF file. The model's vocabulary may be larger than the
tokenizer's (padding ids): those ids are never allowed by any mask.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from functools import cached_property
from pathlib import Path
from typing import Any

_cache_root: Path | None = None
# Bumped when converted tokenizer folders change (2: they keep the chat template; 3: its system
# text with no user turn after it is a turn of its own).
CONVERSION_VERSION = 3


def cache_root() -> Path:
    """The cache folder for converted tokenizers and models: the one given to
    :func:`set_cache_root` (the CLI passes ``--cache-dir`` / ``$ESPALIER_CACHE_DIR``), else
    ``~/.cache/espalier``. Library code never reads the environment itself."""
    if _cache_root is not None:
        return _cache_root
    return Path(os.path.join(Path.home(), ".cache", "espalier"))


def set_cache_root(path: str | os.PathLike[str] | None) -> None:
    """Use ``path`` as the cache folder from now on (``None``: back to the default)."""
    global _cache_root
    _cache_root = Path(path) if path is not None else None


class TokenizerInfo:
    """A tokenizer plus the facts grammar backends need.

    Attributes:
        hf: the transformers ``PreTrainedTokenizerFast``.
        vocab_size: model vocabulary size V (>= ``tokenizer_vocab_size``); rows: ceil(V/32) words.
        tokenizer_vocab_size: number of ids the tokenizer defines.
        stop_token_ids: ids that end generation (eos and friends), all < tokenizer_vocab_size.
        fingerprint: stable hash identifying tokenizer + vocab size + stops (compile cache key).
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        vocab_size: int | None = None,
        stop_token_ids: list[int] | tuple[int, ...] | None = None,
        name: str = "",
    ) -> None:
        self.hf = hf_tokenizer
        self.tokenizer_vocab_size = len(hf_tokenizer)
        self.vocab_size = max(vocab_size or 0, self.tokenizer_vocab_size)
        if stop_token_ids is None:
            stop_token_ids = _default_stop_ids(hf_tokenizer)
        stops = tuple(sorted({int(t) for t in stop_token_ids}))
        for t in stops:
            if not 0 <= t < self.tokenizer_vocab_size:
                raise ValueError(f"stop token id {t} outside the tokenizer vocabulary")
        if not stops:
            raise ValueError("a tokenizer needs at least one stop token id")
        self.stop_token_ids = stops
        self.name = name or type(hf_tokenizer).__name__
        self._lock = threading.Lock()
        self._backend_views: dict[str, Any] = {}

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        vocab_size: int | None = None,
        stop_token_ids: list[int] | None = None,
    ) -> TokenizerInfo:
        """From a local Hugging Face directory (tokenizer.json [+ tokenizer_config.json])."""
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return cls(hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids, name=str(path))

    @classmethod
    def from_gguf(
        cls, gguf_path: str | os.PathLike[str], *, vocab_size: int | None = None
    ) -> TokenizerInfo:
        """From the tokenizer embedded in a GGUF file; converted once and cached on disk."""
        target = converted_gguf_tokenizer_dir(gguf_path)
        info = cls.from_pretrained(target, vocab_size=vocab_size)
        info.name = f"gguf:{Path(gguf_path).name}"
        return info

    # -- facts --------------------------------------------------------------------------------

    @cached_property
    def fingerprint(self) -> str:
        backend = getattr(self.hf, "backend_tokenizer", None)
        text = (
            backend.to_str() if backend is not None else repr(sorted(self.hf.get_vocab().items()))
        )
        digest = hashlib.sha256(text.encode("utf-8"))
        digest.update(f"|{self.vocab_size}|{self.stop_token_ids}".encode())
        return digest.hexdigest()[:24]

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(int(t) for t in self.hf.all_special_ids)

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """Raw bytes of every tokenizer id (special tokens give their text). Index = token id."""
        from espalier.constrained.token_bytes import decode_vocabulary

        return decode_vocabulary(self.hf)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens added (no BOS); a special token's
        spelling in ``text`` (``<start_of_turn>`` in a rendered chat) becomes that token."""
        ids: list[int] = self.hf.encode(text, add_special_tokens=False)
        return ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` as plain text: a special token's spelling is spelled in ordinary
        tokens, never that token. For grammar and output text (forced literals, replays,
        closing paths): the matchers never take a special non-stop token, so a grammar literal
        ``<start_of_turn>`` tokenized to it could never be written."""
        ids: list[int] = self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)
        return ids

    def decode(self, ids: list[int]) -> str:
        text: str = self.hf.decode(ids, skip_special_tokens=False)
        return text

    def backend_view(self, key: str, build: Any) -> Any:
        """Per-backend vocabulary object, built once (thread-safe) by ``build(self)``."""
        with self._lock:
            view = self._backend_views.get(key)
            if view is None:
                view = build(self)
                self._backend_views[key] = view
            return view

    def __repr__(self) -> str:
        return (
            f"TokenizerInfo({self.name}, vocab={self.tokenizer_vocab_size}, "
            f"model_vocab={self.vocab_size}, stops={self.stop_token_ids})"
        )


def _default_stop_ids(hf: Any) -> list[int]:
    stops: list[int] = []
    if hf.eos_token_id is not None:
        stops.append(int(hf.eos_token_id))
    vocab = hf.get_vocab()
    for text in ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end_of_text|>", "<|endoftext|>"):
        if text in vocab:
            stops.append(int(vocab[text]))
    return stops


def converted_gguf_tokenizer_dir(gguf_path: str | os.PathLike[str]) -> Path:
    """Convert a GGUF file's tokenizer to a HF directory once; return the cached directory.

    The directory keeps the file's chat template (``chat_templates.gguf_chat_template``). The
    cache key is the GGUF file's name, size and mtime plus the conversion's version. Conversion
    takes ~20-40 s for a 262k vocabulary; later calls return at once.
    """
    path = Path(gguf_path)
    stat = path.stat()
    key = hashlib.sha256(
        f"{path.resolve()}|{stat.st_size}|{int(stat.st_mtime)}|{CONVERSION_VERSION}".encode()
    ).hexdigest()
    target = cache_root() / "tokenizers" / f"{path.stem}-{key[:12]}"
    if (target / "tokenizer.json").exists():
        return target
    from transformers import AutoTokenizer

    from espalier.constrained.chat_templates import gguf_chat_template

    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf.chat_template = gguf_chat_template(path)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    hf.save_pretrained(str(tmp))
    target.parent.mkdir(parents=True, exist_ok=True)
    # Another process may have won the race; its result is equivalent.
    with contextlib.suppress(OSError):
        os.replace(tmp, target)
    return target
