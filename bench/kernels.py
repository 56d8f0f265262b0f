"""GPU benchmark of the kernels against xgrammar's, printing JSON lines (run on a CUDA machine).

For vocab 151,936 and 262,144, fp32 and bf16, rows 1/16/64/256/1024:
- apply: our ``apply_bitmask_`` vs xgrammar's CUDA and Triton ``apply_token_bitmask_inplace`` on the
  same tensors, for a sparse grammar-like mask (1 % allowed) and a random one (50 %); the one-pass
  limit is the logits' bytes over the bandwidth of a 1 GiB device copy measured in this run
  (bytes read + written over time).
- verify: our fused ``verify_greedy`` vs xgrammar CUDA apply + ``torch.argmax`` + the tree walk.

GPU times are medians of CUDA-graph replays (launch gaps removed), rotating through enough copies
of the logits to exceed the L2 cache. Wall times (``*_wall_us``) are per call from Python,
synchronised, with the host walk for the baseline.
Usage: ``python bench/kernels.py [--quick] [--sweep]`` (``--sweep`` first times launch shapes).
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch
from cuda_timing import graph_us  # bench/cuda_timing.py (this folder is on sys.path)

from espalier.kernels.bitmask import apply_bitmask_
from espalier.kernels.reference import walk_greedy
from espalier.kernels.verify import verify_greedy

L2_BYTES = 60 * 2**20


def graph_time_us(calls: list[Callable[[], object]], reps: int = 15) -> float:
    """Median µs per call of ``calls`` replayed in one CUDA graph (NaN, reported, on failure)."""
    try:
        return graph_us(calls, reps)
    except Exception as exc:  # keep the run going: one failed anchor must not lose the table
        print(json.dumps({"error": repr(exc)[:300]}), flush=True)
        return float("nan")


def wall_us(fn: Callable[[], object], reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes per µs (read + written) of a 1 GiB device-to-device copy."""
    src = torch.randn(2**28, device="cuda")
    dst = torch.empty_like(src)
    us = graph_time_us([lambda: dst.copy_(src)] * 5)
    return 2 * src.numel() * 4 / us


def make_mask(rows: int, vocab: int, density: float) -> torch.Tensor:
    words = (vocab + 31) // 32
    bits = torch.rand(rows, words * 32, device="cuda") < density
    bits[:, vocab:] = False
    weights = (2 ** torch.arange(32, device="cuda", dtype=torch.int64)).view(1, 1, 32)
    packed = (bits.view(rows, words, 32).long() * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def copies(rows: int, vocab: int, dtype: torch.dtype) -> list[torch.Tensor]:
    size = rows * vocab * torch.finfo(dtype).bits // 8
    n = min(32, max(1, math.ceil(3 * L2_BYTES / size)))
    return [torch.randn(rows, vocab, device="cuda").to(dtype) for _ in range(n)]


XgrApply = Callable[[torch.Tensor, torch.Tensor], None]
Anchors = dict[str, XgrApply | None]


def xgr_apply(backend: str) -> XgrApply | None:
    try:
        import xgrammar as xgr

        probe = torch.randn(2, 64, device="cuda")
        xgr.apply_token_bitmask_inplace(
            probe, torch.zeros(2, 2, dtype=torch.int32, device="cuda"), backend=backend
        )
    except Exception as exc:  # report and continue without that anchor
        print(json.dumps({"warning": f"xgrammar {backend} unavailable: {exc!r}"}), flush=True)
        return None
    return lambda lg, m: xgr.apply_token_bitmask_inplace(lg, m, backend=backend)


def build_trees(rows: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """Trees of up to 64 nodes; the first child follows the root's argmax (some acceptance)."""
    rng = random.Random(rows)
    sizes = [min(64, rows - i) for i in range(0, rows, 64)]
    fc: list[int] = []
    ns: list[int] = []
    tok: list[int] = []
    offsets = [0]
    for n in sizes:
        parent = [-1] + [rng.randrange(max(0, i - 3), i) for i in range(1, n)]
        kids: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            kids[parent[i]].append(i)
        f, s = [-1] * n, [-1] * n
        for i, k in enumerate(kids):
            if k:
                f[i] = k[0]
            for a, b in itertools.pairwise(k):
                s[a] = b
        fc += f
        ns += s
        tok += [rng.randrange(vocab) for _ in range(n)]
        offsets.append(offsets[-1] + n)
    as_t = lambda xs: torch.tensor(xs, dtype=torch.long, device="cuda")  # noqa: E731
    return as_t(fc), as_t(ns), as_t(tok), as_t(offsets)


def emit(rec: dict[str, object]) -> None:
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rec.items()}))
    sys.stdout.flush()


def bench_apply(bufs: list[torch.Tensor], rec: dict[str, object], anchors: Anchors) -> None:
    rows, vocab = bufs[0].shape
    one_pass = float(rec["one_pass_us"])  # type: ignore[arg-type]
    for density in (0.01, 0.5):
        mask = make_mask(rows, vocab, density)
        out = dict(rec, bench="apply", mask_allowed=density)
        calls = [partial(apply_bitmask_, b, mask) for b in bufs * 2]
        out["ours_us"] = ours = graph_time_us(calls)
        for label, fn in anchors.items():
            if fn is not None:
                out[f"xgr_{label}_us"] = graph_time_us([partial(fn, b, mask) for b in bufs * 2])
        out["ours_pct_of_limit"] = 100 * one_pass / ours
        xgr = anchors.get("cuda") or anchors.get("triton")
        if xgr is not None:  # same result as xgrammar on fresh data
            fresh = torch.randn_like(bufs[0], dtype=torch.float32).to(bufs[0].dtype)
            theirs = fresh.clone()
            xgr(theirs, mask)
            out["matches_xgrammar"] = bool(torch.equal(apply_bitmask_(fresh, mask), theirs))
        if rows == 1:
            out["ours_wall_us"] = wall_us(partial(apply_bitmask_, bufs[0], mask))
        emit(out)


def bench_verify(bufs: list[torch.Tensor], rec: dict[str, object], anchors: Anchors) -> None:
    """All nodes valid and filled, sparse masks (every row is read)."""
    rows, vocab = bufs[0].shape
    mask = make_mask(rows, vocab, 0.01)
    fc, ns, tok, offsets = build_trees(rows, vocab)
    host_offsets = offsets.tolist()
    max_nodes = max(b - a for a, b in itertools.pairwise(host_offsets))
    out = dict(rec, bench="verify", trees=len(host_offsets) - 1)
    ours = [
        partial(verify_greedy, b, fc, ns, tok, offsets, max_nodes=max_nodes, bitmask=mask)
        for b in bufs * 2
    ]
    out["ours_us"] = graph_time_us(ours)  # type: ignore[arg-type]
    out["ours_x_read_pass"] = out["ours_us"] / float(rec["one_pass_us"])  # type: ignore[arg-type]
    xgr = anchors.get("cuda") or anchors.get("triton")
    if xgr is not None:

        def base_gpu(b: torch.Tensor, apply: XgrApply = xgr) -> torch.Tensor:
            apply(b, mask)
            return b.argmax(dim=-1)

        out["base_gpu_us"] = graph_time_us([partial(base_gpu, b) for b in bufs * 2])
        fresh = torch.randn_like(bufs[0], dtype=torch.float32).to(bufs[0].dtype)
        ours_argmax = verify_greedy(fresh, fc, ns, tok, host_offsets, bitmask=mask).argmax
        some = ours_argmax >= 0  # rows with an allowed token (torch.argmax says 0 for the others)
        out["argmax_matches_xgrammar"] = bool(torch.equal(ours_argmax[some], base_gpu(fresh)[some]))
        fc_l, ns_l, tok_l = fc.tolist(), ns.tolist(), tok.tolist()

        def baseline(b: torch.Tensor = bufs[0], apply: XgrApply = xgr) -> object:
            apply(b, mask)
            am = b.argmax(dim=-1).tolist()  # host walk, as a Python engine would do it
            return walk_greedy(am, [True] * rows, fc_l, ns_l, tok_l, host_offsets)

        def fused(b: torch.Tensor = bufs[0]) -> object:
            res = verify_greedy(b, fc, ns, tok, host_offsets, bitmask=mask)
            return res.packed.tolist()  # one copy: lengths, bonus tokens, paths

        out["base_wall_us"] = base_wall = wall_us(baseline)
        out["ours_wall_us"] = ours_wall = wall_us(fused)
        out["speedup_wall"] = base_wall / ours_wall
        out["speedup_gpu"] = out["base_gpu_us"] / out["ours_us"]  # type: ignore[operator]
    emit(out)


def sweep(bw: float) -> None:
    """Launch-shape sweep of both kernels on a few shapes (sets and restores module defaults)."""
    from espalier.kernels import bitmask as bitmask_mod
    from espalier.kernels import verify as verify_mod

    for mod, kernel in ((bitmask_mod, "apply"), (verify_mod, "verify")):
        saved = (mod.CUDA_BYTES_PER_ITER, mod.CUDA_NUM_WARPS)
        for dtype in (torch.float32, torch.bfloat16):
            for rows in (1, 1024):
                bufs = copies(rows, 151936, dtype)
                mask = make_mask(rows, 151936, 0.01)
                fc, ns, tok, offsets = build_trees(rows, 151936)
                one_pass = bufs[0].numel() * bufs[0].element_size() / bw
                for size in (8192, 16384):
                    for warps in (4, 8):
                        mod.CUDA_BYTES_PER_ITER, mod.CUDA_NUM_WARPS = size, warps
                        if kernel == "apply":
                            calls = [partial(apply_bitmask_, b, mask) for b in bufs * 2]
                        else:
                            calls = [
                                partial(
                                    verify_greedy,
                                    b,
                                    fc,
                                    ns,
                                    tok,
                                    offsets,
                                    max_nodes=64,
                                    bitmask=mask,
                                )
                                for b in bufs * 2
                            ]
                        us = graph_time_us(calls)  # type: ignore[arg-type]
                        emit({"bench": "sweep", "kernel": kernel, "dtype": str(dtype)[6:],
                              "rows": rows, "bytes_per_iter": size, "warps": warps, "us": us,
                              "x_one_pass": us / one_pass})  # fmt: skip
                del bufs
        mod.CUDA_BYTES_PER_ITER, mod.CUDA_NUM_WARPS = saved


def main() -> None:
    quick = "--quick" in sys.argv
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(
        json.dumps(
            {"bench": "copy", "device": torch.cuda.get_device_name(), "GBps": round(bw / 1e3, 1)}
        ),
        flush=True,
    )
    if "--sweep" in sys.argv:
        sweep(bw)
    anchors = {"cuda": xgr_apply("cuda"), "triton": xgr_apply("triton")}
    for vocab in (151936, 262144):
        for dtype in (torch.float32, torch.bfloat16):
            for rows in (1, 16, 256) if quick else (1, 16, 64, 256, 1024):
                bufs = copies(rows, vocab, dtype)
                rec: dict[str, object] = {
                    "vocab": vocab,
                    "dtype": str(dtype).removeprefix("torch."),
                    "rows": rows,
                    "one_pass_us": bufs[0].numel() * bufs[0].element_size() / bw,
                }
                bench_apply(bufs, rec, anchors)
                bench_verify(bufs, rec, anchors)
                del bufs
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
