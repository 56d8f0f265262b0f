"""Small-query paged attention (Triton, interpreted on CPU) against its torch twin, and the twin
against dense attention over gathered K/V."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from espalier.kernels import paged_attention as pa
from espalier.kernels import reference
from espalier.kernels.options import DEFAULT_KERNELS, AttentionLaunch, KernelOptions

PAGE = 4
CPU = torch.device("cpu")


def _cache(
    slots: int, kv_heads: int, dim: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    return k, v


def _tables(kv_lens: list[int], num_pages: int, gen: torch.Generator) -> list[list[int]]:
    """Disjoint, shuffled pages per sequence (one spare page each)."""
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables, used = [], 0
    for n in kv_lens:
        pages = -(-n // PAGE) + 1
        tables.append(order[used : used + pages])
        used += pages
    return tables


def _tree_masks(q_lens: list[int], kv_lens: list[int], gen: torch.Generator) -> list[np.ndarray]:
    """Per sequence a draft-tree mask [q_len, kv_len]: the context, then each node's ancestors
    (a random parent before it) and itself."""
    masks = []
    for q_len, kv_len in zip(q_lens, kv_lens):
        ctx = kv_len - q_len
        mask = np.zeros((q_len, kv_len), dtype=bool)
        mask[:, :ctx] = True
        for node in range(q_len):
            mask[node, ctx + node] = True
            if node:
                parent = int(torch.randint(0, node, (1,), generator=gen))
                mask[node, ctx : ctx + node] = mask[parent, ctx : ctx + node]
        masks.append(mask.ravel())
    return masks


def _packed(segments: list[np.ndarray], kv_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    words, offsets = pa.pack_row_masks(segments, kv_lens)
    return torch.from_numpy(words), torch.from_numpy(offsets)


def _close(ours: torch.Tensor, want: torch.Tensor) -> None:
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[want.dtype]
    torch.testing.assert_close(ours.float(), want.float(), rtol=tol, atol=tol)


def _run(
    q_lens: list[int],
    kv_lens: list[int],
    *,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    splits: int,
    window_left: int = -1,
    tree: bool = False,
    seed: int = 0,
    device: str = "cpu",
    min_split: int = pa.MIN_SPLIT,
    options: KernelOptions = DEFAULT_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's output, the twin's) for one step on ``device`` (the twin on the CPU);
    ``min_split``: the fewest entries per split (small, to split short sequences); ``options``:
    the launch paths of the plan and the kernel."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // PAGE) + 1 for n in kv_lens) + 8
    tables = _tables(kv_lens, num_pages, gen)
    k, v = _cache(num_pages * PAGE, kv_heads, dim, dtype, gen)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen).to(dtype)
    mask = _packed(_tree_masks(q_lens, kv_lens, gen), kv_lens) if tree else None
    dev = torch.device(device)
    plan = pa.make_plan(
        q_lens,
        kv_lens,
        tables,
        PAGE,
        head_dim=dim,
        splits=splits,
        device=dev,
        min_split=min_split,
        options=options,
    )
    scale = dim**-0.5
    ours = pa.paged_attention(
        q.to(dev),
        k.to(dev),
        v.to(dev),
        plan,
        page_size=PAGE,
        scale=scale,
        window_left=window_left,
        mask=None if mask is None else (mask[0].to(dev), mask[1].to(dev)),
        backend="triton",
        options=options,
    ).cpu()
    meta = plan.meta.tolist()
    b = len(q_lens)
    want = reference.paged_attention(
        q,
        k,
        v,
        meta[: b + 1],
        meta[b + 1 : 2 * b + 2],
        plan.kv_indices.tolist(),
        kv_lens,
        page_size=PAGE,
        scale=scale,
        window_left=window_left,
        mask=None if mask is None else (mask[0], mask[1].tolist()),
    )
    return ours, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_rows_match_the_twin(dtype: torch.dtype, splits: int) -> None:
    ours, want = _run(
        [1, 1, 1, 1],
        [1, 37, 130, 64],
        heads=8,
        kv_heads=2,
        dim=16,
        dtype=dtype,
        splits=splits,
        min_split=16,
    )
    _close(ours, want)


@pytest.mark.parametrize("splits", [1, 4])
def test_tree_rows_match_the_twin(splits: int) -> None:
    ours, want = _run(
        [5, 1, 9, 3],
        [40, 17, 90, 3],
        heads=4,
        kv_heads=1,
        dim=32,
        dtype=torch.float32,
        splits=splits,
        tree=True,
        seed=1,
        min_split=16,
    )
    _close(ours, want)


@pytest.mark.parametrize("window_left", [-1, 0, 5, 40])
def test_causal_chunks_and_windows_match_the_twin(
    window_left: int,
) -> None:
    # G = 3 (not a power of two): q tiles of 5 tokens; 12 rows of one sequence make 3 tiles
    ours, want = _run(
        [12, 2, 1],
        [75, 2, 33],
        heads=6,
        kv_heads=2,
        dim=16,
        dtype=torch.float32,
        splits=2,
        window_left=window_left,
        seed=2,
        min_split=16,
    )
    _close(ours, want)


def test_twin_matches_dense_attention() -> None:
    """The twin against softmax(QK^T)V over each sequence's gathered K/V and its dense mask."""
    gen = torch.Generator().manual_seed(3)
    q_lens, kv_lens = [3, 1], [10, 6]
    tables = _tables(kv_lens, 20, gen)
    k, v = _cache(20 * PAGE, 2, 8, torch.float32, gen)
    q = torch.randn(4, 4, 8, generator=gen)
    segments = _tree_masks(q_lens, kv_lens, gen)
    plan = pa.make_plan(
        q_lens, kv_lens, tables, PAGE, head_dim=8, splits=1, device=torch.device("cpu")
    )
    meta = plan.meta.tolist()
    bits, indptr = _packed(segments, kv_lens)
    got = reference.paged_attention(
        q,
        k,
        v,
        meta[:3],
        meta[3:6],
        plan.kv_indices.tolist(),
        kv_lens,
        page_size=PAGE,
        scale=0.5,
        mask=(bits, indptr.tolist()),
    )
    for b, (lo, hi) in enumerate([(0, 3), (3, 4)]):
        slots = [tables[b][j // PAGE] * PAGE + j % PAGE for j in range(kv_lens[b])]
        seen = torch.from_numpy(segments[b].reshape(hi - lo, kv_lens[b]))
        for h in range(4):
            keys, values = k[slots, h // 2], v[slots, h // 2]
            scores = (q[lo:hi, h] @ keys.T * 0.5).masked_fill(~seen, float("-inf"))
            torch.testing.assert_close(got[lo:hi, h], torch.softmax(scores, -1) @ values)


def test_rows_that_see_nothing_get_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    """An all-zero mask row (no visible entry) is written as zeros, not NaN."""
    gen = torch.Generator().manual_seed(4)
    k, v = _cache(8 * PAGE, 1, 16, torch.float32, gen)
    q = torch.randn(2, 2, 16, generator=gen)
    plan = pa.make_plan([2], [6], [[3, 5]], PAGE, head_dim=16, splits=1, device=torch.device("cpu"))
    mask = np.ones((2, 6), dtype=bool)
    mask[1] = False
    bits, indptr = _packed([mask.ravel()], [6])
    out = pa.paged_attention(
        q, k, v, plan, page_size=PAGE, scale=0.25, mask=(bits, indptr), backend="triton"
    )
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out).all() and out[0].abs().sum() > 0


def test_row_masks_start_each_row_at_a_word() -> None:
    gen = torch.Generator().manual_seed(5)
    kv_lens = [70, 3, 32]
    masks = [torch.rand(q, n, generator=gen) < 0.5 for q, n in zip([2, 1, 3], kv_lens)]
    words, offsets = pa.pack_row_masks([m.numpy().ravel() for m in masks], kv_lens)
    assert words.dtype == np.int32 and offsets.tolist() == [0, 6, 7, 10]
    for b, mask in enumerate(masks):
        width = -(-kv_lens[b] // 32)
        for t in range(mask.shape[0]):
            for j in range(kv_lens[b]):
                word = int(words[offsets[b] + t * width + j // 32])
                assert (word >> (j % 32)) & 1 == int(mask[t, j])


def test_split_tickets_reset_between_launches() -> None:
    """Launches sharing one workspace (the layers of a step): each merges its own splits."""
    gen = torch.Generator().manual_seed(6)
    kv_lens = [100, 40]
    tables = _tables(kv_lens, 40, gen)
    plan = pa.make_plan(
        [1, 2], kv_lens, tables, PAGE, head_dim=16, splits=4, device=CPU, min_split=16
    )
    assert plan.splits == 2  # 64-entry splits (the loop step) over 100 entries
    workspace = pa.Workspace.empty(CPU)
    meta = plan.meta.tolist()
    for layer in range(3):
        k, v = _cache(40 * PAGE, 2, 16, torch.float32, gen)
        q = torch.randn(3, 4, 16, generator=gen)
        got = pa.paged_attention(
            q, k, v, plan, page_size=PAGE, scale=0.25, workspace=workspace, backend="triton"
        )
        want = reference.paged_attention(
            q, k, v, meta[:3], meta[3:6], plan.kv_indices.tolist(), kv_lens, page_size=PAGE,
            scale=0.25,
        )  # fmt: skip
        _close(got, want)
        assert not workspace.counters.any(), layer


@pytest.mark.parametrize("block", [32, 128])
def test_other_loop_steps_match_the_twin(block: int) -> None:
    """32- and 128-entry loop steps (one mask word per row; a word per entry) on trees and
    windows, with splits of the step's size."""
    options = KernelOptions(attention_launch=AttentionLaunch(block))
    assert pa.split_len_for(1, 1, 32, min_split=1, options=options) == block
    kw = {"heads": 4, "kv_heads": 1, "dtype": torch.float32, "splits": 3, "min_split": 32}
    _close(*_run([5, 1, 9], [300, 17, 90], dim=32, tree=True, seed=7, options=options, **kw))
    _close(*_run([12, 1], [200, 33], dim=16, window_left=40, seed=8, options=options, **kw))
