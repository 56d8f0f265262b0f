"""The typed channel between the server process and the engine process.

Server → engine: :class:`AddRequest`, :class:`Abort`, :class:`Shutdown`. Engine → server: one
:class:`StepOutputs` per loop iteration that has news (every chunk of the step in one message, so
streaming pays one pickle and one pipe write per step, not per token), and :class:`EngineStopped`
last. Messages are pickled by ``multiprocessing.connection.Connection``; exceptions cross as
:class:`PortableError` because an exception whose ``__init__`` takes other arguments than its
``args`` (``InvalidRequestError(violations)``) does not survive pickling as itself.
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from espalier.engine.api import GenerationRequest, RequestOutput


@dataclass(frozen=True)
class PortableError:
    """An exception as data: its class (an ``espalier`` class, else only the message survives),
    ``args`` and attributes."""

    module: str
    qualname: str
    message: str
    args: tuple[Any, ...] = ()
    attributes: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, exc: BaseException) -> PortableError:
        kind = type(exc)
        args, attributes = tuple(exc.args), dict(vars(exc))
        try:
            pickle.dumps((args, attributes))
        except Exception:  # unpicklable state: the message alone still crosses
            args, attributes = (str(exc),), {}
        return cls(kind.__module__, kind.__qualname__, str(exc), args, attributes)

    def rebuild(self) -> BaseException:
        """The exception again (same class, args, attributes); a ``RuntimeError`` with the
        message when the class is not an importable ``espalier`` exception."""
        try:
            if not self.module.startswith("espalier."):
                raise LookupError(self.module)
            kind: Any = importlib.import_module(self.module)
            for part in self.qualname.split("."):
                kind = getattr(kind, part)
            if not (isinstance(kind, type) and issubclass(kind, BaseException)):
                raise LookupError(self.qualname)
            exc: BaseException = kind.__new__(kind)
            exc.args = self.args
            vars(exc).update(self.attributes)
            return exc
        except Exception:
            return RuntimeError(self.message)


@dataclass(frozen=True)
class AddRequest:
    """Queue ``request`` (tokenized: ``prompt_token_ids`` set). A refusal comes back as a
    finished ``ERROR`` chunk carrying the typed error."""

    request: GenerationRequest


@dataclass(frozen=True)
class Abort:
    """Stop a request; its stream ends with an ``ABORT`` chunk."""

    request_id: str


@dataclass(frozen=True)
class Shutdown:
    """Take nothing new; finish in-flight requests (``drain``) or abort them; then exit."""

    drain: bool = True


EngineCommand = AddRequest | Abort | Shutdown


@dataclass(frozen=True)
class StepOutputs:
    """Every chunk one loop iteration produced, in order. ``errors``: the typed exception of a
    chunk (``RequestOutput.exception`` is sent as None), by request id. ``stats``: the engine's
    gauges after the iteration, with the compile cache's counters under ``"grammar_cache"``.
    ``adds_applied``: AddRequests taken so far (the sender counts the ones still in flight)."""

    outputs: tuple[RequestOutput, ...]
    errors: Mapping[str, PortableError]
    stats: Mapping[str, Any]
    adds_applied: int


@dataclass(frozen=True)
class EngineStopped:
    """The loop ended: after a Shutdown (``error`` None) or because it failed."""

    error: str | None = None
