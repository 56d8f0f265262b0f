"""The kernels' warm-ups launch every variant a step can need: after ``paged_attention.warm_up``
and ``verify.warm_up``, steps of random sizes (batch, rows per sequence, context, tree sizes,
masks, windows, splits) launch only keys Triton has already compiled (``tests/fixtures/
triton_keys.py``: Triton's own specialization of each argument). Before issue 28 a step's batch
or row count that was 1 or a multiple of 16 (or a new split count in verification) was a new
variant, compiled mid-run: 0.2-1.5 s stalls on the H200."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from espalier.kernels import paged_attention as pa
from espalier.kernels import verify
from espalier.kernels.options import KernelOptions
from tests.fixtures.triton_keys import KeyRecorder

CPU = torch.device("cpu")
HEADS, KV_HEADS, DIM, PAGE = 8, 2, 32, 4


def _attention_step(rng: random.Random, window_lefts: list[int], max_q: int) -> dict[str, object]:
    """Arguments of one random small-query step, as the engine's wrappers make them."""
    batch = rng.randint(1, 40)
    q_lens = [rng.randint(1, max_q) for _ in range(batch)]
    kv_lens = [q + rng.randint(0, 200) for q in q_lens]
    tables = [list(range(-(-n // PAGE))) for n in kv_lens]
    tiles = pa.tiles_per_sequence(HEADS, KV_HEADS, max(q_lens))
    splits = rng.choice([pa.choose_splits(batch * tiles * KV_HEADS, max(kv_lens), CPU), 1, 3])
    plan = pa.make_plan(
        q_lens, kv_lens, tables, PAGE, head_dim=DIM, splits=splits, device=CPU, min_split=8
    )
    mask = None
    window_left = rng.choice(window_lefts)
    if rng.random() < 0.5:  # a draft tree's explicit masks (the window folded in)
        flat = [np.ones(q * n, dtype=bool) for q, n in zip(q_lens, kv_lens)]
        words, offsets = pa.pack_row_masks(flat, kv_lens)
        mask = (torch.from_numpy(words), torch.from_numpy(offsets))
        window_left = -1
    return {"plan": plan, "mask": mask, "window_left": window_left, "rows": sum(q_lens)}


@pytest.mark.parametrize("window_lefts", [[-1], [-1, 5]])
def test_attention_steps_launch_only_warmed_variants(
    monkeypatch: pytest.MonkeyPatch, window_lefts: list[int]
) -> None:
    recorder = KeyRecorder(pa._attention_kernel)
    monkeypatch.setattr(pa, "_attention_kernel", recorder)
    options = KernelOptions()
    launches = pa.warm_up(
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, page_size=PAGE,
        dtype=torch.float32, device=CPU, max_q_len=16, window_lefts=window_lefts,
        options=options,
    )  # fmt: skip
    warmed = set(recorder.keys)
    assert launches >= len(warmed) > 1
    recorder.keys.clear()
    rng = random.Random(0)
    k = torch.zeros(64 * PAGE, KV_HEADS, DIM)
    for _ in range(150):
        step = _attention_step(rng, window_lefts, 16)
        q = torch.zeros(int(step["rows"]), HEADS, DIM)  # type: ignore[call-overload]
        pa.paged_attention(
            q, k, k, step["plan"], page_size=PAGE, scale=0.5,  # type: ignore[arg-type]
            window_left=step["window_left"], mask=step["mask"],  # type: ignore[arg-type]
            backend="triton", options=options,
        )  # fmt: skip
    assert recorder.keys, "the steps launched nothing"
    assert recorder.keys <= warmed, recorder.keys - warmed


def test_verify_steps_launch_only_warmed_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    argmax = KeyRecorder(verify._masked_argmax_kernel)
    walk = KeyRecorder(verify._tree_walk_kernel)
    monkeypatch.setattr(verify, "_masked_argmax_kernel", argmax)
    monkeypatch.setattr(verify, "_tree_walk_kernel", walk)
    vocab, words, max_nodes = 50_000, 1_563, 20
    calls = verify.warm_up(CPU, vocab, words, max_nodes, logits_width=vocab + 16, backend="triton")
    warmed = (set(argmax.keys), set(walk.keys))
    assert calls == 2 * 6  # tree tiles 1, 2, 4, 8, 16, 32; constrained or not
    argmax.keys.clear()
    walk.keys.clear()
    rng = random.Random(1)
    for _ in range(60):
        sizes = [rng.randint(1, max_nodes) for _ in range(rng.randint(1, 24))]
        n = sum(sizes)
        chain = torch.cat([torch.arange(s) for s in sizes])
        sizes_of = torch.tensor([s for s in sizes for _ in range(s)])
        first_child = torch.where(chain + 1 < sizes_of, chain + 1, -1)
        offsets = [0]
        for s in sizes:
            offsets.append(offsets[-1] + s)
        flags = torch.ones(n, dtype=torch.bool)
        bitmask = torch.full((n, words), -1, dtype=torch.int32) if rng.random() < 0.5 else None
        verify.verify_greedy(
            torch.zeros(n, vocab + 16), first_child, torch.full((n,), -1), chain, offsets,
            bitmask=bitmask, mask_rows=torch.arange(n), valid=flags, filled=flags,
            vocab_size=vocab, backend="triton",
        )  # fmt: skip
    assert argmax.keys <= warmed[0], argmax.keys - warmed[0]
    assert walk.keys <= warmed[1], walk.keys - warmed[1]
    assert len(walk.keys) > 2  # several tree tiles were seen
