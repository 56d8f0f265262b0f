"""The ``espalier.v1.Espalier`` servicer (grpc.aio) over the async engine.

A client cancel, a disconnect or an expired deadline cancels the handler task; the ``finally``
below then aborts the engine request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from espalier.engine.api import FinishReason, GenerationRequest, RequestOutput
from espalier.server import convert
from espalier.server.access_log import log_request
from espalier.server.chat import chat_error, forced_choice, parse_tool_calls
from espalier.server.engine_port import ServingEngine
from espalier.server.errors import (
    InvalidRequestError,
    PromptTooLongError,
    RequestFailedError,
    ResourceExhaustedError,
    Violation,
    to_grpc_status,
)
from espalier.server.state import ServingState
from espalier.v1 import espalier_pb2 as pb
from espalier.v1 import espalier_pb2_grpc as pb_grpc

T = TypeVar("T")


async def _maybe_await(value: Any) -> None:
    if inspect.isawaitable(value):
        await value


# The client's deadline fires before the server's copy of it (the server starts its clock when it
# reads the headers) and both ends then see the same HTTP/2 cancel: a cancel this close to the
# server's deadline is the client's deadline passing.
DEADLINE_SLACK_S = 0.5


def _ended_code(context: grpc.aio.ServicerContext) -> str:
    """The status of an RPC cut short without an error: DEADLINE_EXCEEDED when it ended within
    ``DEADLINE_SLACK_S`` of its deadline, else CANCELLED (the client went away)."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= DEADLINE_SLACK_S:
        return "DEADLINE_EXCEEDED"
    return "CANCELLED"


@dataclass
class _Progress:
    """How far one generation RPC got."""

    start: float
    request_id: str = ""
    admitted: bool = False  # counted against the concurrency limit
    received: bool = False  # the engine produced output: it accepted the request
    finished: bool = False
    first_at: float | None = None
    last_at: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class EspalierServicer(pb_grpc.EspalierServicer):
    """Parsing, schema checks and tokenization of a request run on a small thread pool of
    their own (``admission_threads``): never on the event loop, never behind compiles."""

    def __init__(self, state: ServingState) -> None:
        self.state = state
        self._admitting = 0  # requests waiting for or inside admission
        self._admission = ThreadPoolExecutor(
            max_workers=state.config.admission_threads, thread_name_prefix="espalier-admission"
        )

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._admission, fn, *args)

    # -- generation -------------------------------------------------------------------------

    def _limits(self) -> convert.RequestLimits:
        cfg = self.state.config
        tokenizer = self.state.tokenizer
        vocab = self.state.facts.vocab_size or (tokenizer.vocab_size if tokenizer else 1 << 31)
        loaded = frozenset(self.state.facts.speculative_methods)
        return convert.RequestLimits(
            vocab_size=vocab,
            max_prompt_tokens=self.state.max_prompt_tokens(),
            max_grammar_bytes=cfg.max_grammar_bytes,
            default_max_tokens=cfg.default_max_tokens,
            max_max_tokens=cfg.max_max_tokens,
            max_prompt_bytes=cfg.max_prompt_bytes,
            max_stop_bytes=cfg.max_stop_bytes,
            max_choices=cfg.max_choices,
            max_grammar_alternatives=cfg.max_grammar_alternatives,
            max_schema_depth=cfg.max_schema_depth,
            speculative_methods=loaded if self.state.engine is not None else None,
            reasoning_end=cfg.reasoning_end,
        )

    def _count_tokens(self, text: str) -> int:
        tokenizer = self.state.tokenizer
        if tokenizer is None:
            return 0
        # Every token holds at least one byte: short prompts need no tokenizing to pass the limit.
        n_bytes = len(text.encode("utf-8"))
        if n_bytes <= self.state.max_prompt_tokens():
            return n_bytes
        return len(tokenizer.encode(text))

    def _render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        tokenizer = self.state.tokenizer
        if tokenizer is None or not getattr(tokenizer.hf, "chat_template", None):
            raise InvalidRequestError(
                "this model has no chat template; send a text prompt",
                violations=[Violation("chat", "the model has no chat template")],
            )
        try:  # transformers renders in a sandboxed Jinja environment
            text = tokenizer.hf.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # template errors (raise_exception, bad roles): the caller's
            raise chat_error(exc) from exc
        return tokenizer.encode(str(text))

    async def _run(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, method: str
    ) -> AsyncIterator[pb.GenerateResponse]:
        state, metrics = self.state, self.state.metrics
        progress = _Progress(time.monotonic())
        code: str | None = None
        engine: ServingEngine | None = None
        stream: AsyncIterator[RequestOutput] | None = None
        try:
            gen_request = await self._admit_request(request)
            engine = state.require_engine()
            progress.request_id = gen_request.request_id
            state.admit()
            progress.admitted = True
            stream = engine.generate(gen_request)
            choice, text = forced_choice(request), []
            async for out in stream:
                self._observe_chunk(out, progress)
                response = convert.output_to_proto(out)
                if choice:
                    text.append(response.text)
                    if out.finished:
                        calls = parse_tool_calls(choice, "".join(text), gen_request.request_id)
                        response.tool_calls.extend(calls)
                yield response
                if out.finished:
                    break
            code = "OK"
        except Exception as exc:
            status = to_grpc_status(exc)
            code = status.code.name
            await context.abort_with_status(status)
        finally:
            # No code yet: cancelled, its deadline passed, or the client went away mid-stream.
            code = code or _ended_code(context)
            # Counted before the release: a scrape that sees the server idle sees this RPC counted.
            metrics.requests.labels(method, code).inc()
            await self._release(engine, stream, progress)
            seconds = time.monotonic() - progress.start
            metrics.latency.observe(seconds)
            log_request(
                method,
                progress.request_id or request.request_id,
                code,
                progress.prompt_tokens,
                progress.completion_tokens,
                seconds,
            )

    async def _admit_request(self, request: pb.GenerateRequest) -> GenerationRequest:
        """Validate, parse and measure ``request`` on the admission pool; at most ``max_queue``
        requests wait for it (beyond: RESOURCE_EXHAUSTED, like a full engine queue)."""
        limit = self.state.config.max_queue
        if self._admitting >= limit:
            raise ResourceExhaustedError(
                f"{self._admitting} requests are being admitted, the limit is {limit}",
                metadata={"limit": str(limit), "kind": "admission"},
            )
        self._admitting += 1
        try:
            return await self._off_loop(
                convert.request_from_proto,
                request,
                self._limits(),
                self._count_tokens,
                self._render_chat,
            )
        finally:
            self._admitting -= 1

    def _observe_chunk(self, out: RequestOutput, progress: _Progress) -> None:
        """Account one engine output; raises on a failed last chunk (typed when possible)."""
        progress.received = True
        progress.completion_tokens += len(out.token_ids)
        now = time.monotonic()
        if out.token_ids:
            if progress.first_at is None:
                progress.first_at = now
                self.state.first_token()
                self.state.metrics.ttft.observe(now - progress.start)
            progress.last_at = now
        if not out.finished:
            return
        progress.finished = True
        if out.finish_reason is FinishReason.ABORT:  # stopped in the engine (SMG's Abort RPC)
            self.state.metrics.aborted.inc()
        if out.usage is not None:
            progress.prompt_tokens = out.usage.prompt_tokens
            progress.completion_tokens = out.usage.completion_tokens
        self._observe_final(out, progress.first_at or now, progress.last_at or now)
        if out.finish_reason is FinishReason.ERROR:
            if isinstance(out.exception, Exception):
                raise out.exception  # typed (grammar errors): mapped to a status by the caller
            raise RequestFailedError(out.error or "generation failed")

    async def _release(
        self,
        engine: ServingEngine | None,
        stream: AsyncIterator[RequestOutput] | None,
        progress: _Progress,
    ) -> None:
        """Close the engine stream; abort a request cut short (cancel, deadline, error)."""
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()  # the engine aborts an unfinished request when its stream closes
        if not progress.admitted:
            return
        if progress.received and not progress.finished and engine is not None:
            # Only a request the engine accepted (it produced output) is ours to abort: a refused
            # one may share its id with another caller's request in flight.
            self.state.metrics.aborted.inc()
            await _maybe_await(engine.abort(progress.request_id))
        self.state.release(progress.first_at is not None)

    def _observe_final(self, out: RequestOutput, first_at: float, last_at: float) -> None:
        metrics = self.state.metrics
        if out.usage is not None:
            metrics.prompt_tokens.inc(out.usage.prompt_tokens)
            metrics.generated_tokens.inc(out.usage.completion_tokens)
            if out.usage.completion_tokens > 1:
                metrics.tpot.observe((last_at - first_at) / (out.usage.completion_tokens - 1))
        if out.timings is not None:
            if out.backend:
                metrics.grammar_wait.observe(out.timings.compile_s)
            if out.backend:
                metrics.mask_time.observe(out.timings.mask_s)
        if out.speculative is not None and out.speculative.steps:
            metrics.accept_length.observe(out.speculative.mean_accept_length)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        async for chunk in self._run(request, context, "Generate"):
            yield chunk

    async def GenerateUnary(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        chunks = [chunk async for chunk in self._run(request, context, "GenerateUnary")]
        return convert.merge_unary(chunks)

    # -- grammar, tokenizer, model ---------------------------------------------------------

    async def CompileGrammar(
        self, request: pb.CompileGrammarRequest, context: grpc.aio.ServicerContext
    ) -> pb.CompileGrammarResponse:
        metrics = self.state.metrics
        try:
            spec, options = await self._off_loop(
                convert.constraint_to_spec, request.constraint, self._limits()
            )
            if spec is None:
                raise InvalidRequestError(
                    "set one constraint kind",
                    violations=[convert.Violation("constraint", "no constraint kind is set")],
                )
            compiler = self.state.compiler
            if compiler is None:
                self.state.require_tokenizer()
                raise RequestFailedError("no grammar compiler is configured")
            # The compiler applies the time limit itself (CompileTimeoutError); a caller that
            # leaves withdraws its compile (one nobody else waits for stops).
            left = threading.Event()
            try:
                report = await asyncio.to_thread(compiler, spec, options, left)
            except asyncio.CancelledError:
                left.set()
                raise
        except Exception as exc:
            status = to_grpc_status(exc)
            metrics.requests.labels("CompileGrammar", status.code.name).inc()
            await context.abort_with_status(status)
            raise  # unreachable: abort_with_status raises
        if not report.cache_hit:
            metrics.compile_time.observe(report.compile_seconds)
        metrics.requests.labels("CompileGrammar", "OK").inc()
        return convert.compile_report_to_proto(report)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        try:
            tokenizer = self.state.require_tokenizer()
            n_bytes = len(request.text.encode("utf-8"))
            limit = self.state.config.max_prompt_bytes
            if n_bytes > limit:
                raise PromptTooLongError(
                    f"the text is {n_bytes} bytes, over the limit of {limit}",
                    violations=[Violation("text", f"over {limit} bytes", "TOO_LONG")],
                    metadata={"limit_bytes": str(limit), "bytes": str(n_bytes)},
                )

            def encode() -> pb.TokenizeResponse:
                ids: list[int] = tokenizer.hf.encode(
                    request.text, add_special_tokens=request.add_special_tokens
                )
                tokens = [tokenizer.decode([i]) for i in ids]
                return pb.TokenizeResponse(token_ids=ids, tokens=tokens)

            reply = await self._off_loop(encode)
            size, cap = reply.ByteSize(), self.state.config.max_message_bytes
            if size > cap:  # ids and token strings: about 2.3 times the text
                raise PromptTooLongError(
                    f"the reply would be {size} bytes, over the message limit of {cap} "
                    f"(--max-message-mb); tokenize the text in parts",
                    violations=[Violation("text", f"its reply is over {cap} bytes", "TOO_LONG")],
                    metadata={"limit_bytes": str(cap), "reply_bytes": str(size)},
                )
            return reply
        except Exception as exc:
            await context.abort_with_status(to_grpc_status(exc))
            raise

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        cfg, facts, tokenizer = self.state.config, self.state.facts, self.state.tokenizer
        return pb.ModelInfo(
            model=facts.model,
            tokenizer=tokenizer.name if tokenizer else "",
            vocab_size=facts.vocab_size or (tokenizer.vocab_size if tokenizer else 0),
            tokenizer_vocab_size=tokenizer.tokenizer_vocab_size if tokenizer else 0,
            max_context_tokens=facts.max_context_tokens,
            stop_token_ids=list(tokenizer.stop_token_ids) if tokenizer else [],
            grammar_backends=list(facts.grammar_backends),
            speculative_methods=list(facts.speculative_methods),
            device=facts.device,
            dtype=facts.dtype,
            max_prompt_tokens=self.state.max_prompt_tokens(),
            max_grammar_bytes=cfg.max_grammar_bytes,
            default_max_tokens=cfg.default_max_tokens,
            ready=self.state.serving,
            reasoning_end=cfg.reasoning_end,
        )
