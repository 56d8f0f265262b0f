"""Appends deferred into the next step (``engine/deferred.py``): the same chunks' tokens, finish
reasons, texts and usage as appending at once, on the speculative engine (CPU, tiny model)."""

from __future__ import annotations

from typing import Any

import pytest
from engine_fixtures import CLOSING_SCHEMA, toy_tokenizer  # noqa: F401 (fixture)
from spec_helpers import SCHEMA, one_thread, random_runner, tiny_config  # noqa: F401 (autouse fixture)

from espalier.constrained.native import build
from espalier.constrained.spec import GrammarSpec
from espalier.engine import closing_ahead, deferred
from espalier.engine.api import (
    FinishReason,
    GenerationRequest,
    RequestOutput,
    SamplingParams,
    SpeculativeOptions,
)
from espalier.engine.engine import Engine, EngineConfig
from espalier.engine.spec.ngram import NgramConfig, NgramDrafter
from espalier.engine.spec.strategy import SpecConfig, install


class Counts:
    """How often appends were deferred, and settled appends that finished their request."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.deferred = 0
        self.finished_by_settle = 0
        add = deferred.DeferredAppends.add
        settle = Engine._settle

        def counting_add(this: Any, *args: Any) -> None:
            self.deferred += 1
            add(this, *args)

        def counting_settle(engine: Engine, items: Any = None) -> None:
            before = len(engine._pending)
            settle(engine, items)
            self.finished_by_settle += sum(o.finished for o in engine._pending[before:])

        monkeypatch.setattr(deferred.DeferredAppends, "add", counting_add)
        monkeypatch.setattr(Engine, "_settle", counting_settle)


def count_remote_answers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the closing decisions taken from a worker process's answer (``[count]``)."""
    answers = [0]
    original_take = closing_ahead.Lookahead.take

    def counting_take(self: Any, here: int, token: int, **kwargs: Any) -> Any:
        outcome = original_take(self, here, token, **kwargs)
        answers[0] += self.remote and outcome is not None
        return outcome

    monkeypatch.setattr(closing_ahead.Lookahead, "take", counting_take)
    return answers


def requests() -> list[GenerationRequest]:
    """Closing near the budget (a looping array of strings), plain JSON, forced chains, n-gram
    drafts, sampling, an unconstrained request, a stop string and a plain (non-speculating)
    request in one batch."""
    closing = GrammarSpec.json_schema(CLOSING_SCHEMA)
    schema = GrammarSpec.json_schema(SCHEMA)
    prompts = [(5, 6, 7, 8, 5, 6, 7, 8, 5, 6), (40, 41, 42, 43, 40, 41, 42), (9,) * 20]
    cases: list[tuple[Any, Any, SpeculativeOptions, SamplingParams]] = [
        (
            prompts[0],
            closing,
            SpeculativeOptions(methods=("ngram", "forced")),
            SamplingParams(max_tokens=30),
        ),
        (
            prompts[1],
            closing,
            SpeculativeOptions(methods=("ngram",)),
            SamplingParams(max_tokens=37),
        ),
        (
            prompts[2],
            closing,
            SpeculativeOptions(methods=("forced",)),
            SamplingParams(max_tokens=44),
        ),
        (prompts[2], schema, SpeculativeOptions(), SamplingParams(max_tokens=40)),
        (prompts[0], None, SpeculativeOptions(methods=("ngram",)), SamplingParams(max_tokens=33)),
        (prompts[1], schema, SpeculativeOptions(enabled=False), SamplingParams(max_tokens=28)),
        (
            prompts[2],
            closing,
            SpeculativeOptions(methods=("ngram",)),
            SamplingParams(max_tokens=40, temperature=0.8, seed=7),
        ),
        (prompts[0], schema, SpeculativeOptions(), SamplingParams(max_tokens=40, stop=('"',))),
    ]
    return [
        GenerationRequest(f"r{i}", prompt_token_ids=p, sampling=s, grammar=g, speculative=o)
        for i, (p, g, o, s) in enumerate(cases)
    ]


def run(engine: Engine, batch: list[GenerationRequest]) -> dict[str, list[RequestOutput]]:
    for request in batch:
        engine.add_request(request)
    chunks: dict[str, list[RequestOutput]] = {r.request_id: [] for r in batch}
    while engine.has_unfinished():
        for out in engine.step():
            chunks[out.request_id].append(out)
    engine.close()
    return chunks


def speculative(tokenizer: Any, defer: bool, workers: int = 0) -> Engine:
    """``workers``: closing worker processes (``engine/closing_remote.py``), started here."""
    runner = random_runner(tiny_config(tokenizer.vocab_size), seed=1)
    engine = Engine(EngineConfig(), runner, tokenizer)
    config = SpecConfig(
        num_draft_tokens=6, mask_budget_s=None, defer_appends=defer, close_workers=workers
    )
    install(engine, config, {"ngram": NgramDrafter(NgramConfig(1, 3))})
    if workers:
        assert engine.closer.workers is not None and engine.closer.workers.wait_ready()
    return engine


def summary(chunks: list[RequestOutput]) -> tuple[Any, ...]:
    final = chunks[-1]
    assert final.finished and not any(c.finished for c in chunks[:-1])
    tokens = [t for c in chunks for t in c.token_ids]
    text = "".join(c.text_delta for c in chunks)
    assert final.usage is not None and final.usage.completion_tokens == len(tokens)
    return tokens, text, final.finish_reason, final.error, final.usage, final.validation


@pytest.mark.parametrize("workers", [0, 1])
def test_deferred_appends_give_the_same_outputs(
    toy_tokenizer: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    workers: int,
) -> None:
    """``workers``: the deferred engine's closing decisions come from a worker process (its
    lookaheads are then submitted as each request settles)."""
    at_once = run(speculative(toy_tokenizer, defer=False), requests())
    counts = Counts(monkeypatch)
    answered = count_remote_answers(monkeypatch)
    engine = speculative(toy_tokenizer, defer=True, workers=workers)
    later = run(engine, requests())
    assert (answered[0] > 0) == (workers > 0)
    for rid, chunks in at_once.items():
        assert summary(later[rid]) == summary(chunks), rid
    reasons = {summary(c)[2] for c in at_once.values()}
    assert FinishReason.STOP in reasons and FinishReason.LENGTH in reasons, reasons
    assert counts.deferred > 20  # most steps' appends were deferred
    assert counts.finished_by_settle > 0  # and some requests ended while settling
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert engine.closer._ahead == {} and engine.closer._memo == {}
    if build.find_compiler() is not None:  # llguidance's native walk: fills before settling
        assert engine.strategy.decoder.masks.ahead_fills > 20  # type: ignore[attr-defined]


def test_abort_streams_the_deferred_tokens_first(toy_tokenizer: Any) -> None:  # noqa: F811
    engine = speculative(toy_tokenizer, defer=True)
    engine.add_request(
        GenerationRequest(
            "a",
            prompt_token_ids=(9,) * 20,
            sampling=SamplingParams(max_tokens=60),
            grammar=GrammarSpec.json_schema(CLOSING_SCHEMA),
        )
    )
    chunks: list[RequestOutput] = []
    while not engine._deferred:  # until a step's append is deferred
        chunks.extend(engine.step())
    held = len(engine._requests["a"].output_ids)
    assert engine.abort("a")
    chunks.extend(engine.step())
    assert not engine.has_unfinished()
    assert chunks[-1].finish_reason is FinishReason.ABORT
    streamed = [t for c in chunks for t in c.token_ids]
    assert len(streamed) == held and chunks[-1].usage.completion_tokens == held
    engine.close()


def test_take_selects_and_keeps_order() -> None:
    from espalier.engine.request import Request
    from espalier.engine.step import SeqOutcome

    appends = deferred.DeferredAppends()
    made = [Request(f"r{i}", [1], SamplingParams(), i) for i in range(4)]
    for i, request in enumerate(made):
        appends.add(request, SeqOutcome([i]), i)
    odd = appends.take(lambda r: r.arrival_seq % 2 == 1)
    assert [d.request.request_id for d in odd] == ["r1", "r3"]
    assert len(appends) == 2 and bool(appends)
    assert [d.start for d in appends.take()] == [0, 2]
    assert not appends and appends.take() == []


def test_requests_whose_fills_ran_ahead_settle_after_the_masks(
    toy_tokenizer: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # ``decoder.SETTLE_AFTER_MASKS``: a request whose fill started before its settle (the
    # native walk) is settled once the step's masks are ready, before verification; with it
    # off, no deferred append is settled between the masks and verification.
    from espalier.engine.spec import decoder, masks

    if build.find_compiler() is None:
        pytest.skip("no C compiler: the native llguidance walk is not built here")
    events: list[str] = []
    result = masks.PendingMasks.result
    verify = decoder.SpeculativeDecoder._verify
    settle = Engine._settle

    def logged_result(self: Any) -> Any:
        if self.ready is None:
            events.append("m")
        return result(self)

    def logged_verify(self: Any, *args: Any) -> Any:
        events.append("v")
        return verify(self, *args)

    def logged_settle(engine: Engine, items: Any = None) -> None:
        taken = len(engine._deferred)
        settle(engine, items)
        if len(engine._deferred) < taken:
            events.append("s")

    monkeypatch.setattr(masks.PendingMasks, "result", logged_result)
    monkeypatch.setattr(decoder.SpeculativeDecoder, "_verify", logged_verify)
    monkeypatch.setattr(Engine, "_settle", logged_settle)
    for after_masks in (True, False):
        monkeypatch.setattr(decoder, "SETTLE_AFTER_MASKS", after_masks)
        events.clear()
        run(speculative(toy_tokenizer, defer=True), requests())
        trace = "".join(events)
        between = [part.split("v")[0] for part in trace.split("m")[1:]]  # masks .. verify
        settled_between = sum("s" in part for part in between)
        assert trace.count("m") > 5 and trace.count("s") > 5, trace
        if after_masks:
            assert settled_between > 5, trace
        else:
            assert settled_between == 0, trace
