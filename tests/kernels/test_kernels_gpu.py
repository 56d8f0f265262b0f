"""The kernels on CUDA against their torch twins (skipped without a GPU)."""

from __future__ import annotations

import random

import pytest
import torch
from test_apply_bitmask import random_mask

from espalier.kernels import reference
from espalier.kernels.bitmask import apply_bitmask_
from espalier.kernels.sampling import SamplingTensors, sample
from espalier.kernels.verify import verify_greedy
from tests.fixtures.kernel_trees import batch_of_trees

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("vocab", [1, 33, 32007, 151936, 262144])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_cuda_matches_twin(vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(vocab)
    rows = 7
    logits = torch.randn(rows, vocab + 64, generator=gen).to(dtype)[:, :vocab]
    mask = random_mask(rows, (vocab + 31) // 32, gen, density=0.3)
    twin = logits.clone()
    reference.apply_bitmask_(twin, mask)
    ours = logits.cuda()
    apply_bitmask_(ours, mask.cuda())
    assert torch.equal(ours.cpu(), twin)
    rows_idx = torch.tensor([5, 0, 2])
    twin = logits.clone()
    reference.apply_bitmask_(twin, mask, rows_idx)
    ours = logits.cuda()
    apply_bitmask_(ours, mask.cuda(), rows_idx.cuda())
    assert torch.equal(ours.cpu(), twin)


@pytest.mark.parametrize("vocab", [33, 32007, 151936])
def test_verify_cuda_matches_twin(vocab: int) -> None:
    rng = random.Random(vocab)
    gen = torch.Generator().manual_seed(vocab)
    big = vocab > 100_000
    for trial in range(4 if big else 8):
        sizes = [rng.randint(1, 16 if big else 64) for _ in range(rng.randint(1, 3 if big else 8))]
        fc, ns, tok, offsets = batch_of_trees(rng, sizes, 4)
        n = offsets[-1]
        dtype = [torch.float32, torch.bfloat16][trial % 2]
        logits = torch.randint(0, 3, (n, vocab), generator=gen).to(dtype)
        mask = torch.randint(-(2**31), 2**31, (n, (vocab + 31) // 32), generator=gen).to(
            torch.int32
        )
        mask[:, 0] |= 0xF
        mask_rows = torch.arange(n)
        mask_rows[torch.rand(n, generator=gen) < 0.3] = -1
        valid = torch.rand(n, generator=gen) < 0.9
        kw = dict(bitmask=mask, mask_rows=mask_rows, valid=valid)
        twin = verify_greedy(logits, fc, ns, tok, offsets, backend="torch", **kw)  # type: ignore[arg-type]
        cuda_kw = {k: v.cuda() for k, v in kw.items()}
        ours = verify_greedy(logits.cuda(), fc.cuda(), ns.cuda(), tok.cuda(), offsets, **cuda_kw)
        for name in ("argmax", "path", "accept_length", "bonus_token"):
            assert torch.equal(getattr(ours, name).cpu(), getattr(twin, name)), name


@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
def test_sampling_cuda_distribution(backend: str) -> None:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    from scipy.stats import chisquare

    vocab, draws = 40, 40000
    gen = torch.Generator().manual_seed(0)
    row = torch.randn(1, vocab, generator=gen) * 2
    mask = random_mask(1, 2, gen, density=0.6)
    mask[0, 0] = -1
    params = SamplingTensors.build(draws, "cuda", temperature=0.8, top_k=20, top_p=0.9, min_p=0.02)
    allowed = reference.allowed_from_bitmask(mask, vocab)
    probs = reference.processed_probs(
        row, allowed, params.temperature[:1].cpu(), params.top_k[:1].cpu(),
        params.top_p[:1].cpu(), params.min_p[:1].cpu(),
    )[0].double()  # fmt: skip
    logits = row.expand(draws, vocab).contiguous().cuda()
    out = sample(
        logits, params, torch.Generator("cuda").manual_seed(1),
        bitmask=mask.cuda().expand(draws, 2).contiguous(), backend=backend,
    ).cpu()  # fmt: skip
    assert bool(allowed[0, out].all()) and bool((probs[out] > 0).all())
    counts = torch.bincount(out, minlength=vocab).double()
    support = probs > 0
    _, pvalue = chisquare(counts[support], probs[support] / probs[support].sum() * draws)
    assert pvalue > 1e-3
