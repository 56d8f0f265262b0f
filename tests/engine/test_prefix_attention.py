"""Prefill that starts after a shared cached prefix, on each attention backend: a request whose
first ``cached`` cache entries are another request's blocks (read-only) computes the rest and
gets the logits of a full prefill of its own prompt; the shared blocks are not written.

CPU: torch SDPA (full and sliding-window layers). GPU (``gpu``-marked): flashinfer and SDPA, and
the engine on flashinfer with CUDA graphs (plain, constrained and speculative requests), greedy
outputs identical with the prefix cache on and off.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from espalier.engine.model.runner import ModelRunner, SeqInput
from tests.fixtures.spec_helpers import one_thread, random_runner, tiny_config  # noqa: F401 (autouse fixture)

BLOCK = 4


def prompts() -> tuple[list[int], list[int]]:
    """Two prompts sharing their first 32 tokens (8 blocks of 4), then differing."""
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 90, (32,), generator=gen).tolist()
    a = shared + torch.randint(3, 90, (5,), generator=gen).tolist()
    b = shared + torch.randint(3, 90, (11,), generator=gen).tolist()
    return a, b


def shared_prefix_logits(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of b after a's cached prefix, logits of b prefilled alone), all rows + a decode."""
    a, b = prompts()
    a_table = list(range(0, 10))
    runner.forward([SeqInput(a_table, a, 0, logits="none")])
    snapshot = [t[:8].clone() for t in runner.kv_cache.k + runner.kv_cache.v]
    # b: blocks 0-7 are a's (32 cached entries), then its own; prefilled in two chunks
    b_table = a_table[:8] + [20, 21, 22]
    first = runner.forward([SeqInput(b_table, b[32:37], 32, logits="all")]).logits
    second = runner.forward([SeqInput(b_table, b[37:], 37, logits="all")]).logits
    decode = runner.forward([SeqInput(b_table, [7], len(b))]).logits
    after = [t[:8] for t in runner.kv_cache.k + runner.kv_cache.v]
    assert all(torch.equal(x, y) for x, y in zip(snapshot, after)), "a shared block was written"
    alone_table = list(range(40, 52))
    alone = runner.forward([SeqInput(alone_table, b, 0, logits="all")]).logits[32:]
    alone_decode = runner.forward([SeqInput(alone_table, [7], len(b))]).logits
    return torch.cat([first, second, decode]), torch.cat([alone, alone_decode])


@pytest.mark.parametrize("window", [None, 6])
def test_sdpa_prefill_after_a_shared_prefix_equals_a_full_prefill(window: int | None) -> None:
    runner = random_runner(tiny_config(97, window=window), seed=5, block_size=BLOCK)
    assert runner.attention.name == "sdpa"
    got, want = shared_prefix_logits(runner)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("backend", ["flashinfer", "sdpa"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_prefill_after_a_shared_prefix_equals_a_full_prefill(
    backend: str, window: int | None
) -> None:
    from tests.fixtures.gpu_models import gpu_config, gpu_runner, gpu_state

    """bf16. On flashinfer the short chunks and the decode attend with the small-query kernel
    and the full prefill with flashinfer's prefill kernel, so the bound is the one the other
    cross-kernel tests use (2 % of the largest logit: bf16's step is 0.125 at the |logit| of
    about 24 here); SDPA runs one kernel for both."""
    config = gpu_config(97, window=window)
    runner = gpu_runner(config, gpu_state(config, 5), backend=backend, block_size=BLOCK)
    assert runner.attention.name == backend
    got, want = (t.float() for t in shared_prefix_logits(runner))
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 0.02 * scale
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_engine_with_graphs_is_the_same_with_and_without_the_cache(
    toy_tokenizer: Any, speculative: bool
) -> None:
    """Plain and constrained requests in one batch, decoding plainly or speculatively (n-gram
    trees verified in CUDA graphs), on flashinfer with decode graphs: two waves over one system
    prompt, the second finding it cached; greedy outputs equal those without the cache."""
    from espalier.constrained.spec import GrammarSpec
    from espalier.engine.api import GenerationRequest, SamplingParams
    from espalier.engine.engine import Engine, EngineConfig
    from espalier.engine.scheduler import SchedulerConfig
    from espalier.engine.spec.ngram import NgramConfig, NgramDrafter
    from espalier.engine.spec.strategy import SpecConfig, install
    from tests.fixtures.gpu_models import gpu_config, gpu_runner, gpu_state

    config = gpu_config(toy_tokenizer.vocab_size, window=8)
    state = gpu_state(config, 7)
    system = list(range(10, 60)) + list(range(10, 30))  # repeats: the n-gram drafter finds drafts
    schema = GrammarSpec.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}}})

    def run(prefix_caching: bool) -> tuple[dict[str, list[int]], dict[str, Any]]:
        runner = gpu_runner(
            config,
            state,
            backend="flashinfer",
            graphs=(1, 2, 4, 8),
            trees=(8,) if speculative else (),
            block_size=8,
        )
        assert runner.graphs is not None
        sched = SchedulerConfig(
            max_num_batched_tokens=64, block_size=8, prefix_caching=prefix_caching
        )
        engine = Engine(EngineConfig(scheduler=sched), runner, toy_tokenizer)
        if speculative:
            drafters = {"ngram": NgramDrafter(NgramConfig(1, 3))}
            install(engine, SpecConfig(num_draft_tokens=5, mask_budget_s=None), drafters)
        out: dict[str, list[int]] = {}
        drafted = 0
        for wave in range(2):
            for i in range(4):
                rid = f"w{wave}-{i}"
                engine.add_request(
                    GenerationRequest(
                        rid,
                        prompt_token_ids=system + [70 + i, 71 + wave],
                        sampling=SamplingParams(max_tokens=12),
                        grammar=schema if i % 2 else None,
                    )
                )
                out[rid] = []
            while engine.has_unfinished():
                for chunk in engine.step():
                    out[chunk.request_id].extend(chunk.token_ids)
                    if chunk.finished and chunk.speculative is not None:
                        drafted += chunk.speculative.draft_tokens
        stats = engine.stats()
        assert engine.pool.num_free_blocks == engine.pool.num_blocks  # nothing leaked
        assert sum(runner.graphs.replays.values()) > 0
        engine.close()
        return out, {"hit_tokens": stats["prefix_hit_tokens"], "drafted": drafted}

    with_cache, on = run(True)
    without, off = run(False)
    assert with_cache == without
    assert on["hit_tokens"] >= 4 * 64 and off["hit_tokens"] == 0  # the second wave: 8 blocks each
    if speculative:
        assert on["drafted"] > 0 and off["drafted"] > 0
