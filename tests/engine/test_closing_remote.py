"""Closing decisions made ahead in worker processes (``engine/closing_remote.py``), for the
draft tree and for the token after it (``BudgetCloser.prefetch``), are exactly the inline ones,
and a worker that stops leaves the decisions to the engine.

Real child processes on a pipe, real grammars (llguidance, xgrammar), the toy tokenizer. The
streams and trees come from ``test_closing_ahead`` (grammar-valid random tokens, budget 30:
inside the closing window; trees that follow the stream for a while, then leave it).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from engine_fixtures import CLOSING_SCHEMA, build_byte_level_hf, toy_tokenizer
from test_closing_ahead import _stream, _tree, closing_requests, count_answers

from espalier.constrained.compile import compile_grammar
from espalier.constrained.spec import GrammarSpec
from espalier.engine import closing_ahead, closing_remote
from espalier.engine.api import SamplingParams
from espalier.engine.closing import NO_MEMO, BudgetCloser
from espalier.engine.closing_remote import ClosingWorkers
from espalier.engine.request import Request


def _feed(
    ahead: BudgetCloser,
    inline: BudgetCloser,
    compiled: Any,
    stream: list[int],
    rng: random.Random,
    request_id: str,
    stops: set[int],
) -> int:
    """Feed ``stream`` step by step to both closers (lookaheads made and flushed on ``ahead``
    before each step); every answer and memo must agree. Returns the tokens compared."""
    requests = [Request(request_id, [1], SamplingParams(max_tokens=30), 0) for _ in range(2)]
    for request in requests:
        request.compiled = compiled
        request.matcher = compiled.matcher()
    compared = pos = 0
    while pos < len(stream):
        root = stream[pos - 1] if pos else 1
        assert ahead.lookahead(requests[0], *_tree(stream[pos:], root, rng), 10_000) is None
        ahead.flush()
        step = stream[pos : pos + rng.randint(1, 7)]
        ahead.prefetch(requests[0], step)  # as after verification: the step's last token
        ahead.flush()
        for token in step:
            answers = [
                closer.instead(request, token, stops, 10_000)
                for closer, request in ((ahead, requests[0]), (inline, requests[1]))
            ]
            assert answers[0] == answers[1]
            assert ahead._memo.get(request_id, NO_MEMO) == inline._memo.get(request_id, NO_MEMO)
            compared += 1
            pos += 1
            if answers[0] is not None or len(requests[0].output_ids) + 1 >= 30:
                ahead.forget(request_id)
                inline.forget(request_id)
                return compared
            for request in requests:
                request.output_ids.append(token)
                assert request.matcher is not None and request.matcher.accept(token)
    ahead.forget(request_id)
    inline.forget(request_id)
    return compared


@contextmanager
def closers_with_workers(
    backend: str, processes: int
) -> Iterator[tuple[Any, Any, set[int], BudgetCloser, BudgetCloser, ClosingWorkers]]:
    """``(tokenizer, compiled, stops, ahead, inline)`` for the schema on ``backend``, and
    ``ahead``'s workers (started, closed on exit)."""
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(CLOSING_SCHEMA), tokenizer, backend)
    ahead, inline = BudgetCloser(tokenizer), BudgetCloser(tokenizer)
    workers = ahead.workers = ClosingWorkers(tokenizer, processes)
    try:
        assert workers.wait_ready()
        yield tokenizer, compiled, set(tokenizer.stop_token_ids), ahead, inline, workers
    finally:
        workers.close()


def count_after_tree(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the decisions taken for a token after the tree (asked with ``prefetch``)."""
    counted = [0]
    original = closing_ahead.Lookahead._find

    def counting_find(self: Any, here: int, token: int) -> Any:
        found = original(self, here, token)
        counted[0] += found is not None and found[0] == -1
        return found

    monkeypatch.setattr(closing_ahead.Lookahead, "_find", counting_find)
    return counted


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_worker_decides_like_inline(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    answered = count_answers(monkeypatch)
    after_tree = count_after_tree(monkeypatch)
    with closers_with_workers(backend, 2) as (tokenizer, compiled, stops, ahead, inline, _):
        compared = 0
        for seed in range(8):
            rng = random.Random(seed)
            stream = _stream(tokenizer, compiled, rng, 40)
            # request ids repeat across seeds: a forgotten mirror must be built again
            compared += _feed(ahead, inline, compiled, stream, rng, f"r{seed % 3}", stops)
    assert answered[0] > compared // 3  # the workers did answer (the rest: off the tree)
    assert after_tree[0] >= 5  # and for tokens after the tree (bonus tokens)


def test_a_stopped_worker_leaves_the_decisions_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    answered = count_answers(monkeypatch)
    with closers_with_workers("llguidance", 1) as (tokenizer, compiled, stops, ahead, inline, w):
        rng = random.Random(3)
        _feed(ahead, inline, compiled, _stream(tokenizer, compiled, rng, 40), rng, "a", stops)
        assert answered[0] > 0
        worker = w._workers[0]
        worker.process.kill()
        worker.process.wait()
        answered[0] = 0
        compared = 0
        for seed in range(4):
            rng = random.Random(seed)
            stream = _stream(tokenizer, compiled, rng, 40)
            compared += _feed(ahead, inline, compiled, stream, rng, f"b{seed}", stops)
        assert compared > 20 and answered[0] == 0 and not worker.alive


@pytest.mark.parametrize(("defer", "chunk_s"), [(False, None), (True, None), (False, 0.0)])
def test_speculative_engine_with_closing_workers_emits_plain_tokens(
    toy_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, defer: bool, chunk_s: float | None
) -> None:
    """End to end: decisions made in a worker process, the plain engine's tokens; with
    deferred appends too (the lookaheads are then made as each request settles); with every
    request's decisions in a part of its own (``chunk_s`` 0)."""
    if chunk_s is not None:
        monkeypatch.setattr(closing_remote, "CHUNK_S", chunk_s)
    from spec_helpers import random_runner, tiny_config
    from test_spec_engine import run

    from espalier.engine.engine import Engine, EngineConfig
    from espalier.engine.spec.ngram import NgramConfig, NgramDrafter
    from espalier.engine.spec.strategy import SpecConfig, install

    answered = count_answers(monkeypatch)
    after_tree = count_after_tree(monkeypatch)
    runner = random_runner(tiny_config(toy_tokenizer.vocab_size), seed=1)
    plain = run(Engine(EngineConfig(), runner, toy_tokenizer), closing_requests())
    engine = Engine(EngineConfig(), runner, toy_tokenizer)
    config = SpecConfig(num_draft_tokens=6, close_workers=1, defer_appends=defer)
    strategy = install(engine, config, {"ngram": NgramDrafter(NgramConfig(1, 3))}).strategy
    assert engine.closer.workers is not None and engine.closer.workers.wait_ready()
    try:
        spec = run(engine, closing_requests())
    finally:
        strategy.close()
    assert engine.closer.workers is None
    assert {rid: out[0] for rid, out in spec.items()} == {rid: out[0] for rid, out in plain.items()}
    assert answered[0] > 0 and after_tree[0] > 0


def test_answers_late_or_missing_leave_the_decisions_inline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every third look at the pipe finds nothing (as if the worker were still compiling):
    # those decisions are made inline, the late answers are received (in order) later, and
    # every decision is still the inline one.
    from espalier.engine import closing_remote

    looks = [0, 0]  # all looks, looks made to find nothing
    real = closing_remote._Worker._ready_to_receive

    def sometimes_late(self: Any, timeout_s: float) -> bool:
        looks[0] += 1
        if looks[0] % 3 == 0:
            looks[1] += 1
            return False
        return real(self, timeout_s)

    monkeypatch.setattr(closing_remote._Worker, "_ready_to_receive", sometimes_late)
    openings: list[str] = []  # a late answer must not make the engine build a mirror again
    real_flush = closing_remote._Worker.flush

    def counting_flush(self: Any) -> None:
        openings.extend(entry[0] for entry in self.outbox if entry[1] is not None)
        real_flush(self)

    monkeypatch.setattr(closing_remote._Worker, "flush", counting_flush)
    with closers_with_workers("xgrammar", 1) as (tokenizer, compiled, stops, ahead, inline, w):
        compared = 0
        for seed in range(6):
            rng = random.Random(seed)
            stream = _stream(tokenizer, compiled, rng, 40)
            compared += _feed(ahead, inline, compiled, stream, rng, f"r{seed}", stops)
        assert compared > 30 and w._workers[0].alive and looks[1] > 10
    assert sorted(openings) == [f"r{seed}" for seed in range(6)]  # one opening per request


def test_the_mirror_is_built_before_the_closing_window() -> None:
    # A request far from its budget's end gets no lookahead, but its mirror is opened in the
    # worker (its grammar compiles there meanwhile); its first tree then comes without one.
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(CLOSING_SCHEMA), tokenizer, "llguidance")
    closer = BudgetCloser(tokenizer)
    workers = closer.workers = ClosingWorkers(tokenizer, 1)
    assert workers.wait_ready()
    try:
        request = Request("far", [1], SamplingParams(max_tokens=500), 0)
        request.compiled, request.matcher = compiled, compiled.matcher()
        chain = ([1, 2, 3], [-1, 0, 1])
        assert closer.lookahead(request, *chain, 10_000) is None and "far" not in closer._ahead
        worker = workers._workers[0]
        assert [entry[1] for entry in worker.outbox] == [(compiled.backend, compiled.spec)]
        closer.flush()
        request.sampling = SamplingParams(max_tokens=20)  # now inside the window
        closer.lookahead(request, *chain, 10_000)
        assert "far" in closer._ahead and closer._ahead["far"].remote
        assert [entry[1] for entry in worker.outbox] == [None]  # built already
    finally:
        workers.close()


def test_outlines_requests_keep_the_mask_thread_lookahead() -> None:
    # outlines-core compiles take seconds: its requests are not decided in the workers.
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(
        GrammarSpec.json_schema(CLOSING_SCHEMA), tokenizer, "outlines_core"
    )
    closer = BudgetCloser(tokenizer)
    workers = closer.workers = ClosingWorkers(tokenizer, 1)
    try:
        request = Request("o", [1], SamplingParams(max_tokens=20), 0)
        request.compiled, request.matcher = compiled, compiled.matcher()
        job = closer.lookahead(request, [1, 2, 3], [-1, 0, 1], 10_000)
        assert job is not None and not closer._ahead["o"].remote
        assert not workers._workers[0].outbox
    finally:
        workers.close()


def test_workers_that_cannot_start_leave_the_lookahead_to_the_threads() -> None:
    # A tokenizer that does not pickle cannot go to a worker: the engine still installs, and
    # decides ahead on the mask threads.
    from spec_helpers import random_runner, tiny_config

    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.engine.engine import Engine, EngineConfig
    from espalier.engine.spec.ngram import NgramConfig, NgramDrafter
    from espalier.engine.spec.strategy import SpecConfig, install

    hf = build_byte_level_hf()  # a fresh one: toy_tokenizer() is shared
    hf.unpicklable = lambda: None  # a lambda does not pickle
    tokenizer = TokenizerInfo(hf, stop_token_ids=[hf.convert_tokens_to_ids("<eos>")], name="x")
    runner = random_runner(tiny_config(tokenizer.vocab_size), seed=1)
    engine = Engine(EngineConfig(), runner, tokenizer)
    config = SpecConfig(num_draft_tokens=6, close_workers=1)
    strategy = install(engine, config, {"ngram": NgramDrafter(NgramConfig(1, 3))}).strategy
    try:
        assert engine.closer.workers is None and strategy.closer is engine.closer
    finally:
        strategy.close()


def test_memos_cross_the_pipe_unchanged() -> None:
    import pickle

    from espalier.engine.closing import Memo

    for memo in (NO_MEMO, Memo((7, [1, 2]), 9, False), Memo(None, 3, True)):
        again = pickle.loads(pickle.dumps(memo))
        assert again == memo and type(again) is Memo and again is not memo


def test_a_step_answer_comes_in_parts_taken_as_they_arrive() -> None:
    # chunk_s 0: one part per request. Taking the first request's decisions receives only its
    # part; every request's decisions are those of decide_tree on the engine's own matcher.
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(CLOSING_SCHEMA), tokenizer, "llguidance")
    closer = BudgetCloser(tokenizer)
    stops = set(tokenizer.stop_token_ids)
    workers = ClosingWorkers(tokenizer, 1, chunk_s=0.0)
    try:
        assert workers.wait_ready()
        rng = random.Random(5)
        fetches, expected = [], []
        for i in range(5):
            stream = _stream(tokenizer, compiled, rng, 40)
            request = Request(f"p{i}", [1], SamplingParams(max_tokens=30), 0)
            request.compiled, request.matcher = compiled, compiled.matcher()
            cut = rng.randint(1, 12)
            assert request.matcher.accept_tokens(stream[:cut]) == cut
            request.output_ids.extend(stream[:cut])
            tokens, parents = _tree(stream[cut:], stream[cut - 1], rng)
            limits = (cut + rng.randint(10, 16), 10_000)  # about a closing path's length
            fetches.append(workers.submit(request, NO_MEMO, tokens, parents, cut, limits, stops))
            fork = request.matcher.fork()
            expected.append(
                closing_ahead.decide_tree(
                    closer, NO_MEMO, fork, tokens, parents, cut, limits, stops
                )
            )
        workers.flush()
        batch = workers._workers[0]._sent[0]
        assert batch.parts and not batch.received
        assert fetches[0]() == expected[0]
        assert len(batch.value) == 1 and not batch.received  # the later parts not yet taken
        assert [fetch() for fetch in fetches] == expected
        assert batch.received and len(batch.value) == 5
        decided = [d for e in expected for d in e if d is not None]
        assert any(d[0] is not None for d in decided)  # some nodes close
        assert any(d[1].known is not None for d in decided)  # others found a closing path
        deciding, answering = workers.busy()  # the worker's own time, inside the round trip
        assert 0.0 < deciding <= answering
    finally:
        workers.close()


def test_a_request_goes_to_the_worker_with_the_fewest() -> None:
    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(CLOSING_SCHEMA), tokenizer, "llguidance")
    workers = ClosingWorkers(tokenizer, 2)
    try:
        assert workers.wait_ready()
        first, second = workers._workers
        for i in range(6):
            request = Request(f"q{i}", [1], SamplingParams(max_tokens=30), 0)
            request.compiled, request.matcher = compiled, compiled.matcher()
            workers.open(request)
        assert (first.requests, second.requests) == (3, 3)
        placed = {rid: workers._worker_of(rid) for rid in (f"q{i}" for i in range(6))}
        gone = [rid for rid, worker in placed.items() if worker is first][:2]
        for rid in gone:
            workers.forget(rid)
        assert (first.requests, second.requests) == (1, 3) and first.forgets == gone
        assert workers._worker_of("new0") is first and workers._worker_of("new1") is first
        assert workers._worker_of("new2") in (first, second)
        assert workers._worker_of("q5") is placed["q5"]  # a request stays where its mirror is
    finally:
        workers.close()


def test_with_workers_the_bonus_tokens_check_gets_a_lookahead() -> None:
    # The token after the deepest node (the bonus token) is checked one output length later.
    # When only that check is due (the memo's next check, or the window's first check), the
    # tree still goes to the worker, which then answers the bonus query: no decision inline.
    # Without workers there is no job for it (the bonus is decided inline anyway).
    from espalier.engine.closing import CLOSING_WINDOW, Memo

    tokenizer = toy_tokenizer()
    compiled, _ = compile_grammar(GrammarSpec.json_schema(CLOSING_SCHEMA), tokenizer, "llguidance")
    stream = _stream(tokenizer, compiled, random.Random(2), 12)
    with_workers = BudgetCloser(tokenizer)
    workers = with_workers.workers = ClosingWorkers(tokenizer, 1)
    try:
        assert workers.wait_ready()
        for closer in (with_workers, BudgetCloser(tokenizer)):
            for case in ("next_check", "window"):
                max_tokens = 30 if case == "next_check" else 4 + 3 + CLOSING_WINDOW
                request = Request(f"b_{case}", [1], SamplingParams(max_tokens=max_tokens), 0)
                request.compiled, request.matcher = compiled, compiled.matcher()
                assert request.matcher.accept_tokens(stream[:4]) == 4
                request.output_ids.extend(stream[:4])  # here = 4
                chain = (stream[3:7], [-1, 0, 1, 2])  # depth 3: checks at 4, 5, 6; bonus at 7
                if case == "next_check":
                    closer._memo[request.request_id] = Memo(None, next_check=7)
                made = closer.lookahead(request, *chain, 10_000)
                if closer is with_workers:
                    assert made is None and closer._ahead[request.request_id].remote
                    closer.flush()
                    bonus = stream[7]
                    closer.prefetch(request, [*stream[4:7], bonus])
                    closer.flush()
                    assert closer.pass_through(request, stream[4:7], 10_000) == 3
                    request.output_ids.extend(stream[4:7])
                    assert request.matcher.accept_tokens(stream[4:7]) == 3
                    inline = BudgetCloser(tokenizer)
                    inline._memo[request.request_id] = closer._memo.get(request.request_id, NO_MEMO)
                    ahead = closer._ahead[request.request_id]
                    taken = ahead.take(7, bonus)
                    assert taken is not None  # the worker's answer, not inline
                    expected = inline.decide(
                        inline._memo[request.request_id],
                        request.matcher,
                        bonus,
                        7,
                        max_tokens - 7,
                        False,
                    )
                    assert taken == expected
                else:
                    assert made is None and request.request_id not in closer._ahead
                closer.forget(request.request_id)
    finally:
        workers.close()
