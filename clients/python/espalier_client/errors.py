"""Typed exceptions carrying the server's ``google.rpc`` status details."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


@dataclass(frozen=True)
class FieldViolation:
    """One bad request field; grammar locations follow ``#`` (JSON pointer) or ``:line:col``."""

    field: str
    description: str
    reason: str = ""


@dataclass
class EspalierError(Exception):
    """A failed call. ``reason`` and ``metadata`` come from the status' ErrorInfo."""

    code: grpc.StatusCode
    message: str
    reason: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    field_violations: tuple[FieldViolation, ...] = ()
    retry_delay_s: float | None = None

    def __str__(self) -> str:
        where = "".join(f"\n  {v.field}: {v.description}" for v in self.field_violations)
        reason = f" [{self.reason}]" if self.reason else ""
        return f"{self.code.name}{reason}: {self.message}{where}"


class InvalidArgumentError(EspalierError):
    """Bad grammar, schema not enforceable in strict mode, oversize input, invalid parameters."""


class ResourceExhaustedError(EspalierError):
    """The server's queue or concurrency limit; retry after ``retry_delay_s``."""


class DeadlineExceededError(EspalierError):
    """The call's deadline passed (or, with reason COMPILE_TIMEOUT, the server's compile limit)."""


class UnavailableError(EspalierError):
    """The server is loading, draining or unreachable (retried automatically)."""


class UnauthenticatedError(EspalierError):
    """Missing or wrong bearer token."""


class CancelledError(EspalierError):
    """The call was cancelled."""


class InternalError(EspalierError):
    """A server-side failure."""


class OutputValidationError(Exception):
    """The generated text does not validate against the requested schema or model."""

    def __init__(self, message: str, text: str) -> None:
        super().__init__(message)
        self.text = text


_BY_CODE: dict[grpc.StatusCode, type[EspalierError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.INTERNAL: InternalError,
}


def from_status(
    code: grpc.StatusCode, message: str, details_status: object | None
) -> EspalierError:
    """Build the typed error from a code, message and an optional ``google.rpc.Status``."""
    reason = ""
    metadata: dict[str, str] = {}
    violations: list[FieldViolation] = []
    retry: float | None = None
    for detail in getattr(details_status, "details", ()):
        info = error_details_pb2.ErrorInfo()
        bad = error_details_pb2.BadRequest()
        retry_info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            reason, metadata = info.reason, dict(info.metadata)
        elif detail.Unpack(bad):
            violations.extend(
                FieldViolation(v.field, v.description, v.reason) for v in bad.field_violations
            )
        elif detail.Unpack(retry_info):
            retry = retry_info.retry_delay.ToMilliseconds() / 1000.0
    cls = _BY_CODE.get(code, EspalierError)
    return cls(code, message, reason, metadata, tuple(violations), retry)


def from_rpc_error(error: grpc.RpcError) -> EspalierError:
    """The typed error for a failed sync or async call."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = error.details() if hasattr(error, "details") else str(error)
    status = None
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except (AttributeError, ValueError, TypeError):
        status = None
    return from_status(code, message or "", status)
