"""SMG's vLLM worker protocol (``vllm.grpc.engine.VllmEngine``) over espalier's engine.

SMG (the gateway) speaks OpenAI to users and this protocol to workers: it renders chat
templates, tokenizes, builds the constraint for ``response_format`` and tool calls, and sends
token ids here. Generation goes through :class:`EspalierServicer` unchanged (validation,
admission limits, metrics, abort on disconnect), so a worker request and an ``espalier.v1``
request are one path; this module only translates messages.

Errors reach SMG as gRPC statuses (INVALID_ARGUMENT for a bad schema or a refused field), which
SMG turns into HTTP statuses (400) carrying the message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any, NoReturn, cast

import grpc
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2

from espalier.server.errors import NotReadyError, to_grpc_status
from espalier.server.service import EspalierServicer
from espalier.server.smg import convert
from espalier.server.smg.bundle import TokenizerBundle, build_bundle
from espalier.server.state import ServingState

SERVER_TYPE = "espalier-grpc"


class _WorkerContext:
    """The RPC's context as EspalierServicer sees it: a status it aborts with carries its field
    violations in the message too (SMG gives the HTTP client the message alone)."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort_with_status(self, status: grpc.Status) -> NoReturn:
        await self._context.abort_with_status(convert.spell_out(status))
        raise AssertionError("unreachable: abort_with_status raises")


class SmgWorkerServicer(vpb_grpc.VllmEngineServicer):
    """The worker side of SMG's vLLM protocol. Embed, KV events, profiling: UNIMPLEMENTED."""

    def __init__(self, state: ServingState, generation: EspalierServicer) -> None:
        self.state = state
        self.generation = generation
        self.started = time.time()
        self._in_flight: set[str] = set()
        self._bundle: asyncio.Task[TokenizerBundle] | None = None

    async def Generate(
        self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vpb.GenerateResponse]:
        try:
            ours = convert.to_espalier_request(request, self.state.config.reasoning_end)
        except Exception as exc:
            await context.abort_with_status(to_grpc_status(exc))
            raise  # unreachable: abort_with_status raises
        params = request.sampling_params
        state = convert.StreamState(
            prompt_tokens=len(request.tokenized.input_ids),
            want_logprobs=params.logprobs if params.HasField("logprobs") else None,
        )
        self._in_flight.add(request.request_id)
        try:
            worker_context = cast(grpc.aio.ServicerContext, _WorkerContext(context))
            async for chunk in self.generation.Generate(ours, worker_context):
                state.record(chunk)
                if request.stream:
                    yield convert.chunk_response(chunk, state)
                if chunk.finished:
                    context.set_trailing_metadata(convert.finish_metadata(chunk.finish_reason))
                    yield convert.complete_response(chunk, state, stream=request.stream)
        finally:
            self._in_flight.discard(request.request_id)

    async def Abort(
        self, request: vpb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> vpb.AbortResponse:
        engine = self.state.engine
        if engine is not None:
            # Only requests this servicer runs: an espalier.v1 caller's ids are not SMG's to stop.
            for request_id in request.request_ids:
                if request_id in self._in_flight:
                    result = engine.abort(request_id)
                    if asyncio.iscoroutine(result):
                        await result
        return vpb.AbortResponse()

    async def HealthCheck(
        self, request: vpb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> vpb.HealthCheckResponse:
        if self.state.draining:
            return vpb.HealthCheckResponse(healthy=False, message="draining")
        await self._require_loaded(context)
        if not self.state.serving:
            return vpb.HealthCheckResponse(healthy=False, message="the engine is restarting")
        return vpb.HealthCheckResponse(healthy=True, message="serving")

    async def _require_loaded(self, context: grpc.aio.ServicerContext) -> None:
        """UNAVAILABLE until the model is loaded. SMG registers a worker once its HealthCheck
        RPC answers at all (``healthy`` unread) and takes the model's name and tokenizer
        from GetModelInfo then, once: answered while loading, it kept a worker named
        ``unknown`` with no tokenizer for good. A failed call it retries until the worker's
        startup timeout."""
        try:
            self.state.require_loaded()
        except NotReadyError as exc:
            await context.abort_with_status(to_grpc_status(exc))

    async def GetModelInfo(
        self, request: vpb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> vpb.GetModelInfoResponse:
        await self._require_loaded(context)
        facts, tokenizer = self.state.facts, self.state.tokenizer
        hf = tokenizer.hf if tokenizer is not None else None
        return vpb.GetModelInfoResponse(
            model_path=facts.model,
            served_model_name=facts.model,
            is_generation=True,
            max_context_length=facts.max_context_tokens,
            vocab_size=facts.vocab_size or (tokenizer.vocab_size if tokenizer else 0),
            # Empty: SMG takes the tokenizer from GetTokenizer, never from a path of ours.
            tokenizer_path="",
            model_type=str(facts.extra.get("model_type", "")),
            eos_token_ids=list(tokenizer.stop_token_ids) if tokenizer else [],
            pad_token_id=(hf.pad_token_id or 0) if hf is not None else 0,
            bos_token_id=(hf.bos_token_id or 0) if hf is not None else 0,
            max_req_input_len=self.state.max_prompt_tokens(),
        )

    async def GetServerInfo(
        self, request: vpb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> vpb.GetServerInfoResponse:
        return vpb.GetServerInfoResponse(
            active_requests=self.state.active,
            is_paused=self.state.draining,
            uptime_seconds=time.time() - self.started,
            server_type=SERVER_TYPE,
            data_parallel_size=1,
            model_dtype=self.state.facts.dtype,
            constrained_decoding_start=convert.constrained_decoding_start(
                self.state.config.reasoning_end
            ),
        )

    async def GetLoads(
        self, request: vpb.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> vpb.GetLoadsResponse:
        engine = self.state.engine
        stats = dict(engine.stats()) if engine is not None else {}
        running = int(stats.get("running", 0))
        waiting = int(stats.get("waiting", 0)) + int(stats.get("compiling", 0))
        total_blocks = int(stats.get("total_blocks", 0))
        used = total_blocks - int(stats.get("free_blocks", total_blocks))
        load = vpb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            num_total_reqs=running + waiting,
            token_usage=used / total_blocks if total_blocks else 0.0,
        )
        return vpb.GetLoadsResponse(
            timestamp=datetime.now(timezone.utc).isoformat(),
            version=SERVER_TYPE,
            dp_rank_count=1,
            loads=[load],
        )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        try:
            tokenizer = self.state.require_tokenizer()
            if self._bundle is None or (self._bundle.done() and self._bundle.exception()):
                self._bundle = asyncio.ensure_future(
                    asyncio.to_thread(build_bundle, tokenizer.hf, tokenizer.stop_token_ids)
                )
            bundle = await asyncio.shield(self._bundle)
        except Exception as exc:
            await context.abort_with_status(to_grpc_status(exc))
            raise  # unreachable: abort_with_status raises
        for data, sha256 in bundle.chunks():
            yield common_pb2.GetTokenizerChunk(data=data, sha256=sha256)
