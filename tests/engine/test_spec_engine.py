"""The speculative strategy inside the engine: same tokens as the plain engine, mixed batches
(speculating and plain, constrained and not, greedy and sampled), stats in the final chunk."""

from __future__ import annotations

from typing import Any

import pytest

from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import (
    ConstraintOptions,
    GenerationRequest,
    RequestOutput,
    SamplingParams,
    SpeculativeOptions,
)
from espalier.engine.engine import Engine, EngineConfig
from espalier.engine.spec.ngram import NgramConfig, NgramDrafter
from espalier.engine.spec.strategy import SpecConfig, install
from tests.fixtures.spec_helpers import SCHEMA, one_thread, random_runner, tiny_config  # noqa: F401 (autouse fixture)


def run(engine: Engine, requests: list[GenerationRequest]) -> dict[str, tuple[list[int], Any]]:
    for request in requests:
        engine.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                final[out.request_id] = out
    engine.close()
    return {rid: (tokens[rid], final[rid]) for rid in tokens}


def requests() -> list[GenerationRequest]:
    schema = GrammarSpec.json_schema(SCHEMA)
    prompts = [(5, 6, 7, 8, 5, 6, 7, 8, 5, 6), (40, 41, 42, 43, 40, 41, 42), (9,) * 20]
    off = SpeculativeOptions(enabled=False)
    xgr = ConstraintOptions(backend="xgrammar", allow_weakening=True)
    cases = [
        (prompts[0], schema, SpeculativeOptions(), ConstraintOptions()),
        (prompts[1], None, SpeculativeOptions(methods=("ngram",), num_draft_tokens=4), xgr),
        (prompts[2], schema, off, xgr),
        (prompts[1], schema, SpeculativeOptions(methods=("forced",)), xgr),
        (prompts[0], None, off, xgr),
        (prompts[2], None, SpeculativeOptions(methods=("ngram",)), xgr),
    ]
    return [
        GenerationRequest(
            f"r{i}",
            prompt_token_ids=p,
            sampling=SamplingParams(max_tokens=24),
            grammar=g,
            constraint=c,
            speculative=s,
        )
        for i, (p, g, s, c) in enumerate(cases)
    ]


def test_engine_speculative_matches_plain(toy_tokenizer: Any) -> None:
    runner = random_runner(tiny_config(toy_tokenizer.vocab_size), seed=1)
    plain = run(Engine(EngineConfig(), runner, toy_tokenizer), requests())
    engine = Engine(EngineConfig(), runner, toy_tokenizer)
    # no mask budget: which nodes get filled (so which forced chains are accepted) must not
    # depend on how busy the machine is (lossless holds either way)
    config = SpecConfig(num_draft_tokens=6, mask_budget_s=None)
    install(engine, config, {"ngram": NgramDrafter(NgramConfig(1, 3))})
    spec = run(engine, requests())
    for rid, (tokens, _) in plain.items():
        assert spec[rid][0] == tokens, rid
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    stats = spec["r0"][1].speculative
    assert stats is not None and stats.steps > 0 and stats.draft_tokens > 0
    assert spec["r3"][1].speculative.forced_tokens > 0
    assert spec["r4"][1].speculative is None  # did not speculate
    assert spec["r5"][1].speculative.accepted_tokens > 0  # a constant prompt is easy to draft


def test_engine_speculative_logprobs_match_plain(toy_tokenizer: Any) -> None:
    """Logprobs of speculated tokens come from the node each token was chosen at."""
    runner = random_runner(tiny_config(toy_tokenizer.vocab_size), seed=1)

    def logprobs(engine: Engine) -> list[Any]:
        engine.add_request(
            GenerationRequest(
                "lp",
                prompt_token_ids=(9,) * 12,
                sampling=SamplingParams(max_tokens=12, logprobs=3),
                grammar=GrammarSpec.json_schema(SCHEMA),
            )
        )
        got: list[Any] = []
        while engine.has_unfinished():
            for out in engine.step():
                got.extend(out.logprobs)
        engine.close()
        return got

    plain = logprobs(Engine(EngineConfig(), runner, toy_tokenizer))
    engine = Engine(EngineConfig(), runner, toy_tokenizer)
    install(engine, SpecConfig(), {"ngram": NgramDrafter(NgramConfig(1, 3))})
    spec = logprobs(engine)
    assert [lp.token_id for lp in spec] == [lp.token_id for lp in plain] and plain
    for a, b in zip(spec, plain):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
