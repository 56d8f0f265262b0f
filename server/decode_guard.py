"""Register a servicer so that an undecodable request is INVALID_ARGUMENT.

grpc decodes a request before any handler runs; with the generated registration a message that
does not parse (invalid UTF-8 in a string field, a truncated or malformed message) ends as
UNKNOWN or INTERNAL. Here each method's deserializer returns an :class:`Undecodable` marker instead
of raising, and the method answers it with INVALID_ARGUMENT (reason ``MALFORMED_REQUEST``).
Used for the ``espalier.v1`` service and for SMG's worker service (``server/smg/server.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor

from espalier.server.errors import MalformedRequestError, Violation, to_grpc_status
from espalier.v1 import espalier_pb2

SERVICE = espalier_pb2.DESCRIPTOR.services_by_name["Espalier"]


@dataclass(frozen=True)
class Undecodable:
    """A request body that did not decode as its message type; ``error``: the parser's words."""

    error: str


def _deserializer(cls: Any) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except Exception as exc:  # DecodeError and friends: whatever the parser raises
            return Undecodable(f"{type(exc).__name__}: {exc}"[:300])

    return decode


def _refusal(method: str, bad: Undecodable) -> grpc.Status:
    exc = MalformedRequestError(
        f"the {method} request could not be decoded ({bad.error}); strings must be valid UTF-8",
        violations=[Violation("request", "not a valid protobuf message", "MALFORMED_REQUEST")],
    )
    return to_grpc_status(exc)


def add_guarded_servicer(
    servicer: Any,
    server: grpc.aio.Server,
    refused: Callable[[str], None] | None = None,
    service: ServiceDescriptor = SERVICE,
) -> None:
    """``add_<Service>Servicer_to_server`` for ``service`` (default: ``espalier.v1.Espalier``)
    with guarded deserializers; ``refused(method)`` is called for each undecodable request
    (metrics). Methods the servicer does not implement as coroutines or async generators (the
    generated base class's UNIMPLEMENTED stubs) are registered as the generated code does."""
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        behavior = getattr(servicer, method.name)
        factory = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        implemented = inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)
        if implemented:
            make = _stream if method.server_streaming else _unary
            handler, decode = make(method.name, behavior, refused), _deserializer(request_cls)
        else:
            handler, decode = behavior, request_cls.FromString
        handlers[method.name] = factory(
            handler, request_deserializer=decode, response_serializer=response_cls.SerializeToString
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)


def _unary(name: str, behavior: Any, refused: Callable[[str], None] | None) -> Any:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            if refused is not None:
                refused(name)
            await context.abort_with_status(_refusal(name, request))
        return await behavior(request, context)

    return handle


def _stream(name: str, behavior: Any, refused: Callable[[str], None] | None) -> Any:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            if refused is not None:
                refused(name)
            await context.abort_with_status(_refusal(name, request))
        async for item in behavior(request, context):
            yield item

    return handle
