"""The model's projections on CUDA: the skinny GEMM for decode rows, cuBLAS otherwise; the same
logits as cuBLAS throughout (eager and CUDA-graph replay). Skipped without a GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from espalier.engine.config import ModelOptions
from espalier.engine.model.runner import ModelRunner, SeqInput
from espalier.kernels import gemv
from tests.fixtures.gpu_models import gpu_config, gpu_runner, gpu_state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _decode_logits(runner: Any) -> list[torch.Tensor]:
    """Prefill three prompts (19 tokens: cuBLAS), then eight decode steps of the three (3 rows,
    or the graph bucket's 4); logits of every step."""
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21], [30, 31, 32, 33, 34]]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    out = [runner.forward([SeqInput(t, p, 0) for t, p in zip(tables, prompts)]).logits]
    for step in range(8):
        batch = [SeqInput(t, [40 + step], len(p) + step) for t, p in zip(tables, prompts)]
        out.append(runner.forward(batch).logits)
    return out


@pytest.mark.parametrize("graphs", [(), (1, 4)])
def test_decode_logits_match_cublas(graphs: tuple[int, ...], monkeypatch: Any) -> None:
    config = gpu_config(97, window=6)
    state = gpu_state(config, seed=2)
    cublas = ModelOptions(skinny_gemv=False)
    want = _decode_logits(
        gpu_runner(config, state, backend="flashinfer", graphs=graphs, options=cublas)
    )
    calls: dict[str, list[int]] = {"gemv": [], "gated_gemv": []}
    for name, rows in calls.items():
        real = getattr(gemv, name)

        def counting(
            x: torch.Tensor, *args: Any, real: Any = real, rows: Any = rows, **kw: Any
        ) -> Any:
            rows.append(x.shape[0])
            return real(x, *args, **kw)

        monkeypatch.setattr(gemv, name, counting)
    # the counted calls are the steps' and the captures': the construction's warm-up steps
    # (``ModelRunner.WARM_UP_ROWS``: 16 and 17 rows among them) build kernels: one row here
    monkeypatch.setattr(ModelRunner, "WARM_UP_ROWS", (1,))
    runner = gpu_runner(config, state, backend="flashinfer", graphs=graphs)
    got = _decode_logits(runner)
    assert calls["gemv"] and max(calls["gemv"]) <= 4  # decode rows; the prefill is cuBLAS
    assert calls["gated_gemv"] and min(calls["gated_gemv"]) >= 2  # M = 1: gemv + gated_act
    if graphs:
        assert runner.graphs is not None and runner.graphs.replays == {1: 8}
    for step, (w, g) in enumerate(zip(want, got)):
        scale = float(w.abs().max())
        assert torch.allclose(w, g, atol=0.02 * scale, rtol=0), step
