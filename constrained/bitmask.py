"""The token bitmask layout, written once; kernels and tests cite it.

A bitmask is an int32 tensor of shape ``[rows, ceil(V / 32)]`` where ``V`` is the vocabulary size
the mask covers. Token ``t`` is allowed in row ``r`` iff bit ``t % 32`` of word ``t // 32`` is 1
(bits are read from the word's two's-complement pattern, so bit 31 makes the int32 negative).
Bits at positions ``>= V`` in the last word are 0. A model vocabulary larger than ``V`` (padding
ids) is never allowed: kernels treat missing words as all-zero.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

BITS_PER_WORD = 32
DTYPE = torch.int32


def words_per_row(vocab_size: int) -> int:
    """Number of int32 words that cover ``vocab_size`` tokens."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate(
    rows: int, vocab_size: int, *, pin_memory: bool = False, fill: int = -1
) -> torch.Tensor:
    """New CPU bitmask ``int32[rows, words_per_row(vocab_size)]``, every bit ``fill``-ed.

    ``fill=-1`` allows everything, bits past V included.
    ``pin_memory`` asks for page-locked memory (only where CUDA is available).
    """
    pin = pin_memory and torch.cuda.is_available()
    out = torch.empty((rows, words_per_row(vocab_size)), dtype=DTYPE, pin_memory=pin)
    out.fill_(fill)
    return out


def pack_allowed(allowed: np.ndarray) -> np.ndarray:
    """Pack a bool vector ``[V]`` into an int32 row ``[ceil(V/32)]`` (little-endian bit order)."""
    allowed = np.asarray(allowed, dtype=bool)
    vocab_size = allowed.shape[-1]
    pad = words_per_row(vocab_size) * BITS_PER_WORD - vocab_size
    if pad:
        allowed = np.concatenate([allowed, np.zeros(allowed.shape[:-1] + (pad,), dtype=bool)], -1)
    packed = np.packbits(allowed.reshape(allowed.shape[:-1] + (-1, 8)), axis=-1, bitorder="little")
    return (
        packed.reshape(allowed.shape[:-1] + (-1, 4))
        .view(np.int32)
        .reshape(allowed.shape[:-1] + (-1,))
    )


def unpack_allowed(row: np.ndarray | torch.Tensor, vocab_size: int) -> np.ndarray:
    """Inverse of :func:`pack_allowed`: int32 ``[..., words]`` → bool ``[..., vocab_size]``."""
    arr = row.numpy() if isinstance(row, torch.Tensor) else np.asarray(row)
    arr = np.ascontiguousarray(arr, dtype=np.int32)
    bits = np.unpackbits(arr.view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


def allowed_tokens(row: np.ndarray | torch.Tensor, vocab_size: int) -> list[int]:
    """Sorted token ids allowed by one row."""
    return np.flatnonzero(unpack_allowed(row, vocab_size)).tolist()


def row_from_tokens(tokens: Iterable[int], vocab_size: int) -> np.ndarray:
    """Row allowing exactly ``tokens`` (ids must be < vocab_size)."""
    allowed = np.zeros(vocab_size, dtype=bool)
    allowed[list(tokens)] = True
    return pack_allowed(allowed)


def is_allowed(row: np.ndarray | torch.Tensor, token: int) -> bool:
    """Whether ``token`` is allowed by one row. Ids past the row's words are not allowed."""
    word = token // BITS_PER_WORD
    if token < 0 or word >= len(row):
        return False
    return bool((int(row[word]) >> (token % BITS_PER_WORD)) & 1)
