"""The skinny GEMM (Triton, interpreted on CPU) against its torch twin and ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from espalier.kernels import reference
from espalier.kernels.gemv import SkinnyConfig, gated_gemv, gemv


def _operands(
    m: int, n: int, k: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return x, weight, bias


def _close(ours: torch.Tensor, want: torch.Tensor, roundings: int = 1) -> None:
    """Equal up to ``roundings`` roundings of the output dtype (the fp32 sums differ in order)."""
    tol = roundings * {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[want.dtype]
    torch.testing.assert_close(ours.float(), want.float(), rtol=tol, atol=tol)


# N not a multiple of the 4/16-row blocks, K with and without a tail (32-column steps)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 37, 96), (1, 8, 100), (3, 21, 64), (8, 19, 72)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_config_matches_twin(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    x, weight, bias = _operands(m, n, k, dtype, seed=m * 1000 + n + k)
    _close(gemv(x, weight, backend="triton"), reference.linear(x, weight))
    _close(gemv(x, weight, bias, backend="triton"), reference.linear(x, weight, bias))
    _close(reference.linear(x, weight, bias), F.linear(x, weight, bias))


@pytest.mark.parametrize(
    "config",
    [
        SkinnyConfig(use_dot=False, block_m=1, block_n=8, block_k=64),
        SkinnyConfig(use_dot=False, block_m=2, block_n=2, block_k=16),
        SkinnyConfig(use_dot=True, block_m=16, block_n=16, block_k=64),
    ],
)
@pytest.mark.parametrize("m", [1, 2])
def test_every_variant_matches_twin(config: SkinnyConfig, m: int) -> None:
    if config.block_m < m:
        pytest.skip("config holds fewer rows")
    x, weight, bias = _operands(m, 40, 80, torch.bfloat16, seed=7 + m)
    _close(
        gemv(x, weight, bias, config=config, backend="triton"), reference.linear(x, weight, bias)
    )


@pytest.mark.parametrize("k", [80, 64, 20, 0])
def test_loop_variants_match_twin(k: int) -> None:
    """The peeled first K step (FMA tiles) and the plain loop (tensor-core tiles), over K of
    several steps, one whole step, less than one step and none (64-column steps)."""
    for config, m in [
        (SkinnyConfig(use_dot=False, block_m=1, block_n=8, block_k=64), 1),
        (SkinnyConfig(use_dot=True, block_m=16, block_n=16, block_k=64), 3),
    ]:
        x, weight, bias = _operands(m, 24, k, torch.bfloat16, seed=k + m)
        ours = gemv(x, weight, bias, config=config, backend="triton")
        _close(ours, reference.linear(x, weight, bias))
        gate_up = torch.cat([weight, weight.flip(0)])
        gated = gated_gemv(x, gate_up, gelu=False, config=config, backend="triton")
        _close(gated, reference.gated_linear(x, gate_up, gelu=False), roundings=4)  # as below


def test_strided_operands() -> None:
    """x a row-strided view, weight a row slice of a fused weight (as ``fuse_projections``)."""
    x_wide, fused, _ = _operands(2, 48, 64, torch.bfloat16, seed=3)
    x = torch.randn(2, 96).to(torch.bfloat16)[:, 16:80]
    weight = fused[8:40]
    assert x.stride(0) == 96 and weight.data_ptr() != fused.data_ptr()
    _close(gemv(x, weight, backend="triton"), reference.linear(x, weight))
    _close(gemv(x_wide, fused, backend="triton"), reference.linear(x_wide, fused))


def test_torch_backend_is_the_twin() -> None:
    x, weight, bias = _operands(4, 10, 12, torch.float32, seed=1)
    assert torch.equal(gemv(x, weight, bias, backend="torch"), reference.linear(x, weight, bias))


def test_rejects_bad_operands() -> None:
    x, weight, _ = _operands(2, 8, 16, torch.float32, seed=0)
    with pytest.raises(ValueError):
        gemv(torch.zeros(17, 16), weight, backend="torch")
    with pytest.raises(ValueError):
        gemv(x, weight[:, :8], backend="torch")
    with pytest.raises(TypeError):
        gemv(x, weight.to(torch.bfloat16), backend="torch")
    with pytest.raises(ValueError):
        gemv(x, weight, torch.zeros(7), backend="torch")
    with pytest.raises(ValueError):  # a DOT config needs a 16-row tile
        gemv(x, weight, config=SkinnyConfig(True, 8, 16, 16), backend="triton")


@pytest.mark.parametrize(("m", "i", "k"), [(1, 19, 96), (3, 8, 100), (8, 21, 64)])
@pytest.mark.parametrize("gelu", [False, True])
def test_gated_matches_twin_and_the_unfused_kernels(m: int, i: int, k: int, gelu: bool) -> None:
    """One launch for gate, up and the activation: the twin's values, and those of the plain
    kernel followed by the activation. Not bit for bit here: the interpreter rounds fp32 to
    bf16 toward zero (the GPU to nearest; ``bench/gemv.py`` checks the bits there)."""
    x, gate_up, _ = _operands(m, 2 * i, k, torch.bfloat16, seed=m + i + k)
    ours = gated_gemv(x, gate_up, gelu=gelu, backend="triton")
    assert ours.shape == (m, i)
    # gate, up, act and product are each rounded (toward zero here: up to 4 bf16 ulps apart)
    _close(ours, reference.gated_linear(x, gate_up, gelu=gelu), roundings=4)
    gate, up = gemv(x, gate_up, backend="triton").chunk(2, dim=-1)
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    _close(ours, act * up, roundings=4)
    with pytest.raises(ValueError):
        gated_gemv(x, gate_up[1:], gelu=gelu, backend="torch")
