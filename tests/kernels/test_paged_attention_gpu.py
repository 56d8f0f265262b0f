"""Small-query paged attention on CUDA (bf16 tensor-core dots) against its torch twin."""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import _close, _run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("splits", [1, 5])
@pytest.mark.parametrize("tree", [False, True])
def test_cuda_matches_twin(dim: int, splits: int, tree: bool) -> None:
    q_lens = [9, 1, 4] if tree else [1, 1, 1]
    ours, want = _run(
        q_lens,
        [700, 130, 9],
        heads=32,
        kv_heads=8,
        dim=dim,
        dtype=torch.bfloat16,
        splits=splits,
        tree=tree,
        device="cuda",
    )
    _close(ours, want)


@pytest.mark.parametrize("window_left", [-1, 100])
def test_cuda_causal_chunks_match_twin(window_left: int) -> None:
    ours, want = _run(
        [16, 3, 1],
        [300, 40, 1],
        heads=8,
        kv_heads=1,
        dim=128,
        dtype=torch.bfloat16,
        splits=3,
        window_left=window_left,
        device="cuda",
        min_split=64,
    )
    _close(ours, want)
