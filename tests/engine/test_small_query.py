"""The small-query wrapper (planning for ``kernels/paged_attention``; its torch twin on CPU)
against the SDPA backend on the same steps: decodes, draft trees with positions by depth, sliding
windows, eager plans and a graph's fixed buffers re-planned step after step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from espalier.engine.kv_cache import KVCache
from espalier.engine.model.attention.base import LayerSpec, build_metadata
from espalier.engine.model.attention.paged_plan import meta_layout, step_mask
from espalier.engine.model.attention.sdpa import SdpaBackend
from espalier.engine.model.attention.small_query import SmallQueryWrapper
from espalier.engine.model.runner import SeqInput
from espalier.engine.spec.tree_builder import tree_attention_mask
from espalier.kernels import paged_attention as pa

HEADS, KV_HEADS, DIM, PAGE, BLOCKS = 4, 2, 16, 4, 40
SCALE = 0.3
CPU = torch.device("cpu")


def _cache(seed: int) -> KVCache:
    gen = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, PAGE, KV_HEADS, DIM)
    return KVCache(
        k=[torch.randn(shape, generator=gen)],
        v=[torch.randn(shape, generator=gen)],
        block_size=PAGE,
    )


def _steps() -> list[list[SeqInput]]:
    """Two steps: decodes, a tree (0 -> 1 -> 3, 0 -> 2) and (the first) prefill chunks."""
    parents = [-1, 0, 0, 1]
    tree = tree_attention_mask(parents, 21)
    return [
        [
            SeqInput(list(range(0, 8)), [1], 13),
            SeqInput(list(range(8, 16)), [2, 3, 4, 5], 21, [21, 22, 22, 23], tree, "all"),
            SeqInput(list(range(16, 24)), [6], 0),
            SeqInput(list(range(32, 36)), list(range(9)), 0),  # a prefill chunk
            SeqInput(list(range(36, 40)), list(range(5)), 6),  # a later chunk
        ],
        [
            SeqInput(list(range(24, 32)), [1], 30),
            SeqInput(
                list(range(8, 16)),
                [2, 3, 4, 5],
                22,
                [22, 23, 23, 24],
                tree_attention_mask(parents, 22),
                "all",
            ),
            SeqInput(list(range(16, 24)), [6], 1),
        ],
    ]


def _sdpa(meta: object, q: torch.Tensor, cache: KVCache, window: int | None) -> torch.Tensor:
    config = SimpleNamespace(num_layers=1, window=lambda layer: window)
    backend = SdpaBackend(config)  # type: ignore[arg-type]
    backend.prepare(meta)  # type: ignore[arg-type]
    return backend.attend(LayerSpec(0, SCALE, window), q, cache, meta)  # type: ignore[arg-type]


def _wrapper(
    window: int | None,
    graph: tuple[int, int, int] | None = None,
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> SmallQueryWrapper:
    return SmallQueryWrapper(
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        scale=SCALE,
        window_left=-1 if window is None else window - 1,
        device=CPU,
        workspace=pa.Workspace.empty(CPU),
        graph=graph,
        mask_buffers=buffers,
    )


@pytest.mark.parametrize("window", [None, 3, 9])
def test_eager_plans_match_sdpa(window: int | None) -> None:
    cache = _cache(0)
    gen = torch.Generator().manual_seed(1)
    for batch in _steps():
        meta = build_metadata(batch, block_size=PAGE, device=CPU)
        q = torch.randn(meta.num_tokens, HEADS, DIM, generator=gen)
        segments = step_mask(meta, window)
        small = _wrapper(window)
        small.plan(meta_layout(meta), PAGE, segments)
        got = small.run(q, (cache.k[0], cache.v[0]))
        torch.testing.assert_close(got, _sdpa(meta, q, cache, window), rtol=1e-5, atol=1e-5)


def test_graph_buffers_replanned_per_step_match_sdpa() -> None:
    """One wrapper with fixed buffers (masked mode, as a tree graph) planned for two steps; its
    decode twin (causal, one token per sequence) likewise."""
    cache = _cache(2)
    gen = torch.Generator().manual_seed(3)
    mask_buf = torch.zeros(64, dtype=torch.int32)
    indptr_buf = torch.zeros(4, dtype=torch.int32)
    masked = _wrapper(None, graph=(3, 4, BLOCKS), buffers=(mask_buf, indptr_buf))
    decode = _wrapper(None, graph=(3, 1, BLOCKS))
    for step in _steps():
        batch = step[:3]  # the captured shape: three sequences of at most 4 tokens
        meta = build_metadata(batch, block_size=PAGE, device=CPU)
        q = torch.randn(meta.num_tokens, HEADS, DIM, generator=gen)
        segments = step_mask(meta, None)
        assert segments is not None
        masked.plan(meta_layout(meta), PAGE, segments)
        got = masked.run(q, (cache.k[0], cache.v[0]))
        torch.testing.assert_close(got, _sdpa(meta, q, cache, None), rtol=1e-5, atol=1e-5)

        decodes = [SeqInput(s.block_table, [7], s.context_len + 1) for s in batch]
        meta = build_metadata(decodes, block_size=PAGE, device=CPU)
        q = torch.randn(3, HEADS, DIM, generator=gen)
        decode.plan(meta_layout(meta), PAGE)
        got = decode.run(q, (cache.k[0], cache.v[0]))
        torch.testing.assert_close(got, _sdpa(meta, q, cache, None), rtol=1e-5, atol=1e-5)


def test_graph_plan_rejects_steps_that_do_not_fit() -> None:
    decode = _wrapper(None, graph=(2, 1, 3))
    meta = build_metadata([SeqInput([0, 1, 2, 3], [1], 13)], block_size=PAGE, device=CPU)
    with pytest.raises(ValueError, match="captured shape"):
        decode.plan(meta_layout(meta), PAGE)
    two = [SeqInput([0, 1, 2, 3], [1], 13), SeqInput([4], [1], 0)]
    meta = build_metadata(two, block_size=PAGE, device=CPU)
    with pytest.raises(ValueError, match="pages"):
        decode.plan(meta_layout(meta), PAGE)


def test_windows_share_one_plan() -> None:
    """``window_wrappers`` + ``plan_windows``: the windows' wrappers over one plan, each with
    its own window (causal steps) or masks (a tree step), against SDPA per window."""
    from espalier.engine.model.attention.small_query import plan_windows, window_wrappers

    config = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, scale=SCALE)
    windows = [None, 3]
    cache = _cache(4)
    gen = torch.Generator().manual_seed(5)
    for graph in (None, (3, 4, BLOCKS)):
        wrappers = window_wrappers(
            config,  # type: ignore[arg-type]
            windows,
            CPU,
            pa.Workspace.empty(CPU),
            graph,
            mask_words=64 if graph else 0,
        )
        assert len({id(w.shared) for w in wrappers.values()}) == 1
        for step in _steps():
            batch = step if graph is None else step[:3]  # a graph: its captured shape
            meta = build_metadata(batch, block_size=PAGE, device=CPU)
            q = torch.randn(meta.num_tokens, HEADS, DIM, generator=gen)
            masks = {w: step_mask(meta, w) for w in windows}
            plan_windows(wrappers, meta_layout(meta), PAGE, masks)
            for window, wrapper in wrappers.items():
                got = wrapper.run(q, (cache.k[0], cache.v[0]))
                want = _sdpa(meta, q, cache, window)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
