"""Fused masked greedy tree verification (Triton, interpreted) against its torch twin."""

from __future__ import annotations

import random

import pytest
import torch

from espalier.constrained.bitmask import pack_allowed
from espalier.kernels import reference
from espalier.kernels.verify import verify_greedy
from tests.fixtures.kernel_trees import batch_of_trees


def run_both(**kw: object) -> tuple[reference.VerifyResult, reference.VerifyResult]:
    ours = verify_greedy(backend="triton", **kw)  # type: ignore[arg-type]
    twin = verify_greedy(backend="torch", **kw)  # type: ignore[arg-type]
    return ours, twin


def assert_same(a: reference.VerifyResult, b: reference.VerifyResult) -> None:
    for name in ("argmax", "path", "accept_length", "bonus_token"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_hand_tree() -> None:
    r"""Root argmax 5 → child 2 (token 5; child 1 has token 4); child 2's argmax 7 → node 3.

        0
       / \
      1:4 2:5
           \
            3:7 → bonus = argmax(3) = 1
    """
    vocab = 8
    logits = torch.full((4, vocab), -1.0)
    logits[0, 5] = logits[2, 7] = logits[3, 1] = 3.0
    logits[1, 0] = 3.0
    logits[0, 4] = 2.0
    fc = torch.tensor([1, -1, 3, -1])
    ns = torch.tensor([-1, 2, -1, -1])
    tok = torch.tensor([0, 4, 5, 7])
    res, twin = run_both(logits=logits, first_child=fc, next_sibling=ns, tokens=tok, offsets=[0, 4])
    assert_same(res, twin)
    assert res.path.tolist() == [[0, 2, 3, -1]]
    assert res.accept_length.tolist() == [2]
    assert res.bonus_token.tolist() == [1]
    # the mask forbids token 5 at the root: next best allowed is 4 → child 1, whose argmax is 0
    mask = torch.tensor([[~(1 << 5)], [-1], [-1], [-1]], dtype=torch.int32)
    res, twin = run_both(
        logits=logits, first_child=fc, next_sibling=ns, tokens=tok, offsets=[0, 4], bitmask=mask
    )
    assert_same(res, twin)
    assert res.path.tolist() == [[0, 1, -1, -1]] and res.bonus_token.tolist() == [0]
    # node 2 not filled: never accepted, and its argmax is -1
    res, twin = run_both(
        logits=logits, first_child=fc, next_sibling=ns, tokens=tok, offsets=[0, 4],
        filled=torch.tensor([True, True, False, True]),
    )  # fmt: skip
    assert_same(res, twin)
    assert res.accept_length.tolist() == [0] and res.argmax[2].item() == -1


def test_ties_pick_lowest_id_and_all_disallowed_gives_minus_one() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[0b1100], [0]], dtype=torch.int32)
    fc = torch.tensor([-1, -1])
    res, twin = run_both(
        logits=logits, first_child=fc, next_sibling=fc, tokens=fc.abs(), offsets=[0, 1, 2],
        bitmask=mask,
    )  # fmt: skip
    assert_same(res, twin)
    assert res.argmax.tolist() == [2, -1]
    assert res.bonus_token.tolist() == [2, -1]


@pytest.mark.parametrize("vocab", [1, 31, 33, 32007])
def test_random_trees_match_twin(vocab: int) -> None:
    rng = random.Random(vocab)
    gen = torch.Generator().manual_seed(vocab)
    small = vocab > 1000
    for trial in range(2 if small else 5):
        sizes = [
            rng.randint(1, 6 if small else 10) for _ in range(rng.randint(1, 3 if small else 5))
        ]
        fc, ns, tok, offsets = batch_of_trees(rng, sizes, min(vocab, 4))
        n = offsets[-1]
        dtype = [torch.float32, torch.bfloat16, torch.float16][trial % 3]
        # few distinct values so ties and matches are frequent
        logits = torch.randint(0, 3, (n, vocab), generator=gen).to(dtype)
        words = (vocab + 31) // 32
        mask = torch.randint(-(2**31), 2**31, (n, words), generator=gen, dtype=torch.int64)
        mask = mask.to(torch.int32)
        mask[:, 0] |= 0xF  # the drafted tokens (< 4) are often allowed
        mask[torch.rand(n, generator=gen) < 0.1] = 0  # all-disallowed rows
        mask_rows = torch.arange(n)
        mask_rows[torch.rand(n, generator=gen) < 0.3] = -1  # unconstrained rows mixed in
        valid = torch.rand(n, generator=gen) < 0.9
        filled = torch.rand(n, generator=gen) < 0.9
        res, twin = run_both(
            logits=logits, first_child=fc, next_sibling=ns, tokens=tok, offsets=offsets,
            bitmask=mask, mask_rows=mask_rows, valid=valid, filled=filled,
        )  # fmt: skip
        assert_same(res, twin)


def test_padding_vocab_limit_and_strided_logits() -> None:
    rng = random.Random(5)
    fc, ns, tok, offsets = batch_of_trees(rng, [7, 3], 4)
    big = torch.randn(10, 120)
    logits = big[:, :100]  # row stride 120
    logits[:, 90:] = 100.0  # padding ids with huge logits must never win
    mask = torch.full((10, 3), -1, dtype=torch.int32)  # the mask covers 96 ids
    res, twin = run_both(
        logits=logits, first_child=fc, next_sibling=ns, tokens=tok, offsets=offsets,
        bitmask=mask, vocab_size=90,
    )  # fmt: skip
    assert_same(res, twin)
    assert bool((res.argmax < 90).all())


def test_offsets_tensor_and_empty_batch() -> None:
    rng = random.Random(9)
    fc, ns, tok, offsets = batch_of_trees(rng, [4, 5], 3)
    logits = torch.randn(9, 40)
    a = verify_greedy(logits, fc, ns, tok, torch.tensor(offsets), max_nodes=5, backend="triton")
    b = verify_greedy(logits, fc, ns, tok, offsets, backend="torch")
    assert_same(a, b)
    empty = verify_greedy(torch.empty(0, 40), fc[:0], ns[:0], tok[:0], [0], backend="triton")
    assert empty.path.shape == (0, 0) and empty.bonus_token.numel() == 0


def test_allowed_minus_inf_beats_disallowed_finite() -> None:
    """Allowed logits all -inf: the lowest allowed id wins (torch.argmax on the masked row)."""
    vocab = 600  # several blocks and splits on the interpreter
    logits = torch.randn(3, vocab)
    logits[0, 100:110] = float("-inf")
    logits[1, :] = float("-inf")
    allowed = torch.zeros(3, vocab, dtype=torch.bool)
    allowed[0, 100:110] = True
    allowed[1, 500] = True
    allowed[2, 590:] = True
    words = torch.from_numpy(pack_allowed(allowed.numpy()))
    none = torch.full((3,), -1)
    res, twin = run_both(
        logits=logits, first_child=none, next_sibling=none, tokens=none, offsets=[0, 1, 2, 3],
        bitmask=words,
    )  # fmt: skip
    assert_same(res, twin)
    expected_2 = 590 + int(logits[2, 590:].argmax())
    assert res.argmax.tolist() == [100, 500, expected_2]
