"""Shared fixtures: toy tokenizers built in-test (nothing from a hub) and the real Gemma tokenizer.

- ``toy_tokenizer``: byte-level BPE (GPT-2 style byte map) trained on a small JSON-ish corpus:
  256 byte tokens + ~40 merges + ``<pad>``, ``<eos>``, ``<eot>``; one stop token (``<eos>``).
- ``toy_tokenizer_padded``: the same vocabulary, but the model vocabulary is 37 ids larger than
  the tokenizer's (padding ids) and both ``<eos>`` and ``<eot>`` stop generation.
- ``sentencepiece_tokenizer``: sentencepiece-style BPE (``▁`` for space, ``<0xNN>`` byte fallback),
  the encoding Gemma uses.
- ``gemma_tokenizer``: the embedded default tokenizer (262,144 ids), session-scoped; tests using
  it must be marked ``@pytest.mark.model``.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import pytest
import torch

# Without CUDA, Triton code runs in its CPU interpreter. ``triton.jit`` reads TRITON_INTERPRET when
# it decorates, and that includes triton.language's own helpers (``tl.max`` ...) at triton's first
# import, so it is set here, before any test module (kernels/ or engine/models/fused.py) imports
# triton; set later, kernels mix interpreted and compiled functions and fail.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TOY_CORPUS = [
    '{"name": "Ada", "age": 36, "tags": ["math", "code"], "ok": true}',
    '{"id": 1, "value": null, "items": [1, 2, 3], "flag": false}',
    '[{"a": 1}, {"b": "two"}, {"c": [true, false, null]}]',
    "abc abab ababab 0123456789 -12.5e+3 yes no maybe",
    "hello world, the quick brown fox jumps over the lazy dog.",
    'root ::= "a" | "b"\nstart: item+\n',
] * 4
SPECIAL_TOKENS = ["<pad>", "<eos>", "<eot>"]


@cache
def build_byte_level_hf() -> Any:
    """A ~300-id byte-level BPE ``PreTrainedTokenizerFast`` with ``<eos>`` as eos token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TOY_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token=None
    )


@cache
def build_sentencepiece_hf() -> Any:
    """A sentencepiece-style BPE: ``▁`` for space, ``<0xNN>`` byte fallback, a few merges."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for token in ["<pad>", "<eos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256))]:
        vocab[token] = len(vocab)
    for char in 'abcdefghijklmnopqrstuvwxyz▁{}":,0123456789é':
        vocab.setdefault(char, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in ["▁a", "▁ab", "ab", "abc", '{"', '":', "▁t", "▁th", "▁the", "é▁"]:
        left, right = word[:-1], word[-1]
        merges.append((left, right))
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


@pytest.fixture(scope="session")
def toy_tokenizer() -> Any:
    from espalier.constrained.tokenizer import TokenizerInfo

    hf = build_byte_level_hf()
    return TokenizerInfo(hf, stop_token_ids=[hf.convert_tokens_to_ids("<eos>")], name="toy-bpe")


@pytest.fixture(scope="session")
def toy_tokenizer_padded() -> Any:
    from espalier.constrained.tokenizer import TokenizerInfo

    hf = build_byte_level_hf()
    stops = [hf.convert_tokens_to_ids("<eos>"), hf.convert_tokens_to_ids("<eot>")]
    return TokenizerInfo(hf, vocab_size=len(hf) + 37, stop_token_ids=stops, name="toy-bpe-padded")


@pytest.fixture(scope="session")
def sentencepiece_tokenizer() -> Any:
    from espalier.constrained.tokenizer import TokenizerInfo

    hf = build_sentencepiece_hf()
    return TokenizerInfo(hf, stop_token_ids=[hf.convert_tokens_to_ids("<eos>")], name="toy-sp")


@pytest.fixture(scope="session")
def gemma_tokenizer() -> Any:
    from espalier.constrained.tokenizer import TokenizerInfo

    return TokenizerInfo.default()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``slow`` tests run only with ESPALIER_SLOW=1; CI runs their representative parts."""
    if os.environ.get("ESPALIER_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow suite: set ESPALIER_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
