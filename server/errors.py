"""Exceptions → gRPC statuses with ``google.rpc`` details. The one place that decides status codes.

| error                                   | code               | ErrorInfo.reason        |
| --------------------------------------- | ------------------ | ----------------------- |
| invalid request field                   | INVALID_ARGUMENT   | INVALID_ARGUMENT        |
| prompt over the token limit             | INVALID_ARGUMENT   | PROMPT_TOO_LONG         |
| grammar over the byte limit / malformed | INVALID_ARGUMENT   | INVALID_GRAMMAR         |
| schema not enforceable (strict mode)    | INVALID_ARGUMENT   | SCHEMA_NOT_ENFORCEABLE  |
| backend unknown / kind unsupported      | INVALID_ARGUMENT   | UNKNOWN_BACKEND, ...    |
| grammar compile time limit              | DEADLINE_EXCEEDED  | COMPILE_TIMEOUT         |
| queue or concurrency limit              | RESOURCE_EXHAUSTED | QUEUE_FULL (+RetryInfo) |
| model loading / server draining         | UNAVAILABLE        | NOT_READY / DRAINING    |
| anything else                           | INTERNAL           | INTERNAL                |

Compile timeout is DEADLINE_EXCEEDED, not INVALID_ARGUMENT: the grammar was not shown to be wrong,
only slower to compile than the server's limit allows (a loaded server, or a compile that finishes
in the background and lands in the cache). Its ErrorInfo reason tells it apart from the caller's own
deadline. Clients must not retry it blindly (only UNAVAILABLE is retried by our SDKs).

Every BadRequest field violation names a request field (``sampling.top_p``); grammar locations add
a JSON pointer after ``#`` (``constraint.json_schema#/properties/age``) or ``:line:column``.
User errors never become UNKNOWN.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from espalier.constrained.errors import (
    CompileMemoryError,
    CompileTimeoutError,
    GrammarError,
    InvalidGrammarError,
    SchemaNotEnforceableError,
    UnknownBackendError,
    UnsupportedGrammarError,
)
from espalier.engine.api import InvalidRequestError as EngineInvalidRequest
from espalier.server.engine_port import queue_full_errors

DOMAIN = "espalier.v1"


@dataclass(frozen=True)
class Violation:
    """One bad request field: ``field`` is a path into the request message."""

    field: str
    description: str
    reason: str = ""


class ServiceError(Exception):
    """An error raised by the server layer itself, already knowing its status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: str = "INTERNAL"

    def __init__(
        self,
        message: str,
        *,
        violations: Iterable[Violation] = (),
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.violations = tuple(violations)
        self.metadata = dict(metadata or {})


class InvalidRequestError(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"


class PromptTooLongError(InvalidRequestError):
    reason = "PROMPT_TOO_LONG"


class ResourceExhaustedError(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "QUEUE_FULL"


class NotReadyError(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE
    reason = "NOT_READY"


class DrainingError(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE
    reason = "DRAINING"


class RequestFailedError(ServiceError):
    """The engine finished the request with an error."""

    code = grpc.StatusCode.INTERNAL
    reason = "GENERATION_FAILED"


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed


def _status(
    code: grpc.StatusCode,
    message: str,
    reason: str,
    violations: Iterable[Violation] = (),
    metadata: Mapping[str, str] | None = None,
    retry_after_s: float | None = None,
) -> grpc.Status:
    details = [
        _pack(error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata or {}))
    ]
    field_violations = [
        error_details_pb2.BadRequest.FieldViolation(
            field=v.field, description=v.description, reason=v.reason
        )
        for v in violations
    ]
    if field_violations:
        details.append(_pack(error_details_pb2.BadRequest(field_violations=field_violations)))
    if retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(int(retry_after_s * 1000))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    status = status_pb2.Status(
        code=getattr(code_pb2, code.name), message=message[:4096], details=details
    )
    return rpc_status.to_status(status)


def grammar_field(kind: str) -> str:
    """The request field holding a constraint of this kind (``any_json`` has no text)."""
    return f"constraint.{kind if kind != 'choice' else 'choice.options'}"


def _grammar_violations(exc: GrammarError, field_prefix: str) -> list[Violation]:
    if isinstance(exc, SchemaNotEnforceableError):
        return [
            Violation(
                f"{field_prefix}constraint.json_schema#{issue.pointer}",
                f"keyword '{issue.keyword}' is {issue.support} by backend "
                f"'{issue.backend or exc.backend}'",
                reason=f"KEYWORD_{issue.support.upper()}",
            )
            for issue in exc.issues
        ]
    if isinstance(exc, InvalidGrammarError):
        where = ""
        if exc.pointer is not None:
            where = f"#{exc.pointer}"
        elif exc.line is not None:
            where = f":{exc.line}" + (f":{exc.column}" if exc.column is not None else "")
        return [Violation(f"{field_prefix}{grammar_field(exc.kind)}{where}", exc.detail)]
    if isinstance(exc, (UnsupportedGrammarError, UnknownBackendError, CompileMemoryError)):
        return [Violation(f"{field_prefix}constraint.backend", str(exc))]
    return []


def _grammar_metadata(exc: GrammarError) -> dict[str, str]:
    meta: dict[str, str] = {}
    if isinstance(exc, InvalidGrammarError):
        meta["kind"] = exc.kind
        if exc.line is not None:
            meta["line"] = str(exc.line)
        if exc.column is not None:
            meta["column"] = str(exc.column)
        if exc.pointer is not None:
            meta["pointer"] = exc.pointer
    elif isinstance(exc, (SchemaNotEnforceableError, UnsupportedGrammarError)):
        meta["backend"] = exc.backend
    elif isinstance(exc, CompileMemoryError):
        meta["backend"] = exc.backend
        meta["memory_limit_bytes"] = str(exc.limit_bytes)
    elif isinstance(exc, CompileTimeoutError):
        meta["timeout_seconds"] = f"{exc.seconds:g}"
    return meta


def to_grpc_status(exc: BaseException, field_prefix: str = "") -> grpc.Status:
    """The status (with details) a client receives for ``exc``.

    ``field_prefix`` is prepended to violation fields when the constraint sits inside a larger
    request message (``""`` for GenerateRequest and CompileGrammarRequest).
    """
    if isinstance(exc, EngineInvalidRequest):
        violations = [Violation(f"{field_prefix}{name}", why) for name, why in exc.violations]
        return _status(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "INVALID_ARGUMENT", violations)
    if isinstance(exc, ServiceError):
        retry = 1.0 if isinstance(exc, (ResourceExhaustedError, NotReadyError)) else None
        return _status(exc.code, exc.message, exc.reason, exc.violations, exc.metadata, retry)
    if isinstance(exc, CompileTimeoutError):
        return _status(
            grpc.StatusCode.DEADLINE_EXCEEDED, str(exc), exc.reason, (), _grammar_metadata(exc)
        )
    if isinstance(exc, GrammarError):
        return _status(
            grpc.StatusCode.INVALID_ARGUMENT,
            str(exc),
            exc.reason,
            _grammar_violations(exc, field_prefix),
            _grammar_metadata(exc),
        )
    if isinstance(exc, queue_full_errors()):
        return _status(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), "QUEUE_FULL", (), None, 1.0)
    return _status(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}", "INTERNAL")
