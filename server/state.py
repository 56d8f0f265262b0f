"""The server's lifecycle state: tokenizer, engine slot, health, draining, admission counters."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpc_health.v1 import health, health_pb2

from espalier.server.config import ServerConfig
from espalier.server.engine_port import ServingEngine
from espalier.server.errors import DrainingError, NotReadyError, ResourceExhaustedError
from espalier.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from espalier.constrained.base import CompileReport
    from espalier.constrained.spec import GrammarSpec
    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.engine.api import ConstraintOptions

SERVICE_NAME = "espalier.v1.Espalier"


def announce(**fields: object) -> None:
    """One JSON line on stdout: how a parent process (tests, demo.sh) learns ports and phases."""
    print(json.dumps(fields), flush=True)


Compiler = Callable[["GrammarSpec", "ConstraintOptions", "threading.Event"], "CompileReport"]
"""CompileGrammar's compile, blocking (run off the event loop): the spec, its options, and an
event the caller sets when it leaves (cancel, deadline), on which the compile is withdrawn and
the call raises ``concurrent.futures.CancelledError``."""


@dataclass
class ModelFacts:
    """What GetModelInfo reports about the loaded model."""

    model: str = ""
    vocab_size: int = 0
    max_context_tokens: int = 0
    device: str = "cpu"
    dtype: str = ""
    grammar_backends: tuple[str, ...] = ()
    speculative_methods: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


class ServingState:
    """Shared by the servicer, the health service and the lifecycle (serve / shutdown).

    Health is NOT_SERVING until :meth:`set_ready` (model loaded and warm), SERVING after (but
    NOT_SERVING while a dead engine is replaced), and NOT_SERVING again from :meth:`begin_drain`
    on.
    """

    def __init__(
        self,
        config: ServerConfig,
        *,
        tokenizer: TokenizerInfo | None = None,
        compiler: Compiler | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.compiler = compiler
        self.engine: ServingEngine | None = None
        self.facts = ModelFacts()
        self.metrics = ServerMetrics()
        self.health = health.aio.HealthServicer()
        self.draining = False
        self.serving = False  # health is SERVING
        self.active = 0  # generations admitted and not yet finished
        self.waiting = 0  # admitted generations that have not emitted their first token
        self.idle = asyncio.Event()
        self.idle.set()
        self.failed = asyncio.Event()  # the engine died: drain what is left and exit non-zero

    async def init_health(self) -> None:
        await self.set_serving(False)

    async def set_ready(self, engine: ServingEngine, facts: ModelFacts) -> None:
        self.engine = engine
        self.facts = facts
        self.metrics.bind_engine(engine.stats)
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        """Health SERVING (never while draining) or NOT_SERVING (an engine being replaced)."""
        self.serving = serving and not self.draining
        status = health_pb2.HealthCheckResponse.NOT_SERVING
        if self.serving:
            status = health_pb2.HealthCheckResponse.SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def begin_drain(self) -> None:
        self.draining = True
        await self.set_serving(False)

    async def fail(self, why: str) -> None:
        """The engine is gone: health NOT_SERVING, refuse new generations, stop serving."""
        announce(event="engine_failed", error=why)
        await self.begin_drain()
        self.failed.set()

    def max_prompt_tokens(self) -> int:
        """The longest prompt taken: ``--max-prompt-tokens``, and below the model's context (the
        engine keeps room for one generated token), so every place that states the limit
        (ModelInfo, SMG's ``max_req_input_len``, the refusal) states the one enforced."""
        limit = self.config.max_prompt_tokens
        context = self.facts.max_context_tokens
        return min(limit, context - 1) if context > 0 else limit

    def require_tokenizer(self) -> TokenizerInfo:
        if self.tokenizer is None:
            raise NotReadyError("the tokenizer is still loading", metadata={"phase": "loading"})
        return self.tokenizer

    def require_engine(self) -> ServingEngine:
        if self.draining:
            raise DrainingError("the server is shutting down")
        return self.require_loaded()

    def require_loaded(self) -> ServingEngine:
        """The engine once the model is loaded (draining or not); NOT_READY before."""
        if self.engine is None:
            raise NotReadyError("the model is still loading", metadata={"phase": "loading"})
        return self.engine

    def admit(self) -> None:
        """Count one more generation; raises RESOURCE_EXHAUSTED beyond the limits."""
        cfg = self.config
        if self.active >= cfg.max_concurrent_requests:
            raise ResourceExhaustedError(
                f"{self.active} requests in flight, the limit is {cfg.max_concurrent_requests}",
                metadata={"limit": str(cfg.max_concurrent_requests), "kind": "concurrent"},
            )
        if self.waiting >= cfg.max_queue:
            raise ResourceExhaustedError(
                f"{self.waiting} requests queued, the limit is {cfg.max_queue}",
                metadata={"limit": str(cfg.max_queue), "kind": "queue"},
            )
        self.active += 1
        self.waiting += 1
        self.idle.clear()
        self.metrics.active.set(self.active)

    def first_token(self) -> None:
        self.waiting -= 1

    def release(self, got_first_token: bool) -> None:
        self.active -= 1
        if not got_first_token:
            self.waiting -= 1
        self.metrics.active.set(self.active)
        if self.active == 0:
            self.idle.set()
