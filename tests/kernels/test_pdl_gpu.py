"""Programmatic dependent launch (``kernels/pdl.py``) on CUDA: chains of dependent kernels give
bit for bit the results of plain stream order, eager and inside a CUDA graph (skipped without a
GPU; on a device older than sm90 both sides run without PDL)."""

from __future__ import annotations

import pytest
import torch

from espalier.kernels.gemv import gated_gemv, gemv
from espalier.kernels.options import DEFAULT_KERNELS, KernelOptions
from espalier.kernels.pdl import pdl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _chain(x: torch.Tensor, weights: list[torch.Tensor], options: KernelOptions) -> torch.Tensor:
    """``x [1, 1024]`` through a GEMV per weight (``[2048, 1024]`` and ``[1024, 2048]`` in turn;
    three of the latter are gated GEMVs from ``[2048, 2048]``): every launch reads the previous
    launch's output, so a kernel that did not wait for it would read a stale row."""
    for w in weights:
        if w.shape == (2048, 2048):
            x = gated_gemv(x, w, gelu=False, options=options)
        else:
            x = gemv(x, w, options=options)
    return x


def _weights(gen: torch.Generator) -> list[torch.Tensor]:
    out = []
    for i in range(60):
        n, k = (2048, 1024) if i % 2 == 0 else (1024, 2048)
        if i in (5, 25, 45):  # gated: gate and up rows [2 x 1024, 2048]
            n = 2048
        out.append(torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5)
    return out


@pytest.mark.parametrize("graph", [False, True])
def test_dependent_chain_matches_plain_stream_order(graph: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.device("cuda")
    weights = _weights(gen)
    inputs = [
        torch.randn(1, 1024, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(3)
    ]

    plain, on = KernelOptions(pdl=False), DEFAULT_KERNELS
    assert not pdl(dev, 1, plain)
    want = [_chain(x, weights, plain) for x in inputs]
    if not graph:
        got = [_chain(x, weights, on) for x in inputs]
    else:
        x = inputs[0].clone()
        _chain(x, weights, on)  # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = _chain(x, weights, on)
        got = []
        for new in inputs:
            x.copy_(new)
            g.replay()
            got.append(out.clone())
    torch.cuda.synchronize()
    for w, o in zip(want, got):
        assert torch.equal(w, o)
    for w in want:  # the chain kept a signal (neither vanished nor overflowed)
        assert 0 < float(w.float().abs().max()) < float("inf")


def test_pdl_follows_the_device_and_the_rows() -> None:
    dev = torch.device("cuda")
    major, _ = torch.cuda.get_device_capability()
    on = DEFAULT_KERNELS
    assert pdl(dev, 1, on) == (major >= 9)
    assert not pdl(dev, on.pdl_max_rows + 1, on)
    assert pdl(dev, 4, KernelOptions(pdl_max_rows=4)) == (major >= 9)
    assert not pdl(dev, 1, KernelOptions(pdl=False))
    assert not pdl(torch.device("cpu"), 1, on)
