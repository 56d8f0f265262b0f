"""apply_bitmask_ (Triton, interpreted on CPU) against its torch twin."""

from __future__ import annotations

import pytest
import torch

from espalier.kernels import reference
from espalier.kernels.bitmask import apply_bitmask_

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_mask(rows: int, words: int, gen: torch.Generator, density: float = 0.5) -> torch.Tensor:
    bits = torch.rand(rows, words * 32, generator=gen) < density
    # whole sectors allowed / disallowed too, so every kernel branch runs
    bits[:, : words * 8] = True
    bits[:, words * 8 : words * 16] = False
    weights = 2 ** torch.arange(32, dtype=torch.int64)
    packed = (bits.view(rows, words, 32).long() * weights).sum(-1)
    return packed.to(torch.int64).where(packed < 2**31, packed - 2**32).to(torch.int32)


@pytest.mark.parametrize("vocab", [1, 31, 33, 32007])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_twin(vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(vocab)
    rows = 2 if vocab > 1000 else 5
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    mask = random_mask(rows, (vocab + 31) // 32, gen)
    ours, twin = logits.clone(), logits.clone()
    apply_bitmask_(ours, mask, backend="triton")
    reference.apply_bitmask_(twin, mask)
    assert torch.equal(ours, twin)
    allowed = reference.allowed_from_bitmask(mask, vocab)
    assert torch.equal(ours[allowed], logits[allowed])
    assert bool(torch.isneginf(ours[~allowed]).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_rows_and_strides(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    mask_vocab, model_vocab = 70, 100  # model vocabulary wider than the mask
    big = torch.randn(6, 130, generator=gen).to(dtype)
    logits = big[:, 10 : 10 + model_vocab]  # non-contiguous rows (row stride 130)
    mask = random_mask(6, 3, gen)
    reference.allowed_from_bitmask(mask, 96)  # smoke: layout helper
    mask_clipped = reference.clip_bitmask(mask, mask_vocab)
    rows = torch.tensor([4, 1, 3])
    expect = logits.clone()
    reference.apply_bitmask_(expect, mask_clipped, rows)
    before = big.clone()
    apply_bitmask_(logits, mask, rows, vocab_size=mask_vocab, backend="triton")
    assert torch.equal(logits, expect)
    assert bool(torch.isneginf(logits[4, mask_vocab:]).all())
    untouched = [0, 2, 5]
    assert torch.equal(logits[untouched], before[:, 10 : 10 + model_vocab][untouched])
    assert torch.equal(big[:, :10], before[:, :10])
    assert torch.equal(big[:, 10 + model_vocab :], before[:, 10 + model_vocab :])


def test_empty_batch_and_1d() -> None:
    logits = torch.empty(0, 40)
    apply_bitmask_(logits, torch.empty(0, 2, dtype=torch.int32), backend="triton")
    apply_bitmask_(
        torch.randn(3, 40), torch.zeros(3, 2, dtype=torch.int32), torch.empty(0, dtype=torch.long)
    )
    row = torch.randn(40)
    mask = torch.tensor([5, 0], dtype=torch.int32)  # tokens 0 and 2
    apply_bitmask_(row, mask, backend="triton")
    assert torch.isfinite(row).nonzero().flatten().tolist() == [0, 2]


def test_all_disallowed_row_is_all_neg_inf() -> None:
    logits = torch.randn(2, 33)
    apply_bitmask_(logits, torch.zeros(2, 2, dtype=torch.int32), backend="triton")
    assert bool(torch.isneginf(logits).all())


def test_torch_backend_on_cpu_matches() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 65, generator=gen)
    mask = random_mask(3, 3, gen)
    a, b = logits.clone(), logits.clone()
    apply_bitmask_(a, mask, backend="torch")
    apply_bitmask_(b, mask, backend="triton")
    assert torch.equal(a, b)


def test_rejects_bad_inputs() -> None:
    with pytest.raises(TypeError):
        apply_bitmask_(torch.randn(2, 8).long(), torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError):
        apply_bitmask_(torch.randn(3, 8), torch.zeros(2, 1, dtype=torch.int32))
