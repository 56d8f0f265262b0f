"""The OpenAI API through the real SMG gateway in front of a real ``espalier serve``.

SMG renders the chat template it fetched from the worker (GetTokenizer), tokenizes, turns
``response_format`` and ``tools`` into constraints, and speaks SMG's vLLM worker protocol to
``espalier serve --smg-port``. The model is the tiny random-weight one over the real Gemma
tokenizer: its words are noise, but every constrained output must validate.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.fixtures.gateway_process import SmgGateway, smg_binary
from tests.fixtures.server_process import REPO, ServerProcess

openai = pytest.importorskip("openai", reason="the gateway extra is not installed")

MODEL = "tiny-random"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}


def start_worker() -> ServerProcess:
    return ServerProcess("--smg-port", "0", "--compile-timeout", "900", model=MODEL)


def start_gateway(worker: ServerProcess) -> SmgGateway:
    binary = smg_binary()
    if binary is None:
        pytest.fail("smg is not installed: scripts/setup.sh installs the gateway extra")
    try:
        subprocess.run([binary, "--version"], check=True, capture_output=True, timeout=60)
    except OSError as exc:  # e.g. no wheel of the Rust binary for this platform
        pytest.skip(f"the smg binary cannot run here: {exc}")
    assert worker.smg_port is not None
    return SmgGateway(worker.smg_port)


@pytest.fixture(scope="module")
def worker() -> Iterator[ServerProcess]:
    with start_worker() as srv:
        if not srv.wait_loaded():
            pytest.skip(f"the engine is not available: {srv.wait_event('load_failed')}")
        yield srv


@pytest.fixture(scope="module")
def client(worker: ServerProcess) -> Iterator[Any]:
    with start_gateway(worker) as gateway:
        yield openai.OpenAI(base_url=gateway.base_url, api_key="-", max_retries=0, timeout=600)


def chat(client: Any, content: str, **kwargs: Any) -> Any:
    messages = [
        {"role": "system", "content": "Answer in JSON."},
        {"role": "user", "content": content},
    ]
    kwargs.setdefault("max_tokens", 96)
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def test_response_format_json_schema_validates(client: Any) -> None:
    reply = chat(client, "Describe a person.", response_format=json_schema_format(PERSON))
    choice = reply.choices[0]
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert choice.finish_reason == "stop"
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0


def test_streamed_completion_validates(client: Any) -> None:
    stream = chat(
        client, "Describe someone else.", response_format=json_schema_format(PERSON), stream=True
    )
    pieces, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert len(pieces) > 1, "the answer arrived in one piece: not streamed"
    jsonschema.validate(json.loads("".join(pieces)), PERSON)
    assert finish == "stop"


def test_response_format_with_tools_offered_ends_at_the_json(client: Any) -> None:
    """With tools on offer SMG keeps special tokens in the text: the stop token the engine
    sampled was written after the JSON (``{...}<end_of_turn>``, finish ``stop``) until the
    tokenizer bundle named the stop ids for SMG to strip."""
    reply = chat(
        client,
        "Describe a person.",
        response_format=json_schema_format(PERSON),
        tools=TOOLS,
        tool_choice="auto",
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def check_tool_calls(message: Any, allowed: set[str]) -> list[str]:
    assert message.tool_calls, f"no tool calls; content: {message.content!r}"
    names = []
    for call in message.tool_calls:
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
        names.append(call.function.name)
    return names


def test_tool_choice_required_calls_a_tool_with_valid_arguments(client: Any) -> None:
    reply = chat(client, "Weather in Paris?", tools=TOOLS, tool_choice="required")
    check_tool_calls(reply.choices[0].message, set(PARAMETERS))
    assert reply.choices[0].finish_reason == "tool_calls"


def test_named_tool_choice_calls_that_tool(client: Any) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = chat(client, "What time is it?", tools=TOOLS, tool_choice=named)
    assert check_tool_calls(reply.choices[0].message, {"get_time"}) == ["get_time"]


def test_without_max_tokens_the_worker_default_applies(client: Any) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A person."}],
        temperature=0,
        response_format=json_schema_format(PERSON),
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


def test_malformed_schema_is_http_400_naming_the_problem(client: Any) -> None:
    bad = {"type": "object", "properties": {"age": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, "x", response_format=json_schema_format(bad))
    assert info.value.status_code == 400
    assert "no-such-type" in str(info.value)


def test_refused_field_is_http_400_naming_it(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, "x", frequency_penalty=0.5)
    assert "frequency_penalty" in str(info.value)


def test_over_the_limit_is_http_400_with_the_limit(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, "x", max_tokens=100_000)
    assert "max_tokens: must be <= 8192" in str(info.value)


def test_a_gateway_started_while_the_worker_loads_serves_once_it_has_loaded() -> None:
    """A held-out sweep: SMG started between the worker's ``listening`` and ``serving``
    registered it as model ``unknown`` without a tokenizer for good (chat: 404 "No worker
    available"). The worker's HealthCheck and GetModelInfo are UNAVAILABLE until the model is
    loaded, and SMG retries its registration until then."""
    worker = start_worker()
    try:
        if worker.has_event("serving"):
            pytest.skip("the worker loaded before the gateway started: no race to run")
        with start_gateway(worker) as gateway:
            assert worker.wait_loaded()
            client = openai.OpenAI(
                base_url=gateway.base_url, api_key="-", max_retries=0, timeout=300
            )
            assert [m.id for m in client.models.list().data] == [MODEL]
            reply = chat(client, "Where?", response_format=json_schema_format(WEATHER))
            assert reply.model == MODEL
            if reply.choices[0].finish_reason == "stop":
                jsonschema.validate(json.loads(reply.choices[0].message.content), WEATHER)
    finally:
        worker.discard()


def test_worker_killed_mid_stream_gives_the_client_an_error() -> None:
    worker = start_worker()
    try:
        if not worker.wait_loaded():
            pytest.skip("the engine is not available")
        with start_gateway(worker) as gateway:
            client = openai.OpenAI(
                base_url=gateway.base_url, api_key="-", max_retries=0, timeout=120
            )
            stream = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Talk."}],
                max_tokens=4000,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            finishes: list[str] = []
            with pytest.raises(openai.APIError) as info:
                for chunk in stream:
                    if worker.proc.poll() is None:
                        worker.proc.send_signal(signal.SIGKILL)  # a crash, not a drain
                        worker.proc.wait()
                    finishes.extend(c.finish_reason for c in chunk.choices if c.finish_reason)
            assert not finishes, f"a killed worker's stream finished normally: {finishes}"
            # The client's own read timeout would also raise: that would be the hang.
            assert not isinstance(info.value, openai.APITimeoutError)
    finally:
        worker.discard()


@pytest.mark.slow
@pytest.mark.model
def test_gateway_script_serves_the_embedded_model(tmp_path: Path) -> None:
    """scripts/gateway.sh: one JSON line when ready, a validated answer, SIGTERM stops both."""
    env = dict(os.environ, PYTHON=sys.executable, SMG=smg_binary() or "smg")
    log = (tmp_path / "gateway.log").open("w")
    script = subprocess.Popen(
        ["bash", str(REPO / "scripts" / "gateway.sh")],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
    )
    try:
        assert script.stdout is not None
        ready = json.loads(script.stdout.readline())
        client = openai.OpenAI(base_url=ready["openai_base_url"], api_key="-", max_retries=0)
        (model,) = [m.id for m in client.models.list()]
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            temperature=0,
            max_tokens=128,
            response_format=json_schema_format(PERSON),
        )
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    finally:
        script.send_signal(signal.SIGTERM)
        code = script.wait(timeout=300)
        log.close()
    assert code == 0, (tmp_path / "gateway.log").read_text()[-3000:]
