"""Exceptions → gRPC statuses with ``google.rpc`` details. The one place that decides status codes.

| error                                   | code               | ErrorInfo.reason        |
| --------------------------------------- | ------------------ | ----------------------- |
| invalid request field                   | INVALID_ARGUMENT   | INVALID_ARGUMENT        |
| prompt over the token or byte limit     | INVALID_ARGUMENT   | PROMPT_TOO_LONG         |
| request bytes do not decode             | INVALID_ARGUMENT   | MALFORMED_REQUEST       |
| grammar over the byte limit / malformed | INVALID_ARGUMENT   | INVALID_GRAMMAR         |
| schema not enforceable (strict mode)    | INVALID_ARGUMENT   | SCHEMA_NOT_ENFORCEABLE  |
| backend unknown / kind unsupported      | INVALID_ARGUMENT   | UNKNOWN_BACKEND, ...    |
| grammar masks too slow to keep batched  | INVALID_ARGUMENT   | GRAMMAR_TOO_COSTLY      |
| grammar compile time limit              | DEADLINE_EXCEEDED  | COMPILE_TIMEOUT         |
| queue or concurrency limit              | RESOURCE_EXHAUSTED | QUEUE_FULL (+RetryInfo) |
| model loading / server draining         | UNAVAILABLE        | NOT_READY / DRAINING    |
| anything else                           | INTERNAL           | INTERNAL                |

Compile timeout is DEADLINE_EXCEEDED, not INVALID_ARGUMENT: the grammar was not shown to be wrong,
only slower to compile than the server's limit allows (a loaded server, or a compile that finishes
in the background and lands in the cache). Its ErrorInfo reason tells it apart from the caller's own
deadline. Clients must not retry it blindly (only UNAVAILABLE is retried by our SDKs).

A grammar whose masks grew too slow (``GrammarCostError``) is INVALID_ARGUMENT, not
RESOURCE_EXHAUSTED: the same request costs the same again, and gateways retry
RESOURCE_EXHAUSTED (SMG sent one such request five times, slowing every other stream for 30 s).

Every BadRequest field violation names a request field (``sampling.top_p``); grammar locations add
a JSON pointer after ``#`` (``constraint.json_schema#/properties/age``) or ``:line:column``.
User errors never become UNKNOWN. Details are bounded (the first violations that fit, the rest
counted in ErrorInfo ``more_violations``) so the trailer fits grpc's default 8 KiB metadata limit.
"""

from __future__ import annotations

import logging
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

DOMAIN = "espalier.v1"

log = logging.getLogger(__name__)


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


class MalformedRequestError(InvalidRequestError):
    """The request bytes did not decode (invalid UTF-8 in a string, a broken message)."""

    reason = "MALFORMED_REQUEST"


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


MAX_MESSAGE_BYTES = 1024
"""The status message, percent-encoded as grpc sends it (non-ASCII bytes take 3)."""
DETAILS_BUDGET_BYTES = 3072
"""The serialized google.rpc.Status; grpc sends it base64 (4/3), so message and details stay
near 5.5 KiB, under grpc's default 8 KiB limit on all response metadata."""
MAX_FIELD_CHARS = 200
MAX_DESCRIPTION_CHARS = 300
MAX_METADATA_CHARS = 200


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fit_message(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """``message`` cut so that grpc's percent-encoding of it stays within ``limit`` bytes."""
    size = 0
    for i, char in enumerate(message):
        size += 1 if " " <= char <= "~" and char != "%" else 3 * len(char.encode("utf-8"))
        if size > limit - 3:
            return message[:i] + "..."
    return message


def _capped_violations(
    violations: Iterable[Violation], budget: int
) -> tuple[list[error_details_pb2.BadRequest.FieldViolation], int]:
    """The first violations whose BadRequest fits ``budget`` bytes, and how many were left out."""
    all_violations = list(violations)
    kept: list[error_details_pb2.BadRequest.FieldViolation] = []
    size = 0
    for v in all_violations:
        fv = error_details_pb2.BadRequest.FieldViolation(
            field=_truncate(v.field, MAX_FIELD_CHARS),
            description=_truncate(v.description, MAX_DESCRIPTION_CHARS),
            reason=_truncate(v.reason, MAX_METADATA_CHARS),
        )
        size += fv.ByteSize() + 4  # the repeated field's tag and length
        if size > budget:
            break
        kept.append(fv)
    return kept, len(all_violations) - len(kept)


def _status(
    code: grpc.StatusCode,
    message: str,
    reason: str,
    violations: Iterable[Violation] = (),
    metadata: Mapping[str, str] | None = None,
    retry_after_s: float | None = None,
) -> grpc.Status:
    """The status with its details, bounded: the first field violations that fit the budget
    (ErrorInfo metadata ``more_violations`` counts the rest), long texts truncated."""
    meta = {k: _truncate(v, MAX_METADATA_CHARS) for k, v in (metadata or {}).items()}
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=meta)
    message = _fit_message(message, MAX_MESSAGE_BYTES - 64)  # room for the omitted count
    budget = DETAILS_BUDGET_BYTES - info.ByteSize() - len(message.encode("utf-8")) - 64
    field_violations, omitted = _capped_violations(violations, budget)
    if omitted:
        info.metadata["more_violations"] = str(omitted)
        message = f"{message} (and {omitted} more field violations)"
    details = [_pack(info)]
    if field_violations:
        details.append(_pack(error_details_pb2.BadRequest(field_violations=field_violations)))
    if retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(int(retry_after_s * 1000))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=details)
    return rpc_status.to_status(status)


def grammar_field(kind: str) -> str:
    """The request field holding a constraint of this kind (``any_json`` has no text)."""
    return f"constraint.{kind if kind != 'choice' else 'choice.options'}"


def _grammar_violations(exc: GrammarError, field_prefix: str) -> list[Violation]:
    if isinstance(exc, SchemaNotEnforceableError):
        return [
            Violation(
                # a schema inside a structural tag has its pointer from the tag's root
                f"{field_prefix}constraint."
                f"{'structural_tag' if issue.pointer.startswith('/format/') else 'json_schema'}"
                f"#{issue.pointer}",
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
    # the grammar as a whole (a backend's limit met while generating: no place to name)
    return [Violation(f"{field_prefix}constraint", str(exc))]


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
    # not the caller's mistake: the client gets the type only, the operator the traceback
    log.error("internal error: %s", type(exc).__name__, exc_info=exc)
    return _status(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}", "INTERNAL")
