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
from typing import Any

import pytest
import torch

from tests.fixtures import tokenizers as fixtures_tokenizers
from tests.fixtures.tokenizers import build_byte_level_hf, build_sentencepiece_hf

# Without CUDA, Triton code runs in its CPU interpreter. ``triton.jit`` reads TRITON_INTERPRET when
# it decorates, and that includes triton.language's own helpers (``tl.max`` ...) at triton's first
# import, so it is set here, before any test module (of kernels/) imports
# triton; set later, kernels mix interpreted and compiled functions and fail.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def toy_tokenizer() -> Any:
    return fixtures_tokenizers.toy_tokenizer()


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
    from espalier.server.default_model import default_tokenizer

    return default_tokenizer()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``slow`` tests run only with ESPALIER_SLOW=1; CI runs their representative parts."""
    if os.environ.get("ESPALIER_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow suite: set ESPALIER_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
