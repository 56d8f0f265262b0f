"""Backends and token bytes on the real Gemma 3 tokenizer (262,144 ids, sentencepiece-style)."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest

from espalier.constrained import bitmask as bm
from espalier.constrained.backends import BACKENDS, get_backend
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.token_bytes import decode_vocabulary, decoder_kind, special_token_ids

pytestmark = pytest.mark.model

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
INSTANCE = {"city": "Zürich", "population": 421878, "tags": ["lake", "alps"]}


def mask_of(matcher: Any) -> np.ndarray:
    row = bm.allocate(1, matcher.vocab_size, fill=0)
    matcher.fill_bitmask(row, 0)
    return bm.unpack_allowed(row[0], matcher.vocab_size)


def test_token_bytes_match_the_decoder(gemma_tokenizer: Any) -> None:
    hf = gemma_tokenizer.hf
    assert decoder_kind(hf) == "sentencepiece"
    vocab = decode_vocabulary(hf)
    assert len(vocab) == gemma_tokenizer.tokenizer_vocab_size == 262_144
    assert vocab is not gemma_tokenizer.token_bytes  # decode_vocabulary builds afresh
    assert gemma_tokenizer.token_bytes == vocab
    specials = special_token_ids(hf)
    assert {0, 1, 2, 106} <= specials
    byte_tokens = hf.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)])
    assert [vocab[t] for t in byte_tokens] == [bytes([b]) for b in range(256)]
    rng = random.Random(0)
    sample = [t for t in rng.sample(range(len(vocab)), 3000) if t not in specials]
    for token in sample:
        assert vocab[token].decode("utf-8", "replace") == hf.decode([token]), token
    text = 'A {"key": [1, 2]}\n\tü€😀'
    ids = gemma_tokenizer.encode(text)
    assert b"".join(vocab[t] for t in ids) == text.encode("utf-8")


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_json_schema_on_gemma(backend_name: str, gemma_tokenizer: Any) -> None:
    compiled = get_backend(backend_name, gemma_tokenizer).compile(GrammarSpec.json_schema(SCHEMA))
    matcher = compiled.matcher()
    start = mask_of(matcher)
    brace = gemma_tokenizer.encode("{")[0]
    assert start[brace] and not start[gemma_tokenizer.encode("a")[0]]
    assert not start[list(gemma_tokenizer.stop_token_ids)].any()
    tokens = gemma_tokenizer.encode(json.dumps(INSTANCE, ensure_ascii=False))
    rng = random.Random(1)
    for step, token in enumerate(tokens):
        mask = mask_of(matcher)
        assert mask[token], f"step {step}: the valid token {token} is masked"
        # spot-check the mask against accept on a sample of ids (a full sweep is 262k forks)
        probe_ids = rng.sample(range(gemma_tokenizer.vocab_size), 40)
        probe_ids += np.flatnonzero(mask)[:20].tolist()
        native = matcher.native
        narrowed = hasattr(native, "compute_ff_bytes") and bool(native.compute_ff_bytes())
        for probe in probe_ids:
            accepted = matcher.fork().accept(probe)
            if narrowed:
                assert accepted or not mask[probe]
            else:
                assert accepted == mask[probe], f"step {step}, token {probe}"
        assert matcher.accept(token)
    assert matcher.can_terminate()
    assert np.flatnonzero(mask_of(matcher)).tolist() == list(gemma_tokenizer.stop_token_ids)
    assert matcher.accept(gemma_tokenizer.stop_token_ids[-1]) and matcher.is_terminated()


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_regex_and_forced_tokens_on_gemma(backend_name: str, gemma_tokenizer: Any) -> None:
    spec = GrammarSpec.regex(r"Order number: [0-9]{3}-[0-9]{4}\.")
    matcher = get_backend(backend_name, gemma_tokenizer).compile(spec).matcher()
    text = "Order number: 555-1234."
    canonical = gemma_tokenizer.encode(text)
    forced = matcher.forced_tokens(16)
    assert forced and forced == canonical[: len(forced)]
    for token in canonical:
        assert matcher.accept(token)
    assert matcher.can_terminate()
    bad = matcher.fork()
    bad.rollback(2)
    assert not bad.accept(gemma_tokenizer.encode("x")[0]) and not bad.can_terminate()
