"""``espalier serve``: the engine steps in a child process of its own, the server keeps
gRPC, validation and tokenization. Real server on loopback, tiny random model, Gemma tokenizer:
plain, constrained and streaming generation, the served text (made here from the engine process's
token ids) equal to an in-process engine's, cancellation across the channel, metrics from the
engine's messages, the SIGTERM drain, and the engine process killed mid-stream (the client gets
UNAVAILABLE and a new engine process serves; a second death within ten minutes is past
``--engine-restarts 1``: the server reports NOT_SERVING and exits non-zero instead of hanging)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from espalier_client import Client, UnavailableError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.fixtures.server_helpers import SCHEMA, check_output, scrape, wait_until_idle
from tests.fixtures.server_process import ServerProcess

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess(
        "--compile-timeout", "900", "--engine-restarts", "1", "--engine-stall-timeout", "15"
    )
    try:
        if not srv.wait_loaded():
            pytest.fail(f"the engine did not load: {srv.wait_event('load_failed')}")
        yield srv
    finally:
        srv.discard()  # the last test kills the engine: the exit status is its to check


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.address, timeout_s=600.0) as c:
        yield c


@pytest.fixture(scope="module")
def offline() -> Iterator[Any]:
    """The server's model in this process: ``Engine``, its text made here too."""
    from espalier.engine.constraints import GrammarService
    from espalier.server.loading import ModelOptions, load_engine, load_tokenizer

    options = ModelOptions(model="tiny-random")
    tokenizer = load_tokenizer(options)
    engine, _ = load_engine(options, tokenizer, GrammarService(tokenizer))
    yield engine
    engine.close()


def _offline(engine: Any, prompt: str, grammar: Any = None, **sampling: Any) -> dict[str, Any]:
    from espalier.engine.api import GenerationRequest, SamplingParams

    engine.add_request(
        GenerationRequest(
            "offline", prompt=prompt, sampling=SamplingParams(**sampling), grammar=grammar
        )
    )
    text, ids, last = "", [], None
    while engine.has_unfinished():
        for out in engine.step():
            text, ids, last = text + out.text_delta, ids + list(out.token_ids), out
    assert last is not None and last.finished
    valid = None if last.validation is None else last.validation.valid
    return {"text": text, "ids": tuple(ids), "reason": last.finish_reason.value, "valid": valid}


def _served(client: Client, prompt: str, **kwargs: Any) -> dict[str, Any]:
    chunks = list(client.stream(prompt, **kwargs))
    whole = client.generate(prompt, **kwargs)
    assert "".join(c.text for c in chunks) == whole.text  # streamed deltas add up
    reason = whole.finish_reason
    return {"text": whole.text, "ids": whole.token_ids, "reason": reason, "valid": whole.valid}


def test_served_text_equals_the_offline_engines(client: Client, offline: Any) -> None:
    """Stop strings, characters split across tokens, post-validation (a failing one too):
    what the server process makes from token ids is what an in-process engine makes."""
    from espalier.constrained.spec import GrammarSpec

    prompt = "Once upon a time"
    plain = _offline(offline, prompt, max_tokens=40, ignore_eos=True)
    assert _served(client, prompt, max_tokens=40, ignore_eos=True) == plain
    text = plain["text"]
    start = next(i for i in range(len(text) // 2, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    cut = _offline(offline, prompt, max_tokens=40, ignore_eos=True, stop=(stop,))
    assert cut["reason"] == "stop" and cut["text"] == text[: text.find(stop)]
    assert _served(client, prompt, max_tokens=40, ignore_eos=True, stop=[stop]) == cut
    wide = "(é|世|界|🦙){2,12}"  # multi-byte characters, often in byte-fallback pieces
    regex = _offline(offline, prompt, GrammarSpec.regex(wide), max_tokens=16)
    assert regex["valid"] is not None
    assert _served(client, prompt, regex=wide, max_tokens=16) == regex
    # two tokens cannot finish the object: LENGTH_UNCLOSED, and post-validation says invalid
    unclosed = _offline(offline, "JSON:", GrammarSpec.json_schema(SCHEMA), max_tokens=2)
    assert unclosed["reason"] == "length_unclosed" and unclosed["valid"] is False
    assert _served(client, "JSON:", schema=SCHEMA, max_tokens=2) == unclosed


def _engine_pid(server: ServerProcess) -> int:
    pid = server.wait_event("engine_process")["pid"]
    assert isinstance(pid, int) and pid != server.proc.pid
    return pid


def test_the_engine_runs_in_a_child_process(server: ServerProcess) -> None:
    pid = _engine_pid(server)
    with open(f"/proc/{pid}/stat") as stat:
        parent = int(stat.read().rsplit(")", 1)[1].split()[1])
    assert parent == server.proc.pid


def test_plain_generation_and_streaming_agree(client: Client) -> None:
    whole = client.generate("Once upon a time", max_tokens=12, ignore_eos=True)
    assert whole.finish_reason == "length" and len(whole.token_ids) == 12
    chunks = list(client.stream("Once upon a time", max_tokens=12, ignore_eos=True))
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert len(chunks) > 2  # one chunk per step: streamed, not batched at the end
    streamed = [t for c in chunks for t in c.token_ids]
    assert streamed == list(whole.token_ids)  # greedy: the same tokens either way
    assert "".join(c.text for c in chunks) == whole.text


def test_token_id_prompt_and_text_prompt_agree(client: Client) -> None:
    ids = client.tokenize("The answer is", add_special_tokens=True)
    by_text = client.generate("The answer is", max_tokens=6, ignore_eos=True)
    by_ids = client.generate(ids, max_tokens=6, ignore_eos=True)
    assert by_ids.token_ids == by_text.token_ids
    assert by_text.prompt_tokens == len(ids)


def test_constrained_generation_is_valid(client: Client) -> None:
    out = client.generate("A person as JSON:", schema=SCHEMA, max_tokens=64)
    check_output("json_schema", out.text, out.finish_reason)
    assert out.valid is True  # post-validated in the server process, from token ids
    json.loads(out.text)


def test_invalid_grammar_is_invalid_argument(client: Client) -> None:
    from espalier_client import InvalidArgumentError

    with pytest.raises(InvalidArgumentError):  # refused by the server process itself
        client.generate("x", regex="(unclosed", max_tokens=4)
    with pytest.raises(InvalidArgumentError):  # compiled, and refused, in the engine process
        client.generate("x", ebnf='root ::= "a" undefined_rule', max_tokens=4)
    # the engine process's typed errors cross the channel: the server keeps serving
    assert client.generate("x", max_tokens=2, ignore_eos=True).token_ids


def test_cancel_crosses_the_channel(server: ServerProcess, client: Client) -> None:
    assert server.metrics_port is not None
    stream = client.stream("Tell me", max_tokens=8000, ignore_eos=True)
    for i, chunk in enumerate(stream):
        assert not chunk.finished
        if i == 3:
            break
    running = scrape(server.metrics_port)
    assert running["espalier_engine_running"] >= 1  # gauges come from the engine's messages
    stream.close()
    after = wait_until_idle(server.metrics_port)  # aborted in the engine: its blocks are free
    assert after["espalier_aborted_requests_total"] >= 1
    assert after["espalier_engine_kv_blocks_free"] > 0


def test_sigterm_drains_through_the_engine_process() -> None:
    """A stream in flight at SIGTERM finishes whole; then the engine process and the server exit
    cleanly (its own server: the drain ends it)."""
    with ServerProcess() as srv:
        assert srv.wait_loaded()
        pid = _engine_pid(srv)
        with Client(srv.address, timeout_s=600.0) as client:
            tokens, last = 0, None
            for i, chunk in enumerate(client.stream("Tell me", max_tokens=40, ignore_eos=True)):
                if i == 1:
                    srv.proc.send_signal(signal.SIGTERM)
                tokens += len(chunk.token_ids)
                last = chunk
        assert last is not None and last.finish_reason == "length" and tokens == 40
        assert srv.proc.wait(timeout=120) == 0
    assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "Z"


def _health(server: ServerProcess) -> Any:
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=30).status


def _kill_engine_mid_stream(
    client: Client, pid: int, how: signal.Signals = signal.SIGKILL
) -> UnavailableError:
    stream = client.stream("Tell me", max_tokens=8000, ignore_eos=True)
    with pytest.raises(UnavailableError) as info:
        for i, _chunk in enumerate(stream):
            if i == 2:
                os.kill(pid, how)
    return info.value


def test_killed_engine_is_replaced_then_a_crash_loop_fails_the_server(
    server: ServerProcess, client: Client
) -> None:
    """Runs last in this module: it ends the server (``--engine-restarts 1``). The first engine
    hangs (stopped: no message past ``--engine-stall-timeout``): it is killed, the open stream
    ends UNAVAILABLE saying why, a new engine process serves the next requests (health
    SERVING again); the second death within ten minutes fails the server: NOT_SERVING, exit 1."""
    first = _engine_pid(server)
    error = _kill_engine_mid_stream(client, first, signal.SIGSTOP)
    assert error.reason == "ENGINE_UNAVAILABLE" and "--engine-stall-timeout 15" in error.message
    assert server.wait_event("engine_stalled")["pid"] == first
    assert server.wait_event("engine_failed")["restarting"] is True
    restarted = server.wait_event("engine_restarted")
    second = restarted["pid"]
    assert second not in (first, server.proc.pid) and restarted["restarts"] == 1
    assert not os.path.exists(f"/proc/{first}") or _is_zombie(first)  # reaped, not left running
    assert _health(server) == health_pb2.HealthCheckResponse.SERVING
    again = client.generate("A person as JSON:", schema=SCHEMA, max_tokens=48)
    check_output("json_schema", again.text, again.finish_reason)
    assert server.metrics_port is not None
    assert scrape(server.metrics_port)["espalier_engine_restarts_total"] == 1

    _kill_engine_mid_stream(client, second)
    server.wait_event("stopped", timeout=120)
    failed = [e for e in server.events if e["event"] == "engine_failed"]
    assert "not replaced: 1 replaced within ten minutes already" in failed[-1]["error"]
    assert "--engine-restarts 1" in failed[-1]["error"]
    assert server.proc.wait(timeout=120) == 1
    names = [e["event"] for e in server.events]
    assert names.count("engine_failed") == 2 and names.count("engine_restarted") == 1
    assert names.index("engine_restarted") < names.index("draining") < names.index("stopped")
