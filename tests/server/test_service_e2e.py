"""End to end against a real ``espalier serve`` process (tiny random model, Gemma tokenizer):
generation per constraint kind, the grammar and tokenizer RPCs, every error path, deadlines,
cancellation, reflection and metrics. Clients are the Python SDK (sync and async) and raw stubs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Literal

import grpc
import pytest
from espalier_client import (
    AsyncClient,
    Client,
    DeadlineExceededError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from pydantic import BaseModel, ConfigDict, Field

from tests.fixtures.server_helpers import (
    CHOICES,
    CONSTRAINTS,
    SCHEMA,
    check_output,
    scrape,
    wait_until_idle,
)
from tests.fixtures.server_process import ServerProcess

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.address, timeout_s=600.0) as c:
        yield c


# -- no model needed ------------------------------------------------------------------------------


def test_reflection_lists_the_service(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"espalier.v1.Espalier", "grpc.health.v1.Health"} <= services


def test_tokenize_and_model_info(client: Client) -> None:
    ids = client.tokenize("Hello world")
    assert ids and all(isinstance(i, int) for i in ids)
    info = client.model_info()
    assert info.tokenizer_vocab_size == 262144 and 1 in info.stop_token_ids
    assert info.max_prompt_tokens == 512 and info.max_grammar_bytes == 4096


def test_invalid_parameters_name_every_field(client: Client) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        client.generate("x", top_p=1.5, temperature=-1.0, max_tokens=0, stop=[""])
    err = info.value
    assert err.reason == "INVALID_ARGUMENT"
    assert {v.field for v in err.field_violations} == {
        "sampling.top_p",
        "sampling.temperature",
        "sampling.max_tokens",
        "sampling.stop[0]",
    }


def test_prompt_over_the_token_limit(client: Client) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        client.generate("word " * 2000)
    assert info.value.reason == "PROMPT_TOO_LONG"
    assert info.value.field_violations[0].field == "text"
    assert info.value.metadata["limit_tokens"] == "512"


def test_message_over_the_size_limit(client: Client) -> None:
    with pytest.raises(ResourceExhaustedError):
        client.generate("x" * (2 << 20))


def test_grammar_over_the_byte_limit(client: Client) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        client.generate("x", regex="a" * 5000)
    assert [v.field for v in info.value.field_violations] == ["constraint.regex"]
    assert info.value.field_violations[0].reason == "TOO_LARGE"


def test_malformed_schema_reports_line_and_column(client: Client) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        client.compile_grammar(schema='{"type": "object",\n "properties": }')
    err = info.value
    assert err.reason == "INVALID_GRAMMAR"
    assert err.metadata["line"] == "2"
    assert err.field_violations[0].field.startswith("constraint.json_schema:2:")


def test_compile_grammar_reports_backend_and_cache(client: Client, server: ServerProcess) -> None:
    # before the model loads, CompileGrammar compiles in the server process, then in the
    # engine's (startup.py): both calls in the engine's, or the second may find the other cache
    assert server.wait_loaded()
    first = client.compile_grammar(regex="[0-9]{4}", backend="llguidance")
    assert first.backend == "llguidance" and first.cache_key
    again = client.compile_grammar(regex="[0-9]{4}", backend="llguidance")
    assert again.cache_hit and again.cache_key == first.cache_key


def test_strict_mode_refuses_a_weakened_schema_with_json_pointers(client: Client) -> None:
    schema = {  # no backend enforces uniqueItems over objects
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "object"}, "uniqueItems": True}},
        "additionalProperties": False,
    }
    with pytest.raises(InvalidArgumentError) as info:
        client.compile_grammar(schema=schema, backend="xgrammar")
    err = info.value
    assert err.reason == "SCHEMA_NOT_ENFORCEABLE"
    assert err.field_violations
    for violation in err.field_violations:
        assert violation.field.startswith("constraint.json_schema#/")
        assert violation.reason in ("KEYWORD_WEAKENED", "KEYWORD_IGNORED")


# unique object items: no grammar says them and the key tracker does not follow them; xgrammar
# compiles the rest and reports the keyword (a bound past 2**53 on llguidance, the example
# before, is exact since the number policy clamps it)
WHEN = {
    "type": "object",
    "properties": {"when": {"type": "array", "items": {"type": "object"}, "uniqueItems": True}},
}


def test_allow_weakening_reports_the_weakened_keywords(client: Client) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        client.compile_grammar(schema=WHEN, backend="xgrammar")
    assert [v.field for v in info.value.field_violations] == [
        "constraint.json_schema#/properties/when"
    ]
    result = client.compile_grammar(schema=WHEN, backend="xgrammar", allow_weakening=True)
    assert result.backend == "xgrammar"
    weakened = [(w.keyword, w.pointer) for w in result.weakened]
    assert weakened == [("uniqueItems", "/properties/when")]


def test_a_generation_reports_each_weakened_keyword_in_its_fields(
    serving: ServerProcess, client: Client
) -> None:
    """Held-out sweep: a generation's ``weakened`` held the whole sentence in ``keyword``, an
    empty pointer and backend, and ``weakened`` for ignored keywords too."""
    result = client.generate(
        "x", schema=WHEN, backend="xgrammar", allow_weakening=True, max_tokens=8
    )
    assert [(w.keyword, w.pointer, w.support, w.backend) for w in result.weakened] == [
        ("uniqueItems", "/properties/when", "ignored", "xgrammar")
    ]


def test_allow_weakening_on_llguidance_reports_the_keyword_it_drops(client: Client) -> None:
    with pytest.raises(InvalidArgumentError):
        client.compile_grammar(schema=WHEN, backend="llguidance")
    result = client.compile_grammar(schema=WHEN, backend="llguidance", allow_weakening=True)
    assert result.backend == "llguidance"  # llguidance refused uniqueItems outright before
    weakened = [(w.keyword, w.pointer) for w in result.weakened]
    assert weakened == [("uniqueItems", "/properties/when")]


def test_unknown_backend(client: Client) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        client.compile_grammar(regex="a", backend="nope")
    assert info.value.reason == "UNKNOWN_BACKEND"
    assert info.value.field_violations[0].field == "constraint.backend"


# -- generation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_unary_and_stream_generate_valid_identical_outputs(
    serving: ServerProcess, client: Client, kind: str
) -> None:
    kwargs = dict(CONSTRAINTS[kind], backend="llguidance", max_tokens=96, temperature=1.0, seed=11)
    unary = client.generate("Answer: ", **kwargs)
    check_output(kind, unary.text, unary.finish_reason)
    assert unary.backend == "llguidance"
    if unary.finish_reason == "length_unclosed":
        assert unary.valid is False
    elif unary.finish_reason != "length":
        assert unary.valid is True
    chunks = list(client.stream("Answer: ", **kwargs))
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert "".join(c.text for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
    assert chunks[-1].finish_reason == unary.finish_reason


def test_unconstrained_generation_reports_usage(serving: ServerProcess, client: Client) -> None:
    result = client.generate("Hello", max_tokens=7, ignore_eos=True)
    assert result.finish_reason == "length" and result.completion_tokens == 7
    assert len(result.token_ids) == 7 and result.prompt_tokens >= 1 and result.backend == ""
    timings = result.raw.timings
    assert timings.total_seconds >= timings.first_token_seconds > 0


def test_speculative_requests_report_stats_and_match_plain_greedy(
    serving: ServerProcess, client: Client
) -> None:
    kwargs = dict(CONSTRAINTS["json_schema"], backend="llguidance", max_tokens=96)
    plain = client.generate("Data: ", **kwargs)
    fast = client.generate(
        "Data: ", speculative=True, speculative_methods=["ngram", "forced"], **kwargs
    )
    assert fast.text == plain.text and fast.token_ids == plain.token_ids
    stats = fast.raw.speculative
    assert stats.steps > 0 and stats.forced_tokens > 0
    assert plain.raw.speculative.steps == 0


class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=5)
    ok: bool
    tag: Literal["red", "green"]


def test_generate_json_returns_a_pydantic_object(serving: ServerProcess, client: Client) -> None:
    pet = client.generate_json(Pet, "A pet: ", backend="llguidance", max_tokens=128)
    assert isinstance(pet, Pet)
    value = client.generate_json(SCHEMA, "A pet: ", backend="llguidance", max_tokens=128)
    assert set(value) == {"name", "ok", "tag"}


def test_async_client_streams_and_generates(serving: ServerProcess) -> None:
    async def run() -> tuple[str, str]:
        async with AsyncClient(serving.address, timeout_s=600.0) as c:
            streamed = "".join(
                [ch.text async for ch in c.stream("Pick: ", choice=CHOICES, backend="llguidance")]
            )
            unary = await c.generate("Pick: ", choice=CHOICES, backend="llguidance")
            return streamed, unary.text

    streamed, unary = asyncio.run(run())
    assert streamed == unary and unary in CHOICES


def test_deadline_exceeded_aborts_the_request(serving: ServerProcess, client: Client) -> None:
    assert serving.metrics_port is not None
    before = scrape(serving.metrics_port).get("espalier_aborted_requests_total", 0.0)
    with pytest.raises(DeadlineExceededError):
        client.generate("Tell me", max_tokens=8000, ignore_eos=True, timeout=1.0)
    after = wait_until_idle(serving.metrics_port)
    assert after["espalier_aborted_requests_total"] >= before + 1


def test_client_cancel_mid_stream_frees_the_request(serving: ServerProcess, client: Client) -> None:
    assert serving.metrics_port is not None
    before = scrape(serving.metrics_port).get("espalier_aborted_requests_total", 0.0)
    stream = client.stream("Tell me", max_tokens=8000, ignore_eos=True)
    for i, chunk in enumerate(stream):
        assert not chunk.finished
        if i == 3:
            break
    assert scrape(serving.metrics_port)["espalier_active_requests"] >= 1
    stream.close()  # cancels the RPC
    after = wait_until_idle(serving.metrics_port)
    assert after["espalier_aborted_requests_total"] >= before + 1
    assert after["espalier_engine_kv_blocks_free"] > 0


def test_health_is_serving_and_metrics_count_requests(
    serving: ServerProcess, client: Client
) -> None:
    client.generate("Hello", max_tokens=7, ignore_eos=True)
    client.compile_grammar(regex="[0-9]{4}", backend="llguidance")
    client.compile_grammar(regex="[0-9]{4}", backend="llguidance")  # a cache hit
    with pytest.raises(InvalidArgumentError):
        client.generate("x", top_p=2.0)
    with grpc.insecure_channel(serving.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "espalier.v1.Espalier"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert serving.metrics_port is not None
    m = scrape(serving.metrics_port)
    ok = 'espalier_requests_total{code="OK",method="GenerateUnary"}'
    bad = 'espalier_requests_total{code="INVALID_ARGUMENT",method="GenerateUnary"}'
    assert m[ok] >= 1 and m[bad] >= 1
    assert m["espalier_time_to_first_token_seconds_count"] >= 1
    assert m["espalier_time_per_output_token_seconds_count"] >= 1
    assert m["espalier_generated_tokens_total"] >= 7
    assert 'espalier_grammar_cache_lookups_total{result="hit"}' in m
    assert m['espalier_grammar_compile_phase_seconds_total{phase="running"}'] > 0
    assert 'espalier_grammar_compile_phase_seconds_total{phase="queued"}' in m
    assert m["espalier_grammar_compiles_abandoned"] == 0
    assert "espalier_tree_mask_seconds_count" in m
    assert json.dumps(m)  # plain floats throughout
