"""Raw bytes of every token id of a Hugging Face tokenizer.

Grammar backends match bytes, not token strings. Tokenizers store tokens in an encoded form:

- byte-level BPE (GPT-2, Llama 3, Qwen): every byte is mapped to a printable character
  (``Ġ`` for a space); the decoder is ``ByteLevel``.
- sentencepiece-style (Llama 2, Gemma): ``▁`` stands for a space and ``<0xNN>`` tokens are the
  byte fallback; the decoder has ``Replace('▁', ' ')`` / ``Metaspace`` and ``ByteFallback``.
- added tokens (special or not): their content is the text itself.

:func:`decode_vocabulary` undoes the encoding for every id (a few seconds at most for a 262k vocab);
:func:`special_token_ids` lists the control tokens a grammar must never match as text.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def byte_level_decoder_map() -> dict[str, int]:
    """The inverse of GPT-2's byte → printable-character map: character → byte value."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def decoder_kind(hf_tokenizer: Any) -> str:
    """``"byte_level"``, ``"sentencepiece"`` or ``"plain"`` from the tokenizer's decoder."""
    decoder = _decoder_json(hf_tokenizer)
    kinds = {d.get("type") for d in _flatten(decoder)}
    if "ByteLevel" in kinds:
        return "byte_level"
    if kinds & {"ByteFallback", "Metaspace"} or any(
        _replace_pair(d) == ("▁", " ") for d in _flatten(decoder)
    ):
        return "sentencepiece"
    return "plain"


def decode_vocabulary(hf_tokenizer: Any) -> list[bytes]:
    """Bytes of every id ``0 .. len(hf_tokenizer) - 1``; index = token id.

    Added tokens (including special ones such as ``<eos>``) give their content as UTF-8; callers
    that must not match control tokens as text exclude :func:`special_token_ids`.
    """
    n = len(hf_tokenizer)
    pieces: list[str | None] = hf_tokenizer.convert_ids_to_tokens(list(range(n)))
    added = {int(i): tok.content for i, tok in hf_tokenizer.added_tokens_decoder.items()}
    kind = decoder_kind(hf_tokenizer)
    if kind == "byte_level":
        convert = _byte_level_converter()
    elif kind == "sentencepiece":
        convert = _sentencepiece_converter()
    else:
        convert = _plain_converter()
    out: list[bytes] = []
    for token_id, piece in enumerate(pieces):
        content = added.get(token_id)
        if content is not None:
            out.append(content.encode("utf-8"))
        elif piece is None:
            out.append(b"")
        else:
            out.append(convert(piece))
    return out


def special_token_ids(hf_tokenizer: Any) -> frozenset[int]:
    """Ids of control tokens: added tokens flagged special plus the tokenizer's named specials."""
    ids = {int(i) for i, tok in hf_tokenizer.added_tokens_decoder.items() if tok.special}
    ids.update(int(i) for i in hf_tokenizer.all_special_ids if i is not None)
    n = len(hf_tokenizer)  # len() is slow on large vocabularies: once
    return frozenset(i for i in ids if 0 <= i < n)


# -- converters ------------------------------------------------------------------------------


def _byte_level_converter() -> Any:
    table = byte_level_decoder_map()

    def convert(piece: str) -> bytes:
        try:
            return bytes(table[c] for c in piece)
        except KeyError:  # a token outside the byte alphabet: take its text as is
            return piece.encode("utf-8")

    return convert


def _sentencepiece_converter() -> Any:
    def convert(piece: str) -> bytes:
        match = _BYTE_FALLBACK.match(piece)
        if match is not None:
            return bytes([int(match.group(1), 16)])
        return piece.replace("▁", " ").encode("utf-8")

    return convert


def _plain_converter() -> Any:
    def convert(piece: str) -> bytes:
        return piece.encode("utf-8")

    return convert


# -- decoder JSON ----------------------------------------------------------------------------


def _decoder_json(hf_tokenizer: Any) -> dict[str, Any]:
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    if decoder is None:
        return {}
    state: dict[str, Any] = json.loads(decoder.__getstate__())
    return state


def _flatten(decoder: dict[str, Any]) -> list[dict[str, Any]]:
    if decoder.get("type") == "Sequence":
        return [d for sub in decoder.get("decoders", []) for d in _flatten(sub)]
    return [decoder] if decoder else []


def _replace_pair(decoder: dict[str, Any]) -> tuple[str, str] | None:
    if decoder.get("type") != "Replace":
        return None
    pattern = decoder.get("pattern", {})
    if "String" not in pattern:
        return None
    return (pattern["String"], decoder.get("content", ""))
