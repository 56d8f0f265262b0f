"""Raw token bytes of toy byte-level and sentencepiece-style tokenizers."""

from __future__ import annotations

from typing import Any

import pytest

from espalier.constrained.token_bytes import (
    byte_level_decoder_map,
    decode_vocabulary,
    decoder_kind,
    special_token_ids,
)

TEXTS = ['{"name": "Ada", "age": 36}', "the abc é x\n\t", "ünïcødé 😀 ∑", "\x00\x1f"]


def test_byte_level_map_is_a_bijection() -> None:
    table = byte_level_decoder_map()
    assert len(table) == 256 and sorted(table.values()) == list(range(256))
    assert table["Ġ"] == ord(" ") and table["Ċ"] == ord("\n") and table["!"] == ord("!")


@pytest.mark.parametrize("fixture", ["toy_tokenizer", "sentencepiece_tokenizer"])
def test_token_bytes_reassemble_text(fixture: str, request: pytest.FixtureRequest) -> None:
    tokenizer: Any = request.getfixturevalue(fixture)
    vocab = decode_vocabulary(tokenizer.hf)
    assert len(vocab) == tokenizer.tokenizer_vocab_size
    assert tokenizer.token_bytes == vocab
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert b"".join(vocab[t] for t in ids) == text.encode("utf-8"), text


def test_byte_level_tokens(toy_tokenizer: Any) -> None:
    hf = toy_tokenizer.hf
    assert decoder_kind(hf) == "byte_level"
    vocab = toy_tokenizer.token_bytes
    assert vocab[hf.convert_tokens_to_ids("Ġ")] == b" "
    assert vocab[hf.convert_tokens_to_ids('Ġ{"')] == b' {"'
    assert vocab[hf.convert_tokens_to_ids("<eos>")] == b"<eos>"
    assert {hf.convert_tokens_to_ids(t) for t in ("<pad>", "<eos>", "<eot>")} == set(
        special_token_ids(hf)
    )


def test_sentencepiece_tokens(sentencepiece_tokenizer: Any) -> None:
    hf = sentencepiece_tokenizer.hf
    assert decoder_kind(hf) == "sentencepiece"
    vocab = sentencepiece_tokenizer.token_bytes
    for byte in (0, 0x0A, 0x41, 0xC3, 0xFF):
        assert vocab[hf.convert_tokens_to_ids(f"<0x{byte:02X}>")] == bytes([byte])
    assert vocab[hf.convert_tokens_to_ids("▁the")] == b" the"
    assert vocab[hf.convert_tokens_to_ids("é▁")] == "é ".encode()
    assert vocab[hf.convert_tokens_to_ids("<unk>")] == b"<unk>"
    ids = sentencepiece_tokenizer.encode("😀")  # not in the vocab: four byte-fallback tokens
    assert len(ids) == 4 and b"".join(vocab[t] for t in ids) == "😀".encode()
