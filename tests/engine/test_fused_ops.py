"""Fused decoder-layer kernels (``engine/models/fused.py``) against the torch layer code.

On CUDA they run as compiled Triton kernels; on the CPU in Triton's interpreter (scripts/test.sh
sets ``TRITON_INTERPRET=1``), skipped otherwise. bf16 outputs may differ from the torch twin by
one rounding step where the fp32 statistics are summed in another order (and in the interpreter,
which truncates fp32 -> bf16 casts instead of rounding them to nearest).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from espalier.engine.models import fused
from espalier.engine.models.layers import GemmaRMSNorm, RMSNorm, apply_rope, rope_cos_sin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm(dtype: torch.dtype, gemma: bool) -> None:
    torch.manual_seed(0)
    norm = (GemmaRMSNorm if gemma else RMSNorm)(96, 1e-6)
    with torch.no_grad():
        norm.weight.add_(torch.randn(96) * 0.3)
    norm = norm.to(dtype)
    x = torch.randn(5, 3, 96, dtype=dtype) * 3
    want = norm(x)  # CPU: the torch path
    got = fused.rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), 1e-6, gemma=gemma)
    assert got.shape == x.shape and got.dtype == dtype
    close(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_on_views_of_a_fused_projection(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    t, hq, hk, d = 4, 4, 2, 16
    qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_cos_sin(inv_freq, torch.tensor([0, 7, 7, 31]), dtype)
    dev = torch.device(DEVICE)
    got_q, got_k = fused.rope(
        qkv.to(dev)[:, : hq * d].view(t, hq, d),
        qkv.to(dev)[:, hq * d : (hq + hk) * d].view(t, hk, d),
        cos.to(dev),
        sin.to(dev),
    )
    assert got_q.is_contiguous() and got_k.shape == (t, hk, d)
    # one bf16 step apart at most: Triton's conversions may not round after every product the
    # way torch's separate kernels do (and the CPU interpreter truncates fp32 -> bf16 casts)
    tol = {"rtol": 1.6e-2, "atol": 1e-2}
    torch.testing.assert_close(got_q.cpu(), apply_rope(q, cos, sin), **tol)
    torch.testing.assert_close(got_k.cpu(), apply_rope(k, cos, sin), **tol)


@pytest.mark.parametrize("gelu", [False, True])
def test_gated_act(gelu: bool) -> None:
    torch.manual_seed(2)
    gate_up = torch.randn(3, 2 * 1500, dtype=torch.bfloat16) * 2
    gate, up = gate_up[:, :1500], gate_up[:, 1500:]
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    got = fused.gated_act(gate_up.to(DEVICE), gelu=gelu)
    close(got.cpu(), act * up)


def test_fuse_projections_keeps_the_state_dict() -> None:
    from espalier.engine.config import ModelConfig
    from espalier.engine.models.llama import LlamaForCausalLM

    config = ModelConfig("llama", 50, 32, 48, 2, 4, 2, 8)
    model = LlamaForCausalLM(config, qkv_bias=False, o_bias=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fused.fuse_projections(model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv_weight is not None and attn.qkv_weight.shape == (32 + 16 + 16, 32)
    assert mlp.gate_up_weight is not None and mlp.gate_up_weight.shape == (96, 32)
    assert attn.k_proj.weight.data_ptr() == attn.qkv_weight[32:].data_ptr()  # a view
