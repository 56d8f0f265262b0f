"""CUDA timing helpers shared by the GPU benchmarks (``gpu.py``, ``gemv.py``, ``kernels.py``).

Imported as ``cuda_timing``: a benchmark run as ``python3 bench/X.py`` has this folder on
``sys.path``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def copy_bandwidth(gib: int = 4, reps: int = 10) -> float:
    """Bytes/s of a device-to-device copy of ``gib`` GiB, read + write counted (median of
    ``reps`` after 2 warm-ups): the HBM roofline's denominator."""
    src = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (gib << 30) / statistics.median(times)


def graph_us(calls: list[Callable[[], object]], reps: int = 10) -> float:
    """Median µs per call of ``calls`` captured back to back in one CUDA graph.

    The first two calls run eagerly, then again on a side stream (compiles, cuBLAS heuristics
    and allocator pools happen outside the capture), as ``torch.cuda.graphs`` recommends.
    """
    for fn in calls[:2]:
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(times)
