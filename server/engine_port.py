"""What the servicer needs from the engine: a small Protocol over ``server/engine_process.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol, runtime_checkable

from espalier.engine.api import GenerationRequest, RequestOutput


@runtime_checkable
class ServingEngine(Protocol):
    """The engine as the server drives it: ``espalier serve``'s engine process
    (``EngineProcess``); tests may put an in-process engine behind it."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the last one has ``finished=True``."""
        ...

    def abort(self, request_id: str) -> Any:
        """Stop the request and free its KV blocks (may return an awaitable)."""
        ...

    def stats(self) -> Mapping[str, Any]:
        """Counters and gauges (running, waiting, free KV blocks, ...)."""
        ...

    def shutdown(self, drain: bool = True) -> Any:
        """Stop the engine, after finishing in-flight requests when ``drain`` (may be awaitable)."""
        ...
