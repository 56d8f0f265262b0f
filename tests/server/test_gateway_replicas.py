"""``scripts/gateway.sh --replicas 2``: two real ``espalier serve`` replicas behind the real SMG.

Requests without a routing key spread over both replicas (SMG's cache_aware policy); requests
carrying the constraint's key in ``X-SMG-Routing-Key`` stay on one replica per constraint, so
each grammar compiles once in the fleet; a replica killed with SIGKILL ends its stream with an
error at the client, later requests succeed on the other, the script restarts it and SMG routes
to it again; SIGTERM stops SMG and every replica. The tests run in file order on one gateway.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from tests.fixtures.gateway_script import (
    ROUTING_KEY_HEADER,
    GatewayScript,
    Replica,
    ReplicaCounters,
    grammar_key,
    scrape,
    smg_binary,
)

openai = pytest.importorskip("openai", reason="the gateway extra is not installed")

MODEL = "tiny-random"
# Bounds against hangs only: a restart loads the tokenizer again on a loaded 2-core machine.
RESTART_TIMEOUT_S = 300.0
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
]


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayScript]:
    if smg_binary() is None:
        pytest.fail("smg is not installed: scripts/setup.sh installs the gateway extra")
    with GatewayScript("--replicas", "2", "--model", MODEL, "--compile-timeout", "900") as gw:
        yield gw


@pytest.fixture(scope="module")
def client(gateway: GatewayScript) -> Any:
    return openai.OpenAI(base_url=gateway.base_url, api_key="-", max_retries=0, timeout=120)


def counters(gateway: GatewayScript) -> list[ReplicaCounters]:
    return [scrape(replica) for replica in gateway.replicas]


def ask(client: Any, content: str, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 24)
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def distinct_prompt(i: int, salt: str) -> str:
    """A prompt sharing no text with the others past the chat template: cache_aware (prompt-prefix
    affinity) then places it by load, not next to an earlier prompt."""
    code = hashlib.sha256(f"{salt}{i}".encode()).hexdigest()[:40]
    return f"{code}: describe this code in a few words, please."


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def test_requests_without_a_key_spread_over_both_replicas(
    gateway: GatewayScript, client: Any
) -> None:
    before = counters(gateway)
    for i in range(8):
        ask(client, distinct_prompt(i, "spread"))
    served = [a.generations - b.generations for a, b in zip(counters(gateway), before)]
    assert sum(served) == 8
    assert all(n > 0 for n in served), f"one replica served everything: {served}"


def test_the_same_constraint_goes_to_the_same_replica(gateway: GatewayScript, client: Any) -> None:
    before = counters(gateway)
    for repeat in range(3):
        for k, schema in enumerate(SCHEMAS):
            fmt = response_format(schema)
            reply = ask(
                client,
                f"Item {k}, take {repeat}.",
                response_format=fmt,
                extra_headers={ROUTING_KEY_HEADER: grammar_key(fmt)},
            )
            jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    after = counters(gateway)
    misses = sum(a.cache_misses - b.cache_misses for a, b in zip(after, before))
    hits = sum(a.cache_hits - b.cache_hits for a, b in zip(after, before))
    # Each constraint compiled on exactly one replica; its later requests found it there.
    assert (misses, hits) == (len(SCHEMAS), 2 * len(SCHEMAS))


def serving_replica(gateway: GatewayScript) -> Replica:
    busy = [r for r, c in zip(gateway.replicas, counters(gateway)) if c.active > 0]
    assert len(busy) == 1, f"expected one replica generating, found {busy}"
    return busy[0]


def wait_until_up(replica: Replica) -> None:
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        try:
            scrape(replica, timeout=2)
            return
        except OSError:
            assert time.monotonic() < deadline, "the killed replica was not restarted"
            time.sleep(0.5)


def test_a_killed_replica_fails_its_stream_then_rejoins(
    gateway: GatewayScript, client: Any
) -> None:
    stream = ask(client, "Talk.", max_tokens=4000, stream=True, extra_body={"ignore_eos": True})
    killed: Replica | None = None
    finishes: list[str] = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            if killed is None:
                killed = serving_replica(gateway)
                os.kill(killed.pid, signal.SIGKILL)  # a crash, not a drain
            finishes.extend(c.finish_reason for c in chunk.choices if c.finish_reason)
    assert killed is not None
    assert not finishes, f"a killed replica's stream finished normally: {finishes}"
    # The client's own read timeout would also raise: that would be the hang.
    assert not isinstance(info.value, openai.APITimeoutError)

    survivor = next(r for r in gateway.replicas if r != killed)
    before = scrape(survivor).generations
    for i in range(6):  # right after the crash: SMG has not probed the dead replica yet
        assert ask(client, f"After the crash, request {i}.").choices[0].message.content
    assert scrape(survivor).generations - before == 6

    wait_until_up(killed)  # the script restarted it on the same ports
    for i in range(40):  # SMG probes every second; one passing probe brings it back
        ask(client, distinct_prompt(i, "rejoin"))
        if scrape(killed).generations > 0:
            break
        time.sleep(0.25)
    assert scrape(killed).generations > 0, "SMG never routed to the restarted replica"


def test_sigterm_stops_smg_and_every_replica(gateway: GatewayScript) -> None:
    assert gateway.stop() == 0, gateway.log()
    for replica in gateway.replicas:
        with pytest.raises(OSError):
            scrape(replica, timeout=2)
    with pytest.raises(OSError):
        urllib.request.urlopen(gateway.base_url.removesuffix("/v1") + "/readiness", timeout=2)
