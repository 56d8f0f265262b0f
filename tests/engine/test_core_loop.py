"""EngineLoop over a real multiprocessing Pipe (the loop on a thread here; the server runs it in a
child process): the same tokens as stepping the engine directly, one message per step, refusals
and grammar errors typed, abort, both kinds of shutdown, the loop ending when the other end
closes, CompileGrammar's compiles answered from the cache the requests use, and a failure
signalled from another thread (a dead tensor-parallel rank) failing the requests in flight and
ending the loop with its reason."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest

from espalier.constrained.errors import GrammarError
from espalier.constrained.spec import GrammarKind, GrammarSpec
from espalier.engine.api import (
    ConstraintOptions,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
)
from espalier.engine.core.loop import EngineLoop, FailureSignal
from espalier.engine.core.messages import (
    Abort,
    AddRequest,
    Compile,
    Compiled,
    EngineStopped,
    Shutdown,
    StepOutputs,
    Withdraw,
)
from espalier.engine.engine import EngineCore
from tests.fixtures.engine_fixtures import make_engine, run_all, tokens_of


def request(i: int, max_tokens: int = 10, **kw: object) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i)
    return GenerationRequest(f"q{i}", prompt=f"hello {i} world", sampling=sampling, **kw)  # type: ignore[arg-type]


@pytest.fixture
def channel() -> Iterator[tuple[Connection, threading.Thread]]:
    ours, theirs = multiprocessing.Pipe(duplex=True)
    loop = EngineLoop(make_engine(engine_type=EngineCore), theirs)  # as the engine process
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    yield ours, thread
    ours.close()
    thread.join(timeout=60)
    assert not thread.is_alive()


def receive_until(
    ours: Connection, done: set[str]
) -> tuple[dict[str, list[RequestOutput]], list[StepOutputs]]:
    """Messages until every request in ``done`` finished; chunks (exceptions rebuilt) by id."""
    chunks: dict[str, list[RequestOutput]] = {}
    messages: list[StepOutputs] = []
    while done - {rid for rid, cs in chunks.items() if cs[-1].finished}:
        assert ours.poll(120), "the loop went quiet"
        message = ours.recv()
        assert isinstance(message, StepOutputs), message
        messages.append(message)
        for out in message.outputs():
            chunks.setdefault(out.request_id, []).append(out)
    return chunks, messages


def test_same_tokens_as_the_engine_one_message_per_step(
    channel: tuple[Connection, threading.Thread],
) -> None:
    ours, _ = channel
    want = run_all(make_engine(), [request(i) for i in range(4)])
    for i in range(4):
        ours.send(AddRequest(request(i)))
    got, messages = receive_until(ours, {f"q{i}" for i in range(4)})
    for i in range(4):
        assert tokens_of(got[f"q{i}"]) == tokens_of(want[f"q{i}"])
        assert sum(c.finished for c in got[f"q{i}"]) == 1
    # a decode step's chunks for the whole batch travel together
    assert max(len({o.request_id for o in m.outputs()}) for m in messages) >= 2
    assert messages[-1].adds_applied == 4 and messages[-1].stats["running"] == 0


def test_refusals_and_grammar_errors_arrive_typed(
    channel: tuple[Connection, threading.Thread],
) -> None:
    ours, _ = channel
    bad_ids = GenerationRequest("bad", prompt_token_ids=(10**9,))
    bad_grammar = request(1, grammar=GrammarSpec(GrammarKind.REGEX, "(unclosed"))
    ours.send(AddRequest(bad_ids))
    ours.send(AddRequest(bad_grammar))
    ours.send(AddRequest(request(2, max_tokens=3)))
    got, _ = receive_until(ours, {"bad", "q1", "q2"})
    (refused,) = got["bad"]
    assert refused.finish_reason is FinishReason.ERROR
    assert isinstance(refused.exception, InvalidRequestError)
    assert refused.exception.violations[0][0] == "prompt_token_ids"
    assert isinstance(got["q1"][-1].exception, GrammarError)
    assert got["q2"][-1].finish_reason is FinishReason.LENGTH


def test_abort_then_shutdown_without_drain(channel: tuple[Connection, threading.Thread]) -> None:
    ours, thread = channel
    ours.send(AddRequest(request(1, max_tokens=500)))
    ours.send(AddRequest(request(2, max_tokens=500)))
    ours.send(Abort("q1"))
    got, _ = receive_until(ours, {"q1"})
    assert got["q1"][-1].finish_reason is FinishReason.ABORT
    ours.send(Shutdown(drain=False))
    got, _ = receive_until(ours, {"q2"})
    assert got["q2"][-1].finish_reason is FinishReason.ABORT
    assert ours.poll(60) and ours.recv() == EngineStopped(None)
    thread.join(timeout=60)
    assert not thread.is_alive()


def test_shutdown_drains_and_refuses_new_work(
    channel: tuple[Connection, threading.Thread],
) -> None:
    ours, _ = channel
    ours.send(AddRequest(request(1, max_tokens=8)))
    ours.send(Shutdown(drain=True))
    ours.send(AddRequest(request(2)))
    got, _ = receive_until(ours, {"q1", "q2"})
    assert got["q1"][-1].finish_reason is FinishReason.LENGTH
    assert tokens_of(got["q1"]) == tokens_of(run_all(make_engine(), [request(1, 8)])["q1"])
    assert got["q2"][-1].finish_reason is FinishReason.ERROR
    assert ours.poll(60) and ours.recv() == EngineStopped(None)


def test_the_loop_ends_when_the_server_end_closes(
    channel: tuple[Connection, threading.Thread],
) -> None:
    ours, thread = channel
    ours.send(AddRequest(request(1, max_tokens=500)))
    assert ours.poll(60)
    ours.close()
    thread.join(timeout=60)
    assert not thread.is_alive()


def test_a_signalled_failure_fails_requests_in_flight_and_ends_the_loop() -> None:
    ours, theirs = multiprocessing.Pipe(duplex=True)
    failure = FailureSignal()
    engine = make_engine(engine_type=EngineCore)
    thread = threading.Thread(target=EngineLoop(engine, theirs, failure=failure).run)
    thread.start()
    try:
        ours.send(AddRequest(request(1, max_tokens=5000)))
        running = False
        while not running:  # until its first chunk comes back
            assert ours.poll(120), "the loop went quiet"
            message = ours.recv()
            assert isinstance(message, StepOutputs)
            running = any(o.request_id == "q1" for o in message.outputs())
        failure("tensor-parallel rank 1 exited (code -9)")
        failure("a second reason is ignored")
        last: list[RequestOutput] = []
        while True:
            assert ours.poll(120), "the loop went quiet"
            message = ours.recv()
            if isinstance(message, EngineStopped):
                break
            last.extend(o for o in message.outputs() if o.finished)
        assert message == EngineStopped("tensor-parallel rank 1 exited (code -9)")
        (failed,) = last
        assert failed.request_id == "q1" and failed.finish_reason is FinishReason.ERROR
        assert failed.error is not None and "rank 1" in failed.error
    finally:
        thread.join(timeout=60)
        ours.close()
    assert not thread.is_alive()


def next_compiled(ours: Connection) -> Compiled:
    while True:
        assert ours.poll(120), "the loop went quiet"
        message = ours.recv()
        if isinstance(message, Compiled):
            return message


def test_compile_answers_from_the_cache_the_requests_use(
    channel: tuple[Connection, threading.Thread],
) -> None:
    ours, _ = channel
    spec, options = GrammarSpec.regex("[a-c]{2}x"), ConstraintOptions(backend="llguidance")
    ours.send(Compile(7, spec, options))
    first = next_compiled(ours)
    assert first.call_id == 7 and first.error is None and first.report is not None
    assert first.report.backend == "llguidance" and not first.report.cache_hit
    ours.send(AddRequest(request(1, max_tokens=4, grammar=spec, constraint=options)))
    receive_until(ours, {"q1"})
    ours.send(Compile(8, spec, options))
    again = next_compiled(ours)
    assert again.call_id == 8 and again.report is not None and again.report.cache_hit
    ours.send(Compile(9, GrammarSpec(GrammarKind.REGEX, "(unclosed"), options))
    bad = next_compiled(ours)
    assert bad.call_id == 9 and bad.report is None and bad.error is not None
    assert isinstance(bad.error.rebuild(), GrammarError)


def test_a_withdrawn_compile_is_cancelled_and_never_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CompileGrammar's caller left: its wait in the compile cache is cancelled (a compile
    nobody else waits for then stops: ``test_compile_pool.py``), and no Compiled comes."""
    from concurrent.futures import Future

    engine = make_engine(engine_type=EngineCore)
    waits: list[Future[object]] = []

    def pending(*_: object, **__: object) -> Future[object]:
        waits.append(Future())
        return waits[-1]

    monkeypatch.setattr(engine.grammar, "submit", pending)
    ours, theirs = multiprocessing.Pipe(duplex=True)
    thread = threading.Thread(target=EngineLoop(engine, theirs).run, daemon=True)
    thread.start()
    try:
        spec, options = GrammarSpec.regex("[a-c]{2}x"), ConstraintOptions(backend="llguidance")
        ours.send(Compile(5, spec, options))
        ours.send(Withdraw(5))
        ours.send(Withdraw(99))  # none such: nothing happens
        for _ in range(1200):
            if waits and waits[0].cancelled():
                break
            time.sleep(0.05)
        assert len(waits) == 1 and waits[0].cancelled()
        ours.send(AddRequest(request(1, max_tokens=2)))
        receive_until(ours, {"q1"})  # asserts every message is StepOutputs: no Compiled(5)
    finally:
        ours.close()
        thread.join(timeout=60)
