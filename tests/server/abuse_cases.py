"""Abusive and careless requests, each with the status a server must answer it with.

Shared by ``tests/server/test_abuse.py`` and ``bench/load.py --abusive-fraction``. Every case is a
raw serialized request (some are not valid protobuf at all), sent with :func:`send_raw` so that no
client library smooths it over. Cases that point at a file or a URL take them from a :class:`Bait`:
the server must neither open the file nor connect to the port.

The limits assumed are those of the shared test server (``tests/server/conftest.py``):
``--max-grammar-bytes 4096``, ``--max-prompt-bytes 65536``, ``--max-message-mb 1``, speculative
methods ``ngram,forced`` loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from espalier.v1 import espalier_pb2 as pb

SERVICE = "/espalier.v1.Espalier/"
PROMPT = "Write:"


@dataclass(frozen=True)
class Bait:
    """A file the server must not read and a loopback port it must not connect to."""

    file_uri: str
    http_url: str


@dataclass(frozen=True)
class AbuseCase:
    """One request: ``method`` of the Espalier service, its raw bytes, the expected status."""

    name: str
    method: str
    payload: bytes
    code: grpc.StatusCode
    reason: str = ""  # ErrorInfo reason, when the case pins one


def _generate(constraint: pb.Constraint | None = None, **fields: Any) -> bytes:
    fields.setdefault("sampling", pb.SamplingParams(max_tokens=4))
    msg = pb.GenerateRequest(text=PROMPT, **fields)
    if constraint is not None:
        msg.constraint.CopyFrom(constraint)
    return msg.SerializeToString()


def _schema(schema: Any, *, weaken: bool = False) -> bytes:
    text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
    return _generate(pb.Constraint(json_schema=text, allow_weakening=weaken))


def _bad_details_schema() -> dict[str, Any]:
    """~100 keywords no backend enforces: the refusal lists one violation per keyword."""
    props = {f"p{i:02d}": {"type": "array", "uniqueItems": True} for i in range(90)}
    return {"type": "object", "properties": props}


INVALID = grpc.StatusCode.INVALID_ARGUMENT


def cases(bait: Bait) -> list[AbuseCase]:
    """Every abusive input, in a stable order."""
    deep = '{"items":' * 300 + "{}" + "}" * 300
    return [
        AbuseCase(
            "choice_2001_options",
            "GenerateUnary",
            _generate(pb.Constraint(choice=pb.Choice(options=[f"o{i}" for i in range(2001)]))),
            INVALID,
        ),
        AbuseCase(
            "lark_2001_alternatives",
            "GenerateUnary",
            _generate(pb.Constraint(lark="start: " + " | ".join(f'"{i}"' for i in range(2001)))),
            INVALID,
        ),
        AbuseCase(
            "dynamic_ref_to_file",
            "GenerateUnary",
            _schema({"$dynamicRef": bait.file_uri}, weaken=True),
            INVALID,
            "INVALID_GRAMMAR",
        ),
        AbuseCase(
            "ref_to_file",
            "GenerateUnary",
            _schema({"$ref": bait.file_uri}, weaken=True),
            INVALID,
            "INVALID_GRAMMAR",
        ),
        AbuseCase(
            "ref_to_http",
            "GenerateUnary",
            _schema({"type": "object", "properties": {"a": {"$ref": bait.http_url}}}),
            INVALID,
            "INVALID_GRAMMAR",
        ),
        AbuseCase(  # strict mode too: refs are resolved at compile, not only by post-validation
            "ref_to_file_strict",
            "GenerateUnary",
            _schema({"type": "object", "properties": {"a": {"$ref": bait.file_uri}}}),
            INVALID,
            "INVALID_GRAMMAR",
        ),
        AbuseCase(
            "dynamic_ref_to_http",
            "GenerateUnary",
            _schema({"type": "array", "items": {"$dynamicRef": bait.http_url}}),
            INVALID,
            "INVALID_GRAMMAR",
        ),
        AbuseCase(
            "recursive_ref_to_file",
            "GenerateUnary",
            _schema(
                {
                    "$schema": "https://json-schema.org/draft/2019-09/schema",
                    "$recursiveRef": bait.file_uri,
                }
            ),
            INVALID,
            "INVALID_GRAMMAR",
        ),
        AbuseCase(
            "recursive_ref_to_http",
            "GenerateUnary",
            _schema(
                {
                    "$schema": "https://json-schema.org/draft/2019-09/schema",
                    "$recursiveRef": bait.http_url,
                },
                weaken=True,
            ),
            INVALID,
            "INVALID_GRAMMAR",
        ),
        AbuseCase(
            "schema_dialect_at_http",
            "CompileGrammar",
            pb.CompileGrammarRequest(
                constraint=pb.Constraint(json_schema=json.dumps({"$schema": bait.http_url}))
            ).SerializeToString(),
            grpc.StatusCode.OK,
        ),
        AbuseCase(
            "schema_dialect_at_file",
            "CompileGrammar",
            pb.CompileGrammarRequest(
                constraint=pb.Constraint(
                    json_schema=json.dumps({"$schema": bait.file_uri, "type": "integer"})
                )
            ).SerializeToString(),
            grpc.StatusCode.OK,
        ),
        AbuseCase(
            "schema_dialect_at_http_generate",
            "GenerateUnary",
            _schema({"$schema": bait.http_url, "type": "string", "maxLength": 3}, weaken=True),
            grpc.StatusCode.OK,
        ),
        AbuseCase(
            "prompt_over_byte_limit",
            "GenerateUnary",
            pb.GenerateRequest(text="x" * 300_000).SerializeToString(),
            INVALID,
            "PROMPT_TOO_LONG",
        ),
        AbuseCase(
            "tokenize_over_byte_limit",
            "Tokenize",
            pb.TokenizeRequest(text="word " * 60_000).SerializeToString(),
            INVALID,
            "PROMPT_TOO_LONG",
        ),
        AbuseCase(
            "stop_string_over_byte_limit",
            "GenerateUnary",
            _generate(sampling=pb.SamplingParams(stop=["s" * 5000], max_tokens=4)),
            INVALID,
        ),
        AbuseCase(
            "many_violations_fit_the_trailer",
            "GenerateUnary",
            _schema(_bad_details_schema()),
            INVALID,
            "SCHEMA_NOT_ENFORCEABLE",
        ),
        AbuseCase("schema_300_deep", "GenerateUnary", _schema(deep), INVALID, "INVALID_GRAMMAR"),
        AbuseCase(
            "json_text_4000_deep", "GenerateUnary", _schema("[" * 4000), INVALID, "INVALID_GRAMMAR"
        ),
        AbuseCase(  # 100k-deep JSON text: refused by its size before any parsing
            "json_text_100k_deep",
            "GenerateUnary",
            _schema("[" * 100_000),
            INVALID,
        ),
        AbuseCase(
            "lark_over_byte_limit",
            "GenerateUnary",
            _generate(pb.Constraint(lark='start: "' + "a" * 5000 + '"')),
            INVALID,
        ),
        AbuseCase("ref_to_root", "GenerateUnary", _schema({"$ref": "#"}), INVALID),
        AbuseCase(
            "ref_cycle",
            "GenerateUnary",
            _schema(
                {
                    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                    "$ref": "#/$defs/a",
                }
            ),
            INVALID,
        ),
        AbuseCase(  # passes the start state ("{" is allowed), then can only nest forever
            "required_property_nests_forever",
            "GenerateUnary",
            _schema(
                {
                    "type": "object",
                    "properties": {"a": {"$ref": "#"}},
                    "required": ["a"],
                    "additionalProperties": False,
                }
            ),
            INVALID,
            "INVALID_GRAMMAR",
        ),
        AbuseCase(
            "gbnf_left_recursion",
            "GenerateUnary",
            _generate(pb.Constraint(ebnf="root ::= root")),
            INVALID,
        ),
        AbuseCase(
            "lark_left_recursion",
            "GenerateUnary",
            _generate(pb.Constraint(lark="start: start")),
            INVALID,
        ),
        AbuseCase(
            "temperature_inf",
            "GenerateUnary",
            _generate(sampling=pb.SamplingParams(temperature=float("inf"), max_tokens=4)),
            INVALID,
        ),
        AbuseCase(
            "top_p_nan",
            "GenerateUnary",
            _generate(sampling=pb.SamplingParams(top_p=float("nan"), max_tokens=4)),
            INVALID,
        ),
        AbuseCase(
            "invalid_utf8_text", "GenerateUnary", b"\x12\x02\xff\xfe", INVALID, "MALFORMED_REQUEST"
        ),
        AbuseCase("truncated_message", "Generate", b"\x12\x05ab", INVALID, "MALFORMED_REQUEST"),
        AbuseCase(
            "invalid_utf8_tokenize", "Tokenize", b"\x0a\x01\xc3", INVALID, "MALFORMED_REQUEST"
        ),
        AbuseCase(
            "min_length_negative",
            "GenerateUnary",
            _schema({"type": "string", "minLength": -1}),
            INVALID,
            "INVALID_GRAMMAR",
        ),
        AbuseCase(
            "speculative_method_not_loaded",
            "GenerateUnary",
            _generate(speculative=pb.SpeculativeOptions(enabled=True, methods=["eagle"])),
            INVALID,
        ),
        AbuseCase(
            "backend_without_constraint",
            "GenerateUnary",
            _generate(pb.Constraint(backend="xgrammar")),
            INVALID,
        ),
        AbuseCase(
            "documented_backend_name_outlines",
            "CompileGrammar",
            pb.CompileGrammarRequest(
                constraint=pb.Constraint(regex="[a-c]{1,3}", backend="outlines")
            ).SerializeToString(),
            grpc.StatusCode.OK,
        ),
        AbuseCase(
            "regex_4000_groups_deep",
            "GenerateUnary",
            _generate(pb.Constraint(regex="(" * 2000 + "a" + ")" * 2000)),
            INVALID,
        ),
    ]


@dataclass(frozen=True)
class Answer:
    code: grpc.StatusCode
    reason: str
    message: str
    field_violations: int


def send_raw(
    channel: grpc.Channel,
    case: AbuseCase,
    timeout_s: float = 300.0,
    service: str = SERVICE,
    streaming: tuple[str, ...] = ("Generate",),
) -> Answer:
    """Send ``case`` as raw bytes to ``service`` (a ``/package.Service/`` prefix; its
    ``streaming`` methods are server-streaming); the status, its ErrorInfo reason and violation
    count."""
    path = service + case.method  # no (de)serializers: the bytes go out as they are
    try:
        if case.method in streaming:
            for _ in channel.unary_stream(path)(case.payload, timeout=timeout_s):
                pass
        else:
            channel.unary_unary(path)(case.payload, timeout=timeout_s)
    except grpc.RpcError as exc:
        return _answer(exc)
    return Answer(grpc.StatusCode.OK, "", "", 0)


def _answer(exc: grpc.RpcError) -> Answer:
    code = exc.code()  # type: ignore[attr-defined]
    message = exc.details() or ""  # type: ignore[attr-defined]
    reason, violations = "", 0
    status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    if status is not None:
        for detail in status.details:
            info, bad = error_details_pb2.ErrorInfo(), error_details_pb2.BadRequest()
            if detail.Unpack(info):
                reason = info.reason
            elif detail.Unpack(bad):
                violations = len(bad.field_violations)
    return Answer(code, reason, message, violations)
