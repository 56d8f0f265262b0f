"""SMG's vLLM worker protocol on ``espalier serve --smg-port``, spoken directly with its stubs.

The gateway's own behaviour is in test_gateway.py; here each RPC SMG calls and each constraint
kind, with the output decoded by the tokenizer the worker hands out (GetTokenizer).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import zipfile
from collections.abc import Iterator
from typing import Any

import grpc
import jsonschema
import pytest
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2
from tokenizers import Tokenizer

from tests.fixtures.abuse_cases import INVALID, AbuseCase, send_raw
from tests.fixtures.server_helpers import scrape
from tests.fixtures.server_process import ServerProcess

PROMPT = [2, 106, 1645, 108]  # <bos>, a few Gemma ids: the prompt's words do not matter


@pytest.fixture(scope="module")
def worker() -> Iterator[ServerProcess]:
    with ServerProcess("--smg-port", "0", "--compile-timeout", "900") as srv:
        if not srv.wait_loaded():
            pytest.skip(f"the engine is not available: {srv.wait_event('load_failed')}")
        yield srv


@pytest.fixture(scope="module")
def stub(worker: ServerProcess) -> Iterator[vpb_grpc.VllmEngineStub]:
    with grpc.insecure_channel(f"127.0.0.1:{worker.smg_port}") as channel:
        yield vpb_grpc.VllmEngineStub(channel)


@pytest.fixture(scope="module")
def bundle(stub: vpb_grpc.VllmEngineStub) -> tuple[bytes, str]:
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=600))
    return b"".join(c.data for c in chunks), chunks[-1].sha256


@pytest.fixture(scope="module")
def tokenizer(bundle: tuple[bytes, str]) -> Tokenizer:
    with zipfile.ZipFile(io.BytesIO(bundle[0])) as archive:
        return Tokenizer.from_str(archive.read("tokenizer.json").decode())


def generate(
    stub: vpb_grpc.VllmEngineStub, stream: bool = False, **params: Any
) -> list[vpb.GenerateResponse]:
    request = vpb.GenerateRequest(
        request_id=f"t-{hashlib.sha1(repr(params).encode()).hexdigest()[:8]}-{stream}",
        tokenized=vpb.TokenizedInput(input_ids=PROMPT),
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=64, **params),
        stream=stream,
    )
    return list(stub.Generate(request, timeout=900))


def text_of(responses: list[vpb.GenerateResponse], tokenizer: Tokenizer) -> str:
    (complete,) = [r.complete for r in responses if r.HasField("complete")]
    ids = [i for i in complete.output_ids if i != 1 and i != 106]  # eos, <end_of_turn>
    return str(tokenizer.decode(ids))


def test_tokenizer_bundle_has_the_chat_template(bundle: tuple[bytes, str]) -> None:
    data, sha256 = bundle
    assert hashlib.sha256(data).hexdigest() == sha256
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = set(archive.namelist())
        assert "tokenizer.json" in names
        config = json.loads(archive.read("tokenizer_config.json"))
        template = config.get("chat_template") or archive.read("chat_template.jinja").decode()
        # SMG strips these ids before it detokenizes (its stop decoder reads them from here)
        generation = json.loads(archive.read("generation_config.json"))
    assert "<start_of_turn>" in template
    assert {1, 106} <= set(generation["eos_token_id"])  # <eos>, <end_of_turn>


def test_health_model_server_info_and_loads(stub: vpb_grpc.VllmEngineStub) -> None:
    assert stub.HealthCheck(vpb.HealthCheckRequest()).healthy
    info = stub.GetModelInfo(vpb.GetModelInfoRequest())
    assert info.served_model_name == "tiny-random" and info.is_generation
    assert info.vocab_size >= 262144 and 1 in info.eos_token_ids
    assert stub.GetServerInfo(vpb.GetServerInfoRequest()).server_type == "espalier-grpc"
    loads = stub.GetLoads(vpb.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and len(loads.loads) == 1


@pytest.mark.parametrize(
    ("kind", "value", "check"),
    [
        ("regex", r"[a-c]{2,5}-\d{3}", lambda t: re.fullmatch(r"[a-c]{2,5}-\d{3}", t)),
        (
            "choice",
            vpb.ChoiceConstraint(choices=["north", "south", "east"]),
            lambda t: t in {"north", "south", "east"},
        ),
        ("grammar", 'root ::= "x" [0-9] [0-9]? "!"', lambda t: re.fullmatch(r"x\d\d?!", t)),
        ("grammar", 'start: "y" DIGIT+\n%import common.DIGIT', lambda t: re.fullmatch(r"y\d+", t)),
        ("json_object", True, lambda t: json.loads(t) is not None),
        (
            "structural_tag",
            json.dumps(
                {
                    "type": "structural_tag",
                    "format": {
                        "type": "tag",
                        "begin": "<r>",
                        "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
                        "end": "</r>",
                    },
                }
            ),
            lambda t: re.fullmatch(r"<r>-?\d+</r>", t),
        ),
    ],
)
def test_each_constraint_kind_is_exact(
    stub: vpb_grpc.VllmEngineStub, tokenizer: Tokenizer, kind: str, value: Any, check: Any
) -> None:
    text = text_of(generate(stub, **{kind: value}), tokenizer)
    assert check(text), f"{kind}: {text!r}"


def test_streamed_deltas_add_up_to_the_schema_output(
    stub: vpb_grpc.VllmEngineStub, tokenizer: Tokenizer
) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 8}},
        "required": ["n", "s"],
        "additionalProperties": False,
    }
    responses = generate(stub, stream=True, json_schema=json.dumps(schema))
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    assert len(chunks) > 1 and responses[-1].HasField("complete")
    ids = [i for c in chunks for i in c.token_ids if i not in (1, 106)]
    jsonschema.validate(json.loads(tokenizer.decode(ids)), schema)
    assert responses[-1].complete.finish_reason == "stop"


def test_an_unclosed_cut_reads_length_with_espaliers_reason_in_the_trailers(
    stub: vpb_grpc.VllmEngineStub,
) -> None:
    """One token cannot match 30 letters, nor can the closing policy close it: OpenAI's words
    say "length"; the trailing metadata keeps espalier's distinct reason."""
    request = vpb.GenerateRequest(
        request_id="t-unclosed",
        tokenized=vpb.TokenizedInput(input_ids=PROMPT),
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=1, regex="[a-z]{30}"),
    )
    call = stub.Generate(request, timeout=900)
    responses = list(call)
    assert responses[-1].complete.finish_reason == "length"
    assert dict(call.trailing_metadata())["espalier-finish-reason"] == "length_unclosed"


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"structural_tag": '{"type": "structural_tag"}'}, "structural_tag"),
        ({"json_schema": '{"type": "object", "properties": 5}'}, "json_schema"),
        ({"regex": "(unclosed"}, "regex"),
        ({"presence_penalty": 0.3}, "presence_penalty"),
        ({"n": 2}, "sampling_params.n"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_refusals_are_invalid_argument_naming_the_problem(
    stub: vpb_grpc.VllmEngineStub, params: dict[str, Any], field: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, **params)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()


def test_abort_ends_the_stream_as_aborted(
    stub: vpb_grpc.VllmEngineStub, worker: ServerProcess
) -> None:
    assert worker.metrics_port is not None
    before = scrape(worker.metrics_port).get("espalier_aborted_requests_total", 0.0)
    request = vpb.GenerateRequest(
        request_id="abort-me",
        tokenized=vpb.TokenizedInput(input_ids=PROMPT),
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=8000, ignore_eos=True),
        stream=True,
    )
    responses = stub.Generate(request, timeout=600)
    first = next(responses)
    assert first.HasField("chunk")
    stub.Abort(vpb.AbortRequest(request_ids=["abort-me", "not-mine"]))
    rest = list(responses)
    assert rest[-1].complete.finish_reason == "abort"
    generated = sum(len(r.chunk.token_ids) for r in [first, *rest] if r.HasField("chunk"))
    assert generated < 8000
    # counted as the cancels of espalier's own API are
    assert scrape(worker.metrics_port)["espalier_aborted_requests_total"] == before + 1


SMG_SERVICE = "/vllm.grpc.engine.VllmEngine/"
UNDECODABLE = [
    AbuseCase("invalid_utf8_request_id", "Generate", b"\x0a\x02\xff\xfe", INVALID),
    AbuseCase("truncated_generate", "Generate", b"\x0a\x05ab", INVALID),
    AbuseCase("invalid_utf8_abort_id", "Abort", b"\x0a\x01\xc3", INVALID),
    AbuseCase("wrong_wire_type", "GetModelInfo", b"\x0f", INVALID),
]


@pytest.mark.parametrize("case", UNDECODABLE, ids=[c.name for c in UNDECODABLE])
def test_undecodable_requests_are_invalid_argument_and_the_worker_serves_on(
    worker: ServerProcess, stub: vpb_grpc.VllmEngineStub, case: AbuseCase
) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{worker.smg_port}") as channel:
        answer = send_raw(
            channel, case, service=SMG_SERVICE, streaming=("Generate", "GetTokenizer")
        )
    assert (answer.code, answer.reason) == (INVALID, "MALFORMED_REQUEST"), answer.message
    assert stub.HealthCheck(vpb.HealthCheckRequest(), timeout=60).healthy


def test_methods_the_worker_lacks_stay_unimplemented(stub: vpb_grpc.VllmEngineStub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.Embed(vpb.EmbedRequest(request_id="e"), timeout=60)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
