"""Optional bearer-token auth: a server interceptor checking ``authorization: Bearer <token>``."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc


def _reject(message: str) -> Callable[..., Awaitable[Any]]:
    async def abort(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return abort


def _rejecting_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that fails with UNAUTHENTICATED."""
    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_reject(message), **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_reject(message), **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_reject(message), **kwargs)
    return grpc.stream_stream_rpc_method_handler(_reject(message), **kwargs)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every call without the right token, except the methods in ``exempt``."""

    def __init__(self, token: str, exempt: tuple[str, ...] = ()) -> None:
        self._expected = f"Bearer {token}".encode()
        self._exempt = frozenset(exempt)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method in self._exempt:
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization")
        if given is None:
            return _rejecting_handler(handler, "missing 'authorization: Bearer <token>' metadata")
        given_bytes = given.encode() if isinstance(given, str) else bytes(given)
        if not hmac.compare_digest(given_bytes, self._expected):
            return _rejecting_handler(handler, "invalid bearer token")
        return handler
