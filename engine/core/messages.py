"""The typed channel between the server process and the engine process.

Server → engine: :class:`AddRequest`, :class:`Abort`, :class:`Compile`, :class:`Withdraw`,
:class:`Shutdown`.
Engine → server: one :class:`StepOutputs` per loop iteration that has news (every chunk of the step
in one message, so streaming pays one pickle and one pipe write per step, not per token): token
ids, finish reasons, usage and errors, never text (the server makes the text and post-validates
it, ``engine/output.py``),
:class:`Compiled` for each Compile, and :class:`EngineStopped` last. Messages are pickled by
``multiprocessing.connection.Connection``; exceptions cross as :class:`PortableError` because an
exception whose ``__init__`` takes other arguments than its ``args``
(``InvalidRequestError(violations)``) does not survive pickling as itself.
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from espalier.constrained.base import CompileReport
from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import ConstraintOptions, GenerationRequest, RequestOutput, TokenLogprob


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
class Compile:
    """Compile ``spec`` into the engine's compile cache (CompileGrammar: the requests that follow
    hit it); answered by one :class:`Compiled` with the same ``call_id``."""

    call_id: int
    spec: GrammarSpec
    options: ConstraintOptions


@dataclass(frozen=True)
class Withdraw:
    """The caller of :class:`Compile` ``call_id`` left: its wait in the compile cache is
    cancelled (a compile nobody else waits for stops); no :class:`Compiled` answers it."""

    call_id: int


@dataclass(frozen=True)
class Compiled:
    """The answer to :class:`Compile` ``call_id``: its report, or the typed error it raised."""

    call_id: int
    report: CompileReport | None
    error: PortableError | None = None


@dataclass(frozen=True)
class Shutdown:
    """Take nothing new; finish in-flight requests (``drain``) or abort them; then exit."""

    drain: bool = True


EngineCommand = AddRequest | Abort | Compile | Withdraw | Shutdown


ChunkRow = tuple[str, tuple[int, ...], tuple[TokenLogprob, ...]]
"""An unfinished chunk on the wire: (request_id, token_ids, logprobs); all its tokens make
text."""


@dataclass(frozen=True)
class StepOutputs:
    """Every chunk one loop iteration produced (at most one per request). Unfinished chunks
    travel as :data:`ChunkRow` tuples (pickling 64 of them took 60 µs against 550 µs as
    ``RequestOutput`` objects, on the engine's side of the step); finished ones whole, with
    the typed exception (``RequestOutput.exception``, sent as None) in ``errors`` by request id.
    ``stats``: the engine's gauges after the iteration, the compile cache's counters under
    ``"grammar_cache"``. ``adds_applied``: AddRequests taken so far (the sender counts the ones
    still in flight)."""

    rows: tuple[ChunkRow, ...]
    finished: tuple[RequestOutput, ...]
    errors: Mapping[str, PortableError]
    stats: Mapping[str, Any]
    adds_applied: int

    @classmethod
    def pack(
        cls, outputs: list[RequestOutput], stats: Mapping[str, Any], adds_applied: int
    ) -> StepOutputs:
        """The wire form of ``outputs``, the engine core's token chunks (no text; their
        ``exception`` fields are cleared)."""
        rows: list[ChunkRow] = []
        finished: list[RequestOutput] = []
        errors: dict[str, PortableError] = {}
        for out in outputs:
            if not out.finished:
                rows.append((out.request_id, out.token_ids, out.logprobs))
                continue
            if out.exception is not None:
                errors[out.request_id] = PortableError.of(out.exception)
                out.exception = None
            finished.append(out)
        return cls(tuple(rows), tuple(finished), errors, stats, adds_applied)

    def outputs(self) -> list[RequestOutput]:
        """The chunks again, unfinished first, typed exceptions rebuilt."""
        chunks = [RequestOutput(rid, "", ids, logprobs=lp) for rid, ids, lp in self.rows]
        for out in self.finished:
            error = self.errors.get(out.request_id)
            if error is not None:
                out.exception = error.rebuild()
            chunks.append(out)
        return chunks


@dataclass(frozen=True)
class EngineStopped:
    """The loop ended: after a Shutdown (``error`` None) or because it failed."""

    error: str | None = None
