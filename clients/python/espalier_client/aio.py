"""Asyncio client (grpc.aio); the same surface as :class:`espalier_client.Client`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from espalier_client._proto import espalier_pb2 as pb
from espalier_client._proto import espalier_pb2_grpc as pb_grpc
from espalier_client.channel import ChannelSettings, is_retryable
from espalier_client.errors import from_rpc_error
from espalier_client.request import (
    Prompt,
    build_constraint,
    build_generate_request,
    parse_json_output,
    schema_of,
)
from espalier_client.types import Chunk, CompileResult, Generation

_UNSET: Any = object()


class AsyncClient:
    """``async with AsyncClient("127.0.0.1:50051") as client: ...``"""

    def __init__(self, address: str, **settings: Any) -> None:
        self.settings = ChannelSettings(address, **settings)
        s = self.settings
        if s.secure:
            self._channel = grpc.aio.secure_channel(address, s.credentials(), options=s.options())
        else:
            self._channel = grpc.aio.insecure_channel(address, options=s.options())
        self._stub = pb_grpc.EspalierStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, fn: Any, request: Any, timeout: Any) -> Any:
        budget = self.settings.timeout_s if timeout is _UNSET else timeout
        deadline = None if budget is None else time.monotonic() + budget
        attempt = 0
        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                return await fn(request, timeout=remaining, metadata=self.settings.metadata())
            except grpc.RpcError as exc:
                pause = self.settings.backoff(attempt)
                late = deadline is not None and time.monotonic() + pause >= deadline
                if not is_retryable(exc) or attempt >= self.settings.max_retries or late:
                    raise from_rpc_error(exc) from None
            await asyncio.sleep(pause)
            attempt += 1

    async def generate(self, prompt: Prompt, *, timeout: Any = _UNSET, **kwargs: Any) -> Generation:
        request = build_generate_request(prompt, **kwargs)
        return Generation.from_proto(await self._call(self._stub.GenerateUnary, request, timeout))

    async def stream(
        self, prompt: Prompt, *, timeout: Any = _UNSET, **kwargs: Any
    ) -> AsyncIterator[Chunk]:
        """Stream chunks; leaving the loop early (or cancelling the task) cancels the request."""
        request = build_generate_request(prompt, **kwargs)
        budget = self.settings.timeout_s if timeout is _UNSET else timeout
        attempt = 0
        while True:
            call = self._stub.Generate(request, timeout=budget, metadata=self.settings.metadata())
            received = False
            try:
                async for msg in call:
                    received = True
                    yield Chunk.from_proto(msg)
                return
            except grpc.RpcError as exc:
                if not (is_retryable(exc) and not received) or attempt >= self.settings.max_retries:
                    raise from_rpc_error(exc) from None
            finally:
                call.cancel()
            await asyncio.sleep(self.settings.backoff(attempt))
            attempt += 1

    async def generate_json(
        self,
        schema_or_model: Any,
        prompt: Prompt,
        *,
        timeout: Any = _UNSET,
        **kwargs: Any,
    ) -> Any:
        schema, model = schema_of(schema_or_model)
        result = await self.generate(prompt, schema=schema, timeout=timeout, **kwargs)
        return parse_json_output(result.text, schema, model)

    async def stream_json(
        self,
        schema_or_model: Any,
        prompt: Prompt,
        *,
        timeout: Any = _UNSET,
        **kwargs: Any,
    ) -> AsyncIterator[Any]:
        """:meth:`Client.stream_json` for asyncio."""
        from espalier_client.partial import apartial_values

        schema, model = schema_of(schema_or_model)
        chunks = self.stream(prompt, schema=schema, timeout=timeout, **kwargs)
        async for value in apartial_values(chunks, schema, model):
            yield value

    async def compile_grammar(self, *, timeout: Any = _UNSET, **constraint: Any) -> CompileResult:
        request = pb.CompileGrammarRequest(constraint=build_constraint(**constraint))
        return CompileResult.from_proto(
            await self._call(self._stub.CompileGrammar, request, timeout)
        )

    async def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list((await self._call(self._stub.Tokenize, request, _UNSET)).token_ids)

    async def model_info(self) -> pb.ModelInfo:
        return await self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), _UNSET)

    async def health(self, service: str = "", *, timeout: Any = _UNSET) -> str:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        request = health_pb2.HealthCheckRequest(service=service)
        reply = await self._call(stub.Check, request, timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
