"""The skinny GEMM (``espalier.kernels.gemv``) against cuBLAS on decode shapes, printing JSON lines.

For the projections of an 8B Llama (fused qkv, o, fused gate/up, down, the LM head at 128,256
and 262,144 rows) and M = 1, 2, 4, 8, 16 rows of bf16 activations: GPU time per call of
``F.linear`` (cuBLAS, the anchor) and of ``gemv`` for each launch shape of a sweep, plus the
default launch shape (``gemv.default_config``). Times are medians of CUDA-graph replays (launch
gaps removed, as in a captured decode step), rotating through enough weight copies (>= 1 GiB per
replay) that no weight is served from the L2 cache. GB/s counts the weight bytes; ``of_copy`` is
that over the bandwidth of a 4 GiB device copy (read + write) measured in the same run (the
roofline ``bench/gpu.py`` uses); ``vs_cublas`` is cuBLAS time over ours (> 1: ours faster).

``gated``: the MLP's gate/up projection with its activation, cuBLAS + ``gated_act`` vs
``gemv`` + ``gated_act`` vs ``gated_gemv`` (one launch), and whether the last two agree bit for
bit. The kernels of the sweep are compiled first in worker processes (``--jobs``) so the run spends
its time measuring. Usage (on the GPU machine)::

    python3 bench/gemv.py [--ms 1,2,4,8,16] [--shapes qkv,o,...] [--out FILE] [--quick]
        [--no-sweep] [--jobs 12]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from functools import partial
from multiprocessing import get_context
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from cuda_timing import (  # bench/cuda_timing.py (this folder is on sys.path)
    copy_bandwidth,
    graph_us,
)

from espalier.kernels.gemv import SkinnyConfig, default_config, gated_gemv, gemv

SHAPES = {  # name -> (N, K) of the [N, K] weight
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head_128k": (128256, 4096),
    "lm_head_262k": (262144, 4096),
}
BYTES_PER_REPLAY = 1 << 30


def sweep_configs(m: int, quick: bool = False) -> list[SkinnyConfig]:
    """Launch shapes tried for ``m`` rows: FMA tiles for m <= 8, tensor-core tiles for m >= 2."""
    fma: dict[int, list[tuple[int, int, int]]] = {  # block_m -> (block_n, block_k, warps)
        1: [
            (2, 1024, 4),
            (4, 512, 4),
            (4, 1024, 4),
            (4, 1024, 8),
            (8, 256, 4),
            (8, 512, 4),
            (8, 512, 8),
            (8, 1024, 8),
            (16, 256, 4),
            (16, 512, 4),
            (16, 512, 8),
            (16, 1024, 8),
            (32, 256, 8),
        ],
        2: [(4, 512, 4), (8, 256, 4), (8, 512, 4), (4, 1024, 8), (16, 256, 4), (8, 1024, 8)],
        4: [(4, 256, 4), (4, 512, 4), (8, 256, 4), (8, 512, 8), (16, 256, 8)],
        8: [(4, 256, 4), (8, 256, 8), (4, 512, 8)],
    }
    dot = [(16, 128, 4), (16, 256, 4), (16, 512, 4), (32, 128, 4), (32, 256, 4), (32, 512, 8)]
    dot += [(64, 128, 4), (64, 256, 8)]
    block_m = 1 << max(m - 1, 0).bit_length()
    out: list[SkinnyConfig] = []
    stages = (1,) if quick else (1, 3)
    for bn, bk, w in fma.get(block_m, [])[: 3 if quick else None]:
        for s in stages if block_m == 1 else (1,):
            out.append(SkinnyConfig(False, block_m, bn, bk, num_warps=w, num_stages=s))
    if m >= 2:
        for bn, bk, w in dot[: 3 if quick else None]:
            for s in (3,) if quick else (3, 5):
                out.append(SkinnyConfig(True, 16, bn, bk, num_warps=w, num_stages=s))
    return out


def _compile(jobs: list[tuple[int, dict[str, Any]]]) -> int:
    """Worker: run each (m, config) once on small tensors with the specialization of the real
    shapes (N, K, strides multiples of 16), filling Triton's on-disk cache. Returns failures."""
    failures = 0
    w = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    for m, cfg in jobs:
        try:
            x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
            gemv(x, w, config=SkinnyConfig(**cfg))
        except Exception:
            failures += 1
    torch.cuda.synchronize()
    return failures


def precompile(ms: Sequence[int], quick: bool, jobs: int) -> int:
    """Compile every (specialization, config) of the sweep in ``jobs`` processes; Triton
    specializes integer arguments equal to 1 or divisible by 16, so M = 2, 4, 8 share kernels."""
    cuda = torch.device("cuda")
    work: dict[str, tuple[int, dict[str, Any]]] = {}
    for m in ms:
        cls = 1 if m == 1 else (16 if m % 16 == 0 else 2)
        for cfg in [*sweep_configs(m, quick), default_config(m, 4096, 4096, cuda)]:
            work.setdefault(json.dumps([cls, asdict(cfg)]), (m, asdict(cfg)))
    items = list(work.values())
    chunks = [items[i::jobs] for i in range(jobs) if items[i::jobs]]
    with ProcessPoolExecutor(len(chunks), mp_context=get_context("spawn")) as pool:
        return sum(pool.map(_compile, chunks))


def bench_shape(
    name: str, ms: Sequence[int], copy_bw: float, quick: bool, do_sweep: bool, out: TextIO
) -> list[dict[str, Any]]:
    """Every M and launch shape on one weight shape; returns the per-M best records."""
    n, k = SHAPES[name]
    copies = max(2, math.ceil(BYTES_PER_REPLAY / (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    best = [bench_m(name, weights, m, copy_bw, quick, do_sweep, out) for m in ms]
    del weights
    torch.cuda.empty_cache()
    return [b for b in best if b is not None]


def bench_m(
    name: str,
    weights: list[torch.Tensor],
    m: int,
    copy_bw: float,
    quick: bool,
    do_sweep: bool,
    out: TextIO,
) -> dict[str, Any] | None:
    """cuBLAS, the default launch shape and the sweep at ``m`` rows; the best, or None."""
    n, k = weights[0].shape
    wbytes = n * k * 2
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x, weights[0]).float()
    base = {"part": "gemv", "shape": name, "n": n, "k": k, "m": m}

    def rate(us: float) -> dict[str, Any]:
        return {
            "us": round(us, 2),
            "gb_per_s": round(wbytes / us / 1e3, 1),
            "of_copy": round(wbytes / us / 1e-6 / copy_bw, 3),
        }

    cublas = {
        **base,
        "impl": "cublas",
        **rate(graph_us([partial(F.linear, x, w) for w in weights])),
    }
    emit(cublas, out)
    ours: list[dict[str, Any]] = []
    default = default_config(m, n, k, torch.device("cuda"))
    sweep = sweep_configs(m, quick) if do_sweep else []
    for label, cfg in [("default", default)] + [("sweep", c) for c in sweep]:
        rec = {**base, "impl": f"triton_{label}", "config": asdict(cfg)}
        try:
            err = float((gemv(x, weights[0], config=cfg).float() - want).abs().max())
            us = graph_us([partial(gemv, x, w, config=cfg) for w in weights])
        except Exception as exc:
            emit({**rec, "error": repr(exc)[:300]}, out)
            continue
        rec.update(rate(us), max_err=err, vs_cublas=round(cublas["us"] / us, 3))
        emit(rec, out)
        ours.append(rec)
    if not ours:
        return None
    top = min(ours, key=lambda r: r["us"])
    summary = {
        **base,
        "part": "gemv_best",
        "cublas_us": cublas["us"],
        "cublas_of_copy": cublas["of_copy"],
        "best_us": top["us"],
        "best_of_copy": top["of_copy"],
        "best_vs_cublas": top["vs_cublas"],
        "best_config": top["config"],
    }
    if ours[0]["impl"] == "triton_default":
        summary["default_us"] = ours[0]["us"]
        summary["default_vs_cublas"] = ours[0]["vs_cublas"]
    emit(summary, out)
    return summary


def _act_after(
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """SiLU(gate) * up of ``linear(x, w)`` (``kernels/fused.gated_act``)."""
    from espalier.kernels.fused import gated_act

    return gated_act(linear(x, w), gelu=False)


def bench_gated(ms: Sequence[int], copy_bw: float, out: TextIO) -> None:
    """The MLP's gate/up projection + activation at default launch shapes: cuBLAS +
    ``gated_act`` (the model without the kernel), ``gemv`` + ``gated_act``, and ``gated_gemv``
    (one launch); whether the last two agree bit for bit."""
    n, k = SHAPES["gate_up"]
    copies = max(2, math.ceil(BYTES_PER_REPLAY / (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) / 8
        try:
            times = {
                "cublas_act_us": graph_us([partial(_act_after, F.linear, x, w) for w in weights]),
                "gemv_act_us": graph_us([partial(_act_after, gemv, x, w) for w in weights]),
                "gated_gemv_us": graph_us([partial(gated_gemv, x, w, gelu=False) for w in weights]),
            }
            same = torch.equal(
                gated_gemv(x, weights[0], gelu=False), _act_after(gemv, x, weights[0])
            )
        except Exception as exc:
            emit({"part": "gated", "m": m, "error": repr(exc)[:300]}, out)
            continue
        emit(
            {
                "part": "gated",
                "shape": "gate_up",
                "m": m,
                **{key: round(us, 2) for key, us in times.items()},
                "gated_of_copy": round(n * k * 2 / times["gated_gemv_us"] / 1e-6 / copy_bw, 3),
                "vs_cublas_act": round(times["cublas_act_us"] / times["gated_gemv_us"], 3),
                "bitwise_equal_to_gemv_act": same,
            },
            out,
        )
    del weights
    torch.cuda.empty_cache()


def emit(record: dict[str, Any], out: TextIO | None = None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ms", default="1,2,4,8,16")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--out", default="/dev/null", help="also write the JSON lines here")
    parser.add_argument("--quick", action="store_true", help="a few launch shapes only")
    parser.add_argument("--jobs", type=int, default=12, help="compile processes (0: lazily)")
    parser.add_argument("--no-sweep", action="store_true", help="default launch shapes only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        emit({"skipped": "CUDA not available"})
        return 0
    ms = [int(m) for m in args.ms.split(",")]
    with open(args.out, "w") as out:
        if args.jobs and not args.no_sweep:
            emit({"part": "precompile", "failures": precompile(ms, args.quick, args.jobs)}, out)
        bw = copy_bandwidth()
        emit(
            {
                "part": "bandwidth",
                "copy_tb_per_s": round(bw / 1e12, 3),
                "device": torch.cuda.get_device_name(),
            },
            out,
        )
        best: list[dict[str, Any]] = []
        for name in args.shapes.split(","):
            best += bench_shape(name, ms, bw, args.quick, not args.no_sweep, out)
        bench_gated(ms, bw, out)
        by_m: dict[int, list[float]] = {}
        for rec in best:
            by_m.setdefault(rec["m"], []).append(rec["best_vs_cublas"])
        emit(
            {
                "part": "summary",
                "copy_tb_per_s": round(bw / 1e12, 3),
                "min_best_vs_cublas_by_m": {m: min(v) for m, v in by_m.items()},
            },
            out,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
