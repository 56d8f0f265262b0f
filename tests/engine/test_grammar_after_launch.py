"""A step's grammar work behind the next launch (``EngineConfig.grammar_after_launch``).

A step launches the next forward before its constrained tokens' closing decisions, accepts and
termination checks, and drops the launched row (or draft tree) of a request that work ends.
Outputs, finish reasons, text and logprobs are those of the step that does the grammar work
first, for a mix that ends in many ways (closed by the budget, cut unclosed, stop tokens, a
stop string, max_tokens), with seeded sampling, logprobs, unconstrained requests and requests
arriving mid-run, on every backend, in plain and in speculative decoding. Speculative runs
draft n-gram trees and grammar-forced chains (from matchers still behind the step's tokens),
and compare greedy requests: the tree sampler's draws depend on the batch, and the batches
differ by the requests ended behind a launch. A request aborted while its next step is in
flight ends ABORT without harming the others.
"""

from __future__ import annotations

from typing import Any

import pytest

from espalier.constrained.backends import BACKENDS
from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import (
    ConstraintOptions,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    SpeculativeOptions,
)
from espalier.engine.engine import AFTER_LAUNCH_MIN
from espalier.engine.spec.ngram import NgramConfig, NgramDrafter
from espalier.engine.spec.strategy import SpecConfig, SpecStepLaunch, install
from tests.fixtures.engine_fixtures import CLOSING_SCHEMA, drain, make_engine, tokens_of

PROMPTS = ["abc", "hello world", '{"id": 1', "0123", "zz top"]


SPECULATE = [
    SpeculativeOptions(methods=("ngram", "forced")),
    SpeculativeOptions(methods=("forced",), num_draft_tokens=4),
    SpeculativeOptions(methods=("ngram",), num_draft_tokens=3),
    SpeculativeOptions(enabled=False),
]


def _mix(backend: str) -> list[GenerationRequest]:
    grammars: list[GrammarSpec | None] = [
        GrammarSpec.json_schema(CLOSING_SCHEMA),
        GrammarSpec.regex("[a-c]{2,6}"),  # the grammar ends most of these early
        GrammarSpec.choice(["alpha", "beta", "gamma delta"]),
        GrammarSpec.json_schema({"type": "array", "items": {"type": "integer"}}),
        None,
    ]
    out = []
    for i, prompt in enumerate(PROMPTS):
        for j, grammar in enumerate(grammars):
            sampling = SamplingParams(
                max_tokens=(12, 24, 40)[(i + j) % 3],
                temperature=0.0 if (i + j) % 2 else 0.8,
                seed=i * 7 + j,
                logprobs=2 if j == 1 else 0,
                stop=[","] if (i, j) == (1, 0) else [],
            )
            out.append(
                GenerationRequest(
                    f"r{i}-{j}",
                    prompt=prompt,
                    sampling=sampling,
                    grammar=grammar,
                    constraint=ConstraintOptions(backend=backend),
                    speculative=SPECULATE[(i + 2 * j) % len(SPECULATE)],
                )
            )
    return out


def _engine(after: bool, speculative: bool, least: int = 1, **kwargs: Any) -> Any:
    """An engine over the tiny model; ``after``: launching ahead when ``least`` requests'
    grammar work can wait (1: whenever one can, so every path is taken)."""
    engine = make_engine(grammar_after_launch=least if after else 0, **kwargs)
    if speculative:  # no mask budget: the filled nodes must not depend on the machine's load
        config = SpecConfig(num_draft_tokens=6, mask_budget_s=None)
        install(engine, config, {"ngram": NgramDrafter(NgramConfig(1, 3))})
    return engine


def _run(
    after: bool, backend: str, speculative: bool = False
) -> tuple[dict[str, list[Any]], int, int]:
    """Chunks by request (half the requests arrive after three steps), how many steps left
    a launched step in flight (of the speculative strategy's own, when ``speculative``) and
    how many launched rows the grammar's verdicts dropped."""
    engine = _engine(after, speculative, max_num_batched_tokens=256)
    requests = _mix(backend)
    for request in requests[::2]:
        engine.add_request(request)
    chunks: dict[str, list[Any]] = {}
    in_flight = 0
    for step in range(2000):
        if step == 3:
            for request in requests[1::2]:
                engine.add_request(request)
        if step > 3 and not engine.has_unfinished():
            break
        for out in engine.step():
            chunks.setdefault(out.request_id, []).append(out)
        launched = engine._inflight
        in_flight += launched is not None and (
            not speculative or isinstance(launched, SpecStepLaunch)
        )
    assert not engine.has_unfinished()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks  # none leaked, none freed twice
    engine.close()
    return chunks, in_flight, engine.stats()["dropped_rows"]


def _summary(chunks: list[Any]) -> tuple[Any, ...]:
    last = chunks[-1]
    logprobs = [(lp.token_id, round(lp.logprob, 4)) for c in chunks for lp in c.logprobs]
    text = "".join(c.text_delta for c in chunks)
    valid = last.validation.valid if last.validation is not None else None
    return tokens_of(chunks), last.finish_reason, last.closed_by_budget, text, logprobs, valid


def _drafted(chunks: list[Any]) -> tuple[int, ...] | None:
    stats = chunks[-1].speculative
    if stats is None:
        return None
    return stats.steps, stats.draft_tokens, stats.accepted_tokens, stats.forced_tokens


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_equal_those_of_grammar_work_first(backend: str, speculative: bool) -> None:
    first, none_in_flight, none_dropped = _run(False, backend, speculative)
    after, in_flight, dropped = _run(True, backend, speculative)
    assert none_in_flight == 0 and in_flight > 10  # the path under test did run
    assert none_dropped == 0 and dropped > 0  # and requests ended behind a launch
    assert sorted(after) == sorted(first)
    sampled = {r.request_id for r in _mix(backend) if r.sampling.temperature > 0}
    for request_id in first:
        if speculative and request_id in sampled:
            # the tree sampler's draws follow the batch's last logit bits (the plain sampler
            # certifies its own), and a request the grammar ends stays in the launched batch
            last = after[request_id][-1]
            assert last.finished and last.finish_reason is not FinishReason.ERROR, request_id
            if last.validation is not None and last.finish_reason is FinishReason.STOP:
                assert last.validation.valid, request_id
            continue
        assert _summary(after[request_id]) == _summary(first[request_id]), request_id
        if speculative:  # the same trees: forced chains drafted after the tokens behind
            assert _drafted(after[request_id]) == _drafted(first[request_id]), request_id
    reasons = {first[r][-1].finish_reason for r in first}
    assert {FinishReason.STOP, FinishReason.LENGTH} <= reasons
    assert any(first[r][-1].closed_by_budget for r in first)
    if speculative:
        stats = [after[r][-1].speculative for r in after]
        assert sum(s.forced_tokens for s in stats if s is not None) > 0
        assert sum(s.accepted_tokens for s in stats if s is not None) > 0


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_a_request_aborted_in_flight_ends_alone(speculative: bool) -> None:
    engine = _engine(True, speculative)
    requests = _mix("llguidance")[:8]
    for request in requests:
        engine.add_request(request)
    chunks: dict[str, list[Any]] = {}
    victim = None
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            chunks.setdefault(out.request_id, []).append(out)
        launched = engine._inflight
        if victim is None and launched is not None:
            live = [s.request for s in launched.plan.seqs if s.request.matcher is not None]
            if live:
                victim = live[0].request_id
                assert engine.abort(victim)
    assert victim is not None
    assert chunks[victim][-1].finish_reason is FinishReason.ABORT
    assert sum(c.finished for c in chunks[victim]) == 1
    reference = _engine(False, speculative)  # the same requests, none aborted
    for request in requests:
        reference.add_request(request)
    alone = drain(reference)
    greedy = {r.request_id for r in requests if r.sampling.temperature == 0}
    compared = 0
    for request_id, got in chunks.items():
        if request_id != victim and (not speculative or request_id in greedy):
            assert tokens_of(got) == tokens_of(alone[request_id]), request_id
            compared += 1
    assert compared >= 3


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_few_deferrable_requests_do_not_launch_ahead(speculative: bool) -> None:
    """Below ``AFTER_LAUNCH_MIN`` requests whose grammar work could wait, the step does that
    work first: a lone request would otherwise run its last step twice (the launch its
    grammar ends is a forward for nothing). At or above it, the step launches ahead."""
    lone = [r for r in _mix("llguidance") if r.grammar is not None][:1]
    many = [r for r in _mix("llguidance") if r.grammar is not None][: 2 * AFTER_LAUNCH_MIN]
    for requests, ahead in ((lone, False), (many, True)):
        engine = _engine(True, speculative, least=AFTER_LAUNCH_MIN, max_num_batched_tokens=256)
        for request in requests:
            engine.add_request(request)
        launched = 0
        for _ in range(2000):
            if not engine.has_unfinished():
                break
            engine.step()
            launched += engine._inflight is not None
        assert not engine.has_unfinished()
        dropped = engine.stats()["dropped_rows"]
        engine.close()
        assert (launched > 0) is ahead, (len(requests), launched)
        if not ahead:
            assert dropped == 0


def test_the_default_is_off_on_the_cpu() -> None:
    """``grammar_after_launch=None`` resolves to ``AFTER_LAUNCH_MIN`` on CUDA only: a CPU
    forward runs to its end inside the launch, so nothing would run beside it."""
    engine = make_engine()
    assert engine.config.grammar_after_launch is None and engine.after_launch == 0
    engine.close()
