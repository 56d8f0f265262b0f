"""Abusive inputs against a real server on loopback: each gets its own honest status, and a victim
stream running at the same time completes with exactly the output it has alone.

The bait cases (refs and ``$schema`` pointing at a file or a URL) also prove that the server never
opened the bait file (the server runs under ``audit_hook.py``) and never connected to the bait
port (a real listening socket that counts connections).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from espalier.v1 import espalier_pb2 as pb
from espalier.v1 import espalier_pb2_grpc as pb_grpc
from tests.fixtures.abuse_cases import AbuseCase, Bait, cases, send_raw
from tests.fixtures.audit_hook import TRAP
from tests.fixtures.server_process import ServerProcess

pytestmark = pytest.mark.model

VICTIM = pb.GenerateRequest(
    request_id="victim",
    text="The victim says",
    sampling=pb.SamplingParams(max_tokens=48, ignore_eos=True),
    constraint=pb.Constraint(regex="[a-z]{40,48}", backend="llguidance"),
)


class Listener:
    """A loopback TCP port that accepts and counts connections (and never answers)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def bait(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Bait, Listener]]:
    folder = tmp_path_factory.mktemp(TRAP)
    secret = folder / "secret.json"
    secret.write_text(json.dumps({"type": "string", "description": "TOP-SECRET-CONTENT"}))
    listener = Listener()
    url = f"http://127.0.0.1:{listener.port}/schema.json"
    yield Bait(file_uri=Path(secret).as_uri(), http_url=url), listener
    listener.close()


@pytest.fixture(scope="module")
def channel(serving: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(serving.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def solo_victim(channel: grpc.Channel) -> list[int]:
    """The victim's tokens when it runs alone (greedy: any interference changes them)."""
    stub = pb_grpc.EspalierStub(channel)
    reply = stub.GenerateUnary(VICTIM, timeout=600)
    assert reply.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_GRAMMAR)
    assert len(reply.token_ids) > 4
    return list(reply.token_ids)


def run_victim(channel: grpc.Channel, started: threading.Event, out: dict[str, object]) -> None:
    stub = pb_grpc.EspalierStub(channel)
    tokens: list[int] = []
    try:
        for chunk in stub.Generate(VICTIM, timeout=600):
            tokens.extend(chunk.token_ids)
            started.set()
            if chunk.finished:
                out["finish_reason"] = chunk.finish_reason
    except grpc.RpcError as exc:
        out["error"] = f"{exc.code()}: {exc.details()}"
    finally:
        started.set()
        out["tokens"] = tokens


def names(bait: Bait) -> list[str]:
    return [c.name for c in cases(bait)]


ALL = names(Bait("file:///x", "http://127.0.0.1:9/x"))


@pytest.mark.parametrize("name", ALL)
def test_abusive_request_gets_its_status_and_spares_the_victim(
    name: str,
    channel: grpc.Channel,
    bait: tuple[Bait, Listener],
    solo_victim: list[int],
    serving: ServerProcess,
) -> None:
    case: AbuseCase = next(c for c in cases(bait[0]) if c.name == name)
    started, victim = threading.Event(), {}
    thread = threading.Thread(target=run_victim, args=(channel, started, victim))
    thread.start()
    assert started.wait(600)
    answer = send_raw(channel, case)
    thread.join(600)
    assert answer.code == case.code, (name, answer)
    if case.reason:
        assert answer.reason == case.reason, (name, answer)
    assert "TOP-SECRET" not in answer.message
    assert "error" not in victim, victim
    assert victim["tokens"] == solo_victim, name
    assert bait[1].accepted == 0, f"{name}: the server connected to the bait port"
    assert not serving.audit_events() or all(
        e["what"] == "connect" and str(bait[1].port) not in e["to"] for e in serving.audit_events()
    ), serving.audit_events()


def test_violation_details_fit_grpc_default_metadata_limit(
    channel: grpc.Channel, bait: tuple[Bait, Listener]
) -> None:
    case = next(c for c in cases(bait[0]) if c.name == "many_violations_fit_the_trailer")
    answer = send_raw(channel, case)
    assert answer.code is grpc.StatusCode.INVALID_ARGUMENT
    assert 0 < answer.field_violations < 90 and "more field violations" in answer.message


def test_the_server_still_serves_after_every_abuse(
    channel: grpc.Channel, solo_victim: list[int]
) -> None:
    reply = pb_grpc.EspalierStub(channel).GenerateUnary(VICTIM, timeout=600)
    assert list(reply.token_ids) == solo_victim


def test_a_duplicate_request_id_is_refused_and_spares_the_victim(
    channel: grpc.Channel, solo_victim: list[int]
) -> None:
    """Reusing an in-flight request's id must neither abort nor join the request holding it."""
    started, victim = threading.Event(), {}
    thread = threading.Thread(target=run_victim, args=(channel, started, victim))
    thread.start()
    assert started.wait(600)
    thief = pb.GenerateRequest(request_id=VICTIM.request_id, text="x")
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.EspalierStub(channel).GenerateUnary(thief, timeout=600)
    thread.join(600)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "error" not in victim and victim["tokens"] == solo_victim


@pytest.mark.parametrize("method", ["CompileGrammar", "GenerateUnary"])
def test_compiles_their_callers_left_do_not_hold_the_backend(
    channel: grpc.Channel, method: str
) -> None:
    """Two short outlines-core regexes that take minutes (``b`` about 97,000 times: counts up
    to regex_dialect.MAX_REPEAT), sent with a 2 s deadline, held both outlines-core children
    until the compile limit (900 s here), and the next caller waited behind them. A compile
    nobody waits for stops, so the next one gets a child well inside its 120 s deadline."""
    stub = pb_grpc.EspalierStub(channel)
    base = 320 if method == "CompileGrammar" else 330

    codes: list[grpc.StatusCode] = []

    def abandoned(i: int) -> None:
        constraint = pb.Constraint(regex=f"(?:b{{{base + i}}}){{300}}", backend="outlines_core")
        try:
            if method == "CompileGrammar":
                stub.CompileGrammar(pb.CompileGrammarRequest(constraint=constraint), timeout=2)
            else:
                request = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_tokens=2))
                request.constraint.CopyFrom(constraint)
                stub.GenerateUnary(request, timeout=2)
        except grpc.RpcError as exc:
            codes.append(exc.code())  # type: ignore[attr-defined]

    callers = [threading.Thread(target=abandoned, args=(i,)) for i in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(60)
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 2
    ordinary = pb.Constraint(regex=f"[xyz]{{3}}q{base}", backend="outlines_core")
    reply = stub.CompileGrammar(pb.CompileGrammarRequest(constraint=ordinary), timeout=120)
    assert reply.backend == "outlines_core"
