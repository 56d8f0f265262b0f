"""Blocking client. Every call takes ``timeout`` (seconds, the deadline); raises EspalierError."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

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

T = TypeVar("T")
_UNSET: Any = object()


class Client:
    """``Client("127.0.0.1:50051", token=..., root_certificates=...)``; a context manager."""

    def __init__(self, address: str, **settings: Any) -> None:
        self.settings = ChannelSettings(address, **settings)
        s = self.settings
        if s.secure:
            self._channel = grpc.secure_channel(address, s.credentials(), options=s.options())
        else:
            self._channel = grpc.insecure_channel(address, options=s.options())
        self._stub = pb_grpc.EspalierStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.settings.timeout_s if timeout is _UNSET else timeout

    def _call(self, fn: Callable[..., T], request: Any, timeout: Any) -> T:
        """Unary call with retries on UNAVAILABLE inside the overall deadline."""
        budget = self._timeout(timeout)
        deadline = None if budget is None else time.monotonic() + budget
        attempt = 0
        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                return fn(request, timeout=remaining, metadata=self.settings.metadata())
            except grpc.RpcError as exc:
                pause = self.settings.backoff(attempt)
                late = deadline is not None and time.monotonic() + pause >= deadline
                if not is_retryable(exc) or attempt >= self.settings.max_retries or late:
                    raise from_rpc_error(exc) from None
            time.sleep(pause)
            attempt += 1

    def generate(self, prompt: Prompt, *, timeout: Any = _UNSET, **kwargs: Any) -> Generation:
        """One generation (GenerateUnary). Keywords: see ``build_generate_request``."""
        request = build_generate_request(prompt, **kwargs)
        return Generation.from_proto(self._call(self._stub.GenerateUnary, request, timeout))

    def stream(self, prompt: Prompt, *, timeout: Any = _UNSET, **kwargs: Any) -> Iterator[Chunk]:
        """Stream chunks; closing the iterator early cancels the request on the server."""
        request = build_generate_request(prompt, **kwargs)
        budget = self._timeout(timeout)
        attempt = 0
        while True:
            call = self._stub.Generate(request, timeout=budget, metadata=self.settings.metadata())
            received = False
            try:
                for msg in call:
                    received = True
                    yield Chunk.from_proto(msg)
                return
            except grpc.RpcError as exc:
                retry = is_retryable(exc) and not received
                if not retry or attempt >= self.settings.max_retries:
                    raise from_rpc_error(exc) from None
            finally:
                call.cancel()  # no-op when finished; cancels on early close
            time.sleep(self.settings.backoff(attempt))
            attempt += 1

    def generate_json(
        self,
        schema_or_model: Any,
        prompt: Prompt,
        *,
        timeout: Any = _UNSET,
        **kwargs: Any,
    ) -> Any:
        """Generate under the schema (or the pydantic model's schema) and return the validated
        value: a model instance for a pydantic model, else the parsed JSON."""
        schema, model = schema_of(schema_or_model)
        result = self.generate(prompt, schema=schema, timeout=timeout, **kwargs)
        return parse_json_output(result.text, schema, model)

    def stream_json(
        self,
        schema_or_model: Any,
        prompt: Prompt,
        *,
        timeout: Any = _UNSET,
        **kwargs: Any,
    ) -> Iterator[Any]:
        """Stream a generation under the schema (or the pydantic model's schema), yielding the
        JSON value parsed so far each time it grows (``partial.PartialJson``); the last value
        yielded is the validated whole (a model instance for a pydantic model)."""
        from espalier_client.partial import partial_values

        schema, model = schema_of(schema_or_model)
        chunks = self.stream(prompt, schema=schema, timeout=timeout, **kwargs)
        yield from partial_values(chunks, schema, model)

    def compile_grammar(self, *, timeout: Any = _UNSET, **constraint: Any) -> CompileResult:
        """Validate and pre-compile a constraint (keywords of ``build_constraint``)."""
        built = build_constraint(**constraint)
        request = pb.CompileGrammarRequest(constraint=built)
        return CompileResult.from_proto(self._call(self._stub.CompileGrammar, request, timeout))

    def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self._call(self._stub.Tokenize, request, _UNSET).token_ids)

    def model_info(self) -> pb.ModelInfo:
        return self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), _UNSET)

    def health(self, service: str = "", *, timeout: Any = _UNSET) -> str:
        """``"SERVING"`` / ``"NOT_SERVING"`` (grpc.health.v1)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        reply = self._call(stub.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    def wait_ready(self, timeout: float = 300.0, poll_s: float = 0.2) -> None:
        """Block until health reports SERVING (bounded by ``timeout``)."""
        end = time.monotonic() + timeout
        while True:
            try:
                if self.health(timeout=min(5.0, max(end - time.monotonic(), 0.1))) == "SERVING":
                    return
            except Exception:
                if time.monotonic() >= end:
                    raise
            if time.monotonic() >= end:
                raise TimeoutError(f"server not SERVING after {timeout} s")
            time.sleep(poll_s)
