"""Fused decoder-layer kernels (``kernels/fused.py``) against the torch layer code.

On CUDA they run as compiled Triton kernels; on the CPU in Triton's interpreter (scripts/test.sh
sets ``TRITON_INTERPRET=1``), skipped otherwise. bf16 outputs may differ from the torch twin by
one rounding step where the fp32 statistics are summed in another order (and in the interpreter,
which truncates fp32 -> bf16 casts instead of rounding them to nearest; the norm kernels round
explicitly, so in the interpreter their bf16 outputs match torch bit for bit).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from espalier.engine.model.models.layers import (
    GemmaRMSNorm,
    RMSNorm,
    RMSNormBase,
    apply_rope,
    rope_cos_sin,
)
from espalier.kernels import fused

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_store_writes_the_cache_as_rope_and_write(dtype: torch.dtype) -> None:
    """``rope_store`` on views of a fused projection: q is ``rope``'s q, and the cache holds
    ``rope``'s k and the unrotated v at the given slots, bit for bit, every other slot untouched
    (``KVCache.write`` after ``rope``, the path it replaces)."""
    from espalier.engine.kv_cache import KVCache

    torch.manual_seed(3)
    t, hq, hk, d, blocks, bs = 5, 4, 2, 32, 4, 4
    dev = torch.device(DEVICE)
    qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=dtype).to(dev)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_cos_sin(inv_freq, torch.tensor([0, 3, 9, 9, 40]), dtype)
    cos, sin = cos.to(dev), sin.to(dev)
    slots = torch.tensor([13, 2, 7, 0, 14], device=dev)  # scattered over blocks, not in order

    def cache() -> KVCache:
        shape = (blocks, bs, hk, d)
        k_data = [torch.randn(shape).to(dtype).to(dev)]
        return KVCache(k=k_data, v=[torch.randn(shape).to(dtype).to(dev)], block_size=bs)

    torch.manual_seed(4)
    want_cache = cache()
    want_q, want_k = fused.rope(q, k, cos, sin)
    want_cache.write(0, slots, want_k, v)
    torch.manual_seed(4)
    got_cache = cache()
    got_q = fused.rope_store(q, k, v, cos, sin, *got_cache.flat(0), slots)
    assert got_q.is_contiguous() and got_q.shape == (t, hq, d)
    identical(got_q.cpu(), want_q.cpu())
    identical(got_cache.k[0].cpu(), want_cache.k[0].cpu())
    identical(got_cache.v[0].cpu(), want_cache.v[0].cpu())


def test_rope_store_refuses_slots_of_another_shape() -> None:
    t, h, d = 2, 2, 16
    x = torch.zeros(t, h, d, dtype=torch.bfloat16, device=DEVICE)
    flat = torch.zeros(8, h, d, dtype=torch.bfloat16, device=DEVICE)
    cos = torch.ones(t, 1, d, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="slots"):
        fused.rope_store(x, x, x, cos, cos, flat, flat, torch.zeros(3, dtype=torch.int64))


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
    from espalier.engine.model.models.llama import LlamaForCausalLM

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


def identical(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-for-bit equal, NaNs included (as NaNs: their payloads may differ by platform)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    bits = {2: torch.int16, 4: torch.int32}[want.element_size()]
    assert torch.equal(got[~nan].view(bits), want[~nan].view(bits))


def random_norm(cls: type[RMSNormBase], width: int, dtype: torch.dtype) -> RMSNormBase:
    norm = cls(width, 1e-6)
    with torch.no_grad():
        norm.weight.add_(torch.randn(width) * 0.3)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("shape", [(5, 3, 96), (7, 100), (3, 1000), (2, 2050)])
def test_add_rms_norm(dtype: torch.dtype, gemma: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(shape[-1])
    norm = random_norm(GemmaRMSNorm if gemma else RMSNorm, shape[-1], dtype)
    x = (torch.randn(shape) * 3).to(dtype)
    delta = (torch.randn(shape) * 2).to(dtype)
    dev = torch.device(DEVICE)
    summed, normed = fused.add_rms_norm(
        x.to(dev), delta.to(dev), norm.weight.to(dev), 1e-6, gemma=gemma
    )
    want = x + delta  # CPU: the torch twins
    identical(summed.cpu(), want)
    # the fused pair is the add followed by the norm kernel, bit for bit (the CUDA path before)
    identical(normed, fused.rms_norm(want.to(dev), norm.weight.to(dev), 1e-6, gemma=gemma))
    # against the torch twin: the fp32 sum of squares is reduced in another order, which moves
    # fp32 outputs by an ulp or so; in bf16/fp16 that is absorbed by the final rounding (always,
    # for these inputs, in the interpreter; on the GPU a rare output may be one step apart)
    if DEVICE == "cuda":
        close(normed.cpu(), norm(want))
    elif dtype == torch.float32:
        torch.testing.assert_close(normed, norm(want), rtol=1e-6, atol=1e-6)
    else:
        identical(normed, norm(want))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, in the interpreter: inf, NaN
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_add_rms_norm_rounds_special_values_as_torch(dtype: torch.dtype) -> None:
    """Overflow to inf, inf - inf, NaN, signed zeros, ties and subnormals, as torch's add."""
    info = torch.finfo(dtype)
    pairs = [
        (info.max, info.max),
        (-info.max, -info.max),
        (float("inf"), float("-inf")),
        (float("nan"), 1.0),
        (-0.0, -0.0),
        (-0.0, 0.0),
        (1.0, info.eps / 2),  # a tie: rounds to even
        (1.0 + info.eps, info.eps / 2),  # a tie: rounds up to even
    ]
    if dtype != torch.bfloat16:  # Triton's interpreter flushes bf16 subnormals when it widens them
        pairs.append((info.tiny / 4, info.tiny / 8))
    x = torch.tensor([[a for a, _ in pairs]], dtype=dtype)
    delta = torch.tensor([[b for _, b in pairs]], dtype=dtype)
    ones = torch.ones(len(pairs), dtype=dtype, device=DEVICE)
    summed, normed = fused.add_rms_norm(x.to(DEVICE), delta.to(DEVICE), ones, 1e-6, gemma=False)
    identical(summed.cpu(), x + delta)
    assert normed.isnan().all()  # a row holding inf and NaN


def test_add_rms_norm_of_no_rows() -> None:
    x = torch.empty(0, 64, dtype=torch.bfloat16, device=DEVICE)
    summed, normed = fused.add_rms_norm(x, x, torch.ones(64, device=DEVICE), 1e-6, gemma=True)
    assert summed.shape == normed.shape == (0, 64)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny_checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    from tests.fixtures.tiny_models import make_tiny_model

    directory = tmp_path_factory.mktemp(request.param)
    make_tiny_model(request.param, directory)
    return directory


def test_fused_residual_adds_keep_the_logits(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model with the CUDA norm path forced onto the CPU (``ModelOptions``'s
    ``norm_kernels_on_cpu``): with the residual adds fused into the norms, the logits and
    captured hidden states are those of the add + norm kernels launched separately (the CUDA
    path before), bit for bit, and, bf16
    roundings being exact in the interpreter, those of the torch path. On CUDA (compiled
    kernels; the torch norm path is not used there) fused against separate, bit for bit."""
    from espalier.engine.config import CacheConfig, ModelOptions, RunnerConfig
    from espalier.engine.model.runner import ModelRunner, SeqInput

    def runner_for(options: ModelOptions) -> ModelRunner:
        config = RunnerConfig(
            device=DEVICE,
            dtype="bfloat16",
            cache=CacheConfig(block_size=4),
            attention_backend="sdpa",
            options=options,
        )
        return ModelRunner.from_pretrained(tiny_checkpoint, config)

    first = runner_for(ModelOptions())
    num_layers = first.model_config.num_layers
    tokens = random.Random(3).choices(range(first.model_config.vocab_size), k=9)
    calls = {"add_rms_norm": 0}
    add_rms_norm = fused.add_rms_norm

    def counted(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls["add_rms_norm"] += 1
        return add_rms_norm(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fused, "add_rms_norm", counted)

    def run(*, kernels: bool, fuse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        options = ModelOptions(fuse_residual_add=fuse, norm_kernels_on_cpu=kernels)
        runner = first if options == first.config.options else runner_for(options)
        # prefill 8 tokens, then decode one
        runner.forward([SeqInput(block_table=[0, 1, 2], token_ids=tokens[:8], logits="all")])
        calls["add_rms_norm"] = 0
        seq = SeqInput(block_table=[0, 1, 2], token_ids=tokens[8:], context_len=8)
        out = runner.forward([seq], hidden_layers=(0, num_layers))
        assert set(out.hidden_states) == {0, num_layers}
        return out.logits, out.hidden_states[0]

    if DEVICE == "cpu":
        torch_logits, torch_hidden = run(kernels=False, fuse=True)
        assert calls["add_rms_norm"] == 0
    unfused_logits, unfused_hidden = run(kernels=True, fuse=False)
    assert calls["add_rms_norm"] == 0
    fused_logits, fused_hidden = run(kernels=True, fuse=True)
    # in the decode forward: 2 per layer (post-attention / pre-MLP norm, next layer's input norm
    # or the final norm), less layer 1's input norm after the layer-0 capture (added eagerly)
    assert calls["add_rms_norm"] == 2 * num_layers - 1
    identical(fused_logits, unfused_logits)
    identical(fused_hidden, unfused_hidden)
    if DEVICE == "cpu":
        identical(fused_logits, torch_logits)
        identical(fused_hidden, torch_hidden)
