"""The skinny GEMM on CUDA against ``F.linear`` (cuBLAS), on 8B-Llama shapes (skipped without a
GPU); and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from espalier.kernels.gemv import SkinnyConfig, gated_gemv, gemv, preferred
from espalier.kernels.options import KernelOptions
from espalier.kernels.pdl import pdl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (1000, 200)]


def _assert_bf16_close(ours: torch.Tensor, want: torch.Tensor) -> None:
    """Within a few bf16/fp16 roundings of the output scale (the fp32 sums differ in order)."""
    scale = float(want.float().abs().max())
    err = float((ours.float() - want.float()).abs().max())
    assert err <= 1e-2 * scale, (err, scale)


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_matches_cublas(n: int, k: int, m: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k**0.5
    ours = gemv(x, weight)
    assert ours.shape == (m, n) and ours.dtype == torch.bfloat16 and ours.is_contiguous()
    _assert_bf16_close(ours, F.linear(x, weight))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "config",
    [None, SkinnyConfig(False, 4, 4, 256), SkinnyConfig(True, 16, 32, 128, num_stages=3)],
)
def test_dtypes_bias_and_strides(dtype: torch.dtype, config: SkinnyConfig | None) -> None:
    """fp16/fp32 too, a bias, x a strided view, weight a row slice of a fused weight."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    fused = torch.randn(3000, 512, device="cuda", generator=gen).to(dtype) / 512**0.5
    weight = fused[1024:2560]
    x = torch.randn(3, 640, device="cuda", generator=gen).to(dtype)[:, 64:576]
    bias = torch.randn(weight.shape[0], device="cuda", generator=gen).to(dtype)
    _assert_bf16_close(gemv(x, weight, bias, config=config), F.linear(x, weight, bias))
    assert preferred(x, weight, bias) == (dtype != torch.float32)


def test_graph_replay_matches_eager() -> None:
    """Captured in a CUDA graph, replayed on new inputs: the eager result, bit for bit."""
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    gemv(x, weight)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, weight)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemv(x, weight))


@pytest.mark.parametrize("m", [1, 2, 8, 16])
@pytest.mark.parametrize("gelu", [False, True])
def test_gated_matches_cublas_and_act(m: int, gelu: bool) -> None:
    """``gated_gemv`` on the 8B gate/up shape against cuBLAS followed by the torch activation."""
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    gate_up = torch.randn(28672, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) / 64
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    ours = gated_gemv(x, gate_up, gelu=gelu)
    assert ours.shape == (m, 14336) and ours.dtype == torch.bfloat16
    _assert_bf16_close(ours, act * up)


@pytest.mark.parametrize("gate_up_m1", [True, False])
def test_preferred_follows_the_h200_sweep(gate_up_m1: bool) -> None:
    """The static rule on the 8B-Llama shapes (see ``preferred``); at M = 1 under PDL the
    gate/up projection too, unless ``KernelOptions.gate_up_m1_under_pdl`` is off."""
    options = KernelOptions(gate_up_m1_under_pdl=gate_up_m1)
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096)}
    shapes |= {"down": (4096, 14336), "lm_head": (128256, 4096)}
    picked: dict[int, set[str]] = {}
    for m in (1, 2, 16, 17):
        picked[m] = set()
        for name, (n, k) in shapes.items():
            x = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
            if preferred(x, torch.empty(n, k, device="cuda", dtype=torch.bfloat16), None, options):
                picked[m].add(name)
    under_pdl = {"gate_up"} if gate_up_m1 and pdl(torch.device("cuda"), 1, options) else set()
    assert picked[1] == {"qkv", "o", "down", "lm_head"} | under_pdl
    assert picked[2] == picked[16] == {"o", "gate_up", "lm_head"}
    assert picked[17] == set()
