"""Every error path → its gRPC code and google.rpc details (never UNKNOWN for user errors)."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from espalier.constrained.errors import (
    CompileMemoryError,
    CompileTimeoutError,
    GrammarCostError,
    InvalidGrammarError,
    KeywordIssue,
    SchemaNotEnforceableError,
    UnknownBackendError,
    UnsupportedGrammarError,
)
from espalier.engine.api import InvalidRequestError as EngineInvalidRequest
from espalier.server.errors import (
    DrainingError,
    InvalidRequestError,
    NotReadyError,
    ResourceExhaustedError,
    Violation,
    to_grpc_status,
)


def unpack(status: grpc.Status) -> tuple[error_details_pb2.ErrorInfo, list[tuple[str, str]], bool]:
    """(ErrorInfo, [(field, reason)], has RetryInfo) of a status."""

    class Call:
        def code(self) -> grpc.StatusCode:
            return status.code

        def details(self) -> str:
            return status.details

        def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
            return status.trailing_metadata

    rich = rpc_status.from_call(Call())  # type: ignore[arg-type]
    assert rich is not None
    info, violations, retry = error_details_pb2.ErrorInfo(), [], False
    for detail in rich.details:
        bad, retry_info = error_details_pb2.BadRequest(), error_details_pb2.RetryInfo()
        if detail.Unpack(bad):
            violations = [(v.field, v.reason) for v in bad.field_violations]
        elif detail.Unpack(retry_info):
            retry = True
        else:
            assert detail.Unpack(info)
    return info, violations, retry


def test_invalid_grammar_with_a_json_pointer() -> None:
    exc = InvalidGrammarError("json_schema", "bad type", pointer="/properties/age")
    status = to_grpc_status(exc)
    info, violations, _ = unpack(status)
    assert status.code is grpc.StatusCode.INVALID_ARGUMENT
    assert info.reason == "INVALID_GRAMMAR" and info.domain == "espalier.v1"
    assert info.metadata["pointer"] == "/properties/age"
    assert violations == [("constraint.json_schema#/properties/age", "")]


def test_invalid_grammar_with_a_line_and_column() -> None:
    status = to_grpc_status(InvalidGrammarError("ebnf", "unexpected", line=3, column=7))
    _, violations, _ = unpack(status)
    assert violations == [("constraint.ebnf:3:7", "")]


def test_schema_not_enforceable_lists_every_keyword_with_its_pointer() -> None:
    issues = [
        KeywordIssue("pattern", "/properties/name", "weakened", "xgrammar"),
        KeywordIssue("uniqueItems", "/properties/tags", "ignored", "xgrammar"),
    ]
    status = to_grpc_status(SchemaNotEnforceableError(issues, "auto"))
    info, violations, _ = unpack(status)
    assert status.code is grpc.StatusCode.INVALID_ARGUMENT
    assert info.reason == "SCHEMA_NOT_ENFORCEABLE"
    assert violations == [
        ("constraint.json_schema#/properties/name", "KEYWORD_WEAKENED"),
        ("constraint.json_schema#/properties/tags", "KEYWORD_IGNORED"),
    ]


def test_backend_errors_point_at_the_backend_field() -> None:
    for exc in (
        UnknownBackendError("nope", ["xgrammar"]),
        UnsupportedGrammarError("outlines", "lark"),
    ):
        status = to_grpc_status(exc)
        info, violations, _ = unpack(status)
        assert status.code is grpc.StatusCode.INVALID_ARGUMENT
        assert info.reason == exc.reason
        assert violations == [("constraint.backend", "")]


def test_compile_past_its_memory_limit_points_at_the_backend() -> None:
    status = to_grpc_status(CompileMemoryError("outlines_core", 4 << 30, "signal SIGABRT"))
    info, violations, _ = unpack(status)
    assert status.code is grpc.StatusCode.INVALID_ARGUMENT
    assert info.reason == "COMPILE_MEMORY_LIMIT"
    assert info.metadata["backend"] == "outlines_core"
    assert info.metadata["memory_limit_bytes"] == str(4 << 30)
    assert violations == [("constraint.backend", "")]
    assert "4 GiB" in status.details and "another backend" in status.details


def test_compile_timeout_is_deadline_exceeded_with_its_own_reason() -> None:
    status = to_grpc_status(CompileTimeoutError(2.5))
    info, _, _ = unpack(status)
    assert status.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert info.reason == "COMPILE_TIMEOUT" and info.metadata["timeout_seconds"] == "2.5"


def test_a_grammar_too_costly_to_keep_in_a_batch_is_invalid_argument() -> None:
    """Not RESOURCE_EXHAUSTED: gateways retry that code, and the same grammar costs the same
    again (SMG sent one such request five times)."""
    status = to_grpc_status(GrammarCostError(0.8, 0.05, 1.2))
    info, _, _ = unpack(status)
    assert status.code is grpc.StatusCode.INVALID_ARGUMENT
    assert info.reason == "GRAMMAR_TOO_COSTLY"
    assert "50 ms" in status.details and "800 ms" in status.details and "1.20 s" in status.details


def test_server_errors_keep_their_codes() -> None:
    cases = [
        (InvalidRequestError("x", violations=[Violation("top_p", "no")]), "INVALID_ARGUMENT"),
        (ResourceExhaustedError("full"), "RESOURCE_EXHAUSTED"),
        (NotReadyError("loading"), "UNAVAILABLE"),
        (DrainingError("bye"), "UNAVAILABLE"),
        (EngineInvalidRequest([("prompt", "empty")]), "INVALID_ARGUMENT"),
        (RuntimeError("bug"), "INTERNAL"),
    ]
    for exc, code in cases:
        status = to_grpc_status(exc)
        assert status.code.name == code, exc
    info, _, retry = unpack(to_grpc_status(ResourceExhaustedError("full")))
    assert info.reason == "QUEUE_FULL" and retry
    _, violations, _ = unpack(to_grpc_status(EngineInvalidRequest([("prompt", "empty")])))
    assert violations == [("prompt", "")]


def test_details_are_capped_to_fit_the_default_metadata_limit() -> None:
    """500 long violations and a long non-ASCII message: the trailer grpc sends (message
    percent-encoded, details base64) stays under 8 KiB; the omitted violations are counted."""
    violations = [
        Violation(f"constraint.json_schema#/properties/{'é' * 300}{i}", "x" * 1000)
        for i in range(500)
    ]
    status = to_grpc_status(InvalidRequestError("ü" * 5000, violations=violations))
    details = dict(status.trailing_metadata)["grpc-status-details-bin"]
    message_bytes = sum(1 if 32 <= b < 127 and b != 37 else 3 for b in status.details.encode())
    assert message_bytes + len(details) * 4 / 3 < 8 * 1024 - 512
    info, kept, _ = unpack(status)
    assert 0 < len(kept) < 500
    assert info.metadata["more_violations"] == str(500 - len(kept))
    assert status.details.endswith(f"(and {500 - len(kept)} more field violations)")


def test_a_grammar_that_grows_past_llguidance_mid_generation_names_the_constraint() -> None:
    """A huge repetition (``a{1000000}``) compiles, then llguidance's lexer stops a few tokens in
    with its state dumped after the first line: the caller gets that line and a violation."""
    from espalier.constrained.backends.llguidance.errors import MatcherStateError

    dump = (
        "llguidance: lexer error: too many expressions constructed\n<state>\n"
        'Tokens: ⟦"⟧\n{"lexer_cost": 2072, "rows": 3}\nStop: LexerTooComplex'
    )
    status = to_grpc_status(MatcherStateError(dump))
    info, violations, _ = unpack(status)
    assert status.code is grpc.StatusCode.INVALID_ARGUMENT
    assert info.reason == "GRAMMAR_STATE_ERROR"
    assert violations == [("constraint", "")]
    assert "too many expressions constructed" in status.details
    assert "lexer_cost" not in status.details and "<state>" not in status.details
