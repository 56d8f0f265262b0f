"""Paged attention per layer inside a CUDA graph: espalier's small-query kernel
(``kernels/paged_attention``, the default for decode and tree-verify steps) against flashinfer's
prefill kernel (the engine's path before it, the anchor), in one run, printing JSON lines.

8B-Llama attention shape (32 query heads, 8 K/V heads, head dim 128, bf16, 16-entry pages in a
shuffled cache). Steps: decode (one token per sequence, causal) at batch 1 / 8 / 32 / 64 over
128 / 512 / 2048 cached entries, and tree verification (``--tree`` nodes per sequence, random
trees, explicit masks) at batch 1 / 32. Each case plans the backend's CUDA-graph wrappers as the
engine does and captures 32 calls back to back (a step's 32 layers): ``us`` is the GPU time per
call, ``vs_flashinfer`` flashinfer's time over ours (> 1: ours faster). ``max_err``: largest
difference of each path's output from the fp32 torch twin.

Usage (GPU machine): ``python3 bench/attention.py [--tree 9]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from cuda_timing import graph_us  # bench/cuda_timing.py (this folder is on sys.path)

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def _tree_segments(batch: int, n: int, kv_len: int, gen: torch.Generator) -> list[np.ndarray]:
    from espalier.engine.spec.tree_builder import tree_attention_mask

    segments = []
    for _ in range(batch):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        segments.append(tree_attention_mask(parents, kv_len - n).numpy().ravel())
    return segments


def make_backend(small: bool, kernels: Any = None) -> Any:
    """A flashinfer backend of the 8B attention shape whose decode and tree steps take our
    kernel (``small``, with ``kernels``: its ``KernelOptions``) or flashinfer's prefill kernel."""
    from espalier.engine.config import ModelConfig, ModelOptions
    from espalier.engine.model.attention.flashinfer import FlashinferBackend
    from espalier.kernels.options import KernelOptions

    config = ModelConfig("llama", 1000, 4096, 14336, 1, HEADS, KV_HEADS, DIM)
    options = ModelOptions(small_query_up_to=16 if small else 0, kernels=kernels or KernelOptions())
    return FlashinferBackend(
        config, device=torch.device("cuda"), dtype=torch.bfloat16, options=options
    )


def case(
    backend: Any, batch: int, n: int, ctx: int, seed: int, check: bool = True
) -> dict[str, Any]:
    from espalier.engine.model.attention.paged_plan import paged_layout
    from espalier.kernels import paged_attention as pa
    from espalier.kernels import reference

    gen = torch.Generator().manual_seed(seed)
    kv_len = ctx + n
    pages = -(-kv_len // PAGE)
    blocks = batch * pages + 1
    tables = torch.randperm(blocks, generator=gen)[: batch * pages].view(batch, pages).tolist()
    shape = (blocks, PAGE, KV_HEADS, DIM)
    k = torch.randn(shape, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(shape, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(batch * n, HEADS, DIM, generator=gen).to("cuda", torch.bfloat16)
    layout = paged_layout([n] * batch, [kv_len] * batch, tables, PAGE)
    segments = _tree_segments(batch, n, kv_len, gen) if n > 1 else None
    mask_bytes = batch * -(-n * kv_len // 8) if n > 1 else 0
    graph = backend.graph_wrappers(batch, blocks, n, mask_bytes)
    if segments is None:
        backend.plan_causal(graph.wrappers, layout, PAGE)
    else:
        backend.plan_graph_masked(graph, layout, PAGE, {None: segments})
    wrapper = graph.wrappers[None]
    out = wrapper.run(q, (k, v))
    us = graph_us([lambda: wrapper.run(q, (k, v))] * 32)
    if not check:
        return {"us": round(us, 2)}
    bits = None
    if segments is not None:
        words, offsets = pa.pack_row_masks(segments, [kv_len] * batch)
        bits = (torch.from_numpy(words), offsets.tolist())
    want = reference.paged_attention(
        q.float().cpu(),
        k.float().cpu().view(-1, KV_HEADS, DIM),
        v.float().cpu().view(-1, KV_HEADS, DIM),
        layout.qo_indptr.tolist(),
        layout.kv_indptr.tolist(),
        layout.kv_indices.tolist(),
        [kv_len] * batch,
        page_size=PAGE,
        scale=DIM**-0.5,
        mask=bits,
    )
    err = float((out.float().cpu() - want).abs().max())
    return {"us": round(us, 2), "max_err": round(err, 5)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=int, default=9, help="nodes per verified tree")
    parser.add_argument("--contexts", default="128,512,2048")
    parser.add_argument("--decode-batches", default="1,8,32,64")
    parser.add_argument("--tree-batches", default="1,32")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time our kernel per launch shape (loop step, warps, stages, programs per SM)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        emit({"skipped": "CUDA not available"})
        return 0
    backends = {small: make_backend(small) for small in (False, True)}
    shapes = [(int(b), 1) for b in args.decode_batches.split(",") if b]
    shapes += [(int(b), args.tree) for b in args.tree_batches.split(",") if b]
    summary: dict[str, Any] = {"part": "summary"}
    for ctx in map(int, args.contexts.split(",")):
        for batch, n in shapes:
            record: dict[str, Any] = {"part": "attention", "batch": batch, "n": n, "ctx": ctx}
            for name, small in (("flashinfer", False), ("ours", True)):
                try:
                    result = case(backends[small], batch, n, ctx, seed=batch * 7 + n + ctx)
                except Exception as exc:  # keep the other cases measurable
                    result = {"error": repr(exc)[:300]}
                record.update({f"{name}_{k}": v for k, v in result.items()})
            if "ours_us" in record and "flashinfer_us" in record:
                record["vs_flashinfer"] = round(record["flashinfer_us"] / record["ours_us"], 3)
                summary[f"b{batch}_n{n}_ctx{ctx}_vs_flashinfer"] = record["vs_flashinfer"]
            emit(record)
            if args.sweep:
                summary.update(sweep(batch, n, ctx))
    emit(summary)
    return 0


def sweep(batch: int, n: int, ctx: int) -> dict[str, Any]:
    """Our kernel's time per launch shape for one case (JSON line each); the best one."""
    from espalier.kernels.options import AttentionLaunch, KernelOptions

    best: tuple[float, str] = (float("inf"), "")
    for block, warps, stages, per_sm in itertools.product((64, 128), (4, 8), (1, 2, 3), (1, 4)):
        launch = AttentionLaunch(block, warps, stages)
        kernels = KernelOptions(attention_launch=launch, attention_programs_per_sm=per_sm)
        name = f"n{block}_w{warps}_s{stages}_p{per_sm}"
        try:
            backend = make_backend(True, kernels)
            us = case(backend, batch, n, ctx, seed=batch * 7 + n + ctx, check=False)["us"]
        except Exception as exc:
            emit({"part": "sweep", "batch": batch, "n": n, "ctx": ctx, "config": name,
                  "error": repr(exc)[:200]})  # fmt: skip
            continue
        emit({"part": "sweep", "batch": batch, "n": n, "ctx": ctx, "config": name, "us": us})
        best = min(best, (us, name))
    return {f"b{batch}_n{n}_ctx{ctx}_best": f"{best[1]} {best[0]}"}


if __name__ == "__main__":
    sys.exit(main())
