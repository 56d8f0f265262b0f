"""Metrics and the access log tell the truth: each RPC counted under the status its client saw,
the compile histogram counts cache misses only, one access line per RPC without prompt text."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections.abc import Iterator

import pytest
from espalier_client import Client, DeadlineExceededError
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from tests.fixtures.server_helpers import scrape, wait_until_idle
from tests.fixtures.server_process import ServerProcess

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def client(serving: ServerProcess) -> Iterator[Client]:
    with Client(serving.address, timeout_s=600.0) as c:
        yield c


def requests_total(metrics_port: int, method: str, code: str) -> float:
    key = f'espalier_requests_total{{code="{code}",method="{method}"}}'
    return scrape(metrics_port).get(key, 0.0)


def test_a_passed_deadline_is_counted_as_deadline_exceeded(
    serving: ServerProcess, client: Client
) -> None:
    assert serving.metrics_port is not None
    port = serving.metrics_port
    before = {c: requests_total(port, "GenerateUnary", c) for c in ("DEADLINE_EXCEEDED", "OK")}
    with pytest.raises(DeadlineExceededError):
        client.generate("Tell me", max_tokens=8000, ignore_eos=True, timeout=1.0)
    wait_until_idle(port)
    assert (
        requests_total(port, "GenerateUnary", "DEADLINE_EXCEEDED")
        == before["DEADLINE_EXCEEDED"] + 1
    )
    assert requests_total(port, "GenerateUnary", "OK") == before["OK"]


def test_every_client_cancel_is_counted_as_cancelled(
    serving: ServerProcess, client: Client
) -> None:
    assert serving.metrics_port is not None
    port = serving.metrics_port
    before = {c: requests_total(port, "Generate", c) for c in ("CANCELLED", "OK")}
    for _ in range(3):
        stream = client.stream("Tell me", max_tokens=8000, ignore_eos=True)
        for i, _chunk in enumerate(stream):
            if i == 2:
                break
        stream.close()
    wait_until_idle(port)
    assert requests_total(port, "Generate", "CANCELLED") == before["CANCELLED"] + 3
    assert requests_total(port, "Generate", "OK") == before["OK"]


def test_the_compile_histogram_counts_cache_misses_only(
    serving: ServerProcess, client: Client
) -> None:
    assert serving.metrics_port is not None
    regex = f"x{uuid.uuid4().hex[:8]}[0-9]{{2}}"  # new to this server: one miss, then hits
    before = scrape(serving.metrics_port).get("espalier_grammar_compile_seconds_count", 0.0)
    for _ in range(3):
        client.compile_grammar(regex=regex, backend="llguidance")
    after = scrape(serving.metrics_port)
    assert after["espalier_grammar_compile_seconds_count"] == before + 1
    client.generate("Hi", regex=regex, backend="llguidance")
    waits = scrape(serving.metrics_port)["espalier_request_grammar_wait_seconds_count"]
    assert waits >= 1


def test_one_access_line_per_rpc_without_prompt_text(
    serving: ServerProcess, client: Client
) -> None:
    request_id = f"access-{uuid.uuid4().hex[:8]}"
    secret_prompt = f"PROMPT-{uuid.uuid4().hex}"
    client.generate(secret_prompt, max_tokens=5, ignore_eos=True, request_id=request_id)
    deadline = time.monotonic() + 60
    lines: list[dict[str, object]] = []
    while not lines and time.monotonic() < deadline:
        log = serving.stderr()
        lines = [
            json.loads(line)
            for line in log.splitlines()
            if line.startswith("{") and request_id in line
        ]
        time.sleep(0.1)
    assert len(lines) == 1, lines
    line = lines[0]
    assert line["event"] == "request" and line["status"] == "OK"
    assert line["method"] == "GenerateUnary" and line["completion_tokens"] == 5
    assert isinstance(line["prompt_tokens"], int) and line["prompt_tokens"] > 0
    assert isinstance(line["seconds"], float) and line["seconds"] > 0
    assert secret_prompt not in serving.stderr()


def test_engine_steps_count_the_steps_a_generation_took(
    serving: ServerProcess, client: Client
) -> None:
    assert serving.metrics_port is not None
    port = serving.metrics_port
    wait_until_idle(port)
    before = scrape(port)["espalier_engine_steps_total"]
    client.generate("Count to five", max_tokens=5, ignore_eos=True)
    wait_until_idle(port)
    steps = scrape(port)["espalier_engine_steps_total"] - before
    # one prefill step samples the first token; each later token takes at most one step
    assert 1 <= steps <= 5, steps


def test_the_exposition_parses_in_both_formats(serving: ServerProcess, client: Client) -> None:
    """Prometheus asks for OpenMetrics first, where a counter and a histogram of one name
    clash: the compile histogram and the per-phase compile counter once shared a name, and
    that format's parser refused the whole page."""
    assert serving.metrics_port is not None
    client.generate("Tell me", max_tokens=2, regex="[ab]{1,4}")  # a compile: every family filled
    url = f"http://127.0.0.1:{serving.metrics_port}/metrics"
    accept = {"Accept": "application/openmetrics-text; version=1.0.0"}
    with urllib.request.urlopen(urllib.request.Request(url, headers=accept), timeout=30) as reply:
        assert reply.headers["Content-Type"].startswith("application/openmetrics-text")
        families = {f.name for f in text_string_to_metric_families(reply.read().decode())}
    assert "espalier_grammar_compile_seconds" in families  # the histogram
    assert "espalier_grammar_compile_phase_seconds" in families  # the counter by phase
    scrape(serving.metrics_port)  # the classic text format: read line by line
