"""The bitmask layout contract: packing, unpacking, padding bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from espalier.constrained import bitmask
from espalier.constrained.tree.walk import clear_tail


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 64, 100, 32_007])
def test_pack_unpack_roundtrip(vocab_size: int) -> None:
    rng = np.random.default_rng(vocab_size)
    allowed = rng.random(vocab_size) < 0.3
    row = bitmask.pack_allowed(allowed)
    assert row.dtype == np.int32
    assert row.shape == (bitmask.words_per_row(vocab_size),)
    np.testing.assert_array_equal(bitmask.unpack_allowed(row, vocab_size), allowed)
    # Bits past the vocabulary are zero.
    tail = bitmask.unpack_allowed(row, row.shape[0] * 32)[vocab_size:]
    assert not tail.any()


def test_bit_order_is_token_mod_32_of_word_token_div_32() -> None:
    row = bitmask.row_from_tokens([0, 31, 32, 40], 41)
    assert row[0] == np.int32(-(2**31) + 1)  # bits 0 and 31
    assert row[1] == (1 << 0) | (1 << 8)
    assert bitmask.allowed_tokens(row, 41) == [0, 31, 32, 40]
    assert bitmask.is_allowed(row, 31) and not bitmask.is_allowed(row, 30)
    assert not bitmask.is_allowed(row, 64)  # beyond the row: never allowed
    assert not bitmask.is_allowed(row, -1)


def test_allocate_and_clear_tail() -> None:
    mask = bitmask.allocate(3, 70)
    assert mask.dtype == torch.int32 and mask.shape == (3, 3)
    clear_tail(mask.numpy(), 70)
    for r in range(3):
        assert bitmask.allowed_tokens(mask[r], 96) == list(range(70))
    np.testing.assert_array_equal(bitmask.row_from_tokens(range(70), 70), mask[0].numpy())


def test_multirow_pack() -> None:
    allowed = np.zeros((2, 40), dtype=bool)
    allowed[0, 3] = allowed[1, 39] = True
    rows = bitmask.pack_allowed(allowed)
    assert rows.shape == (2, 2)
    assert bitmask.allowed_tokens(rows[0], 40) == [3]
    assert bitmask.allowed_tokens(rows[1], 40) == [39]
