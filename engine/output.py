"""Text from the engine's token chunks: incremental detokenization and post-validation.

The engine core (``engine/engine.py``) sends token ids; this makes each request's text with its
own :class:`~espalier.engine.detokenizer.IncrementalDetokenizer` (stop strings cut, UTF-8
characters never split across chunks) and checks a finished constrained output against the full
constraint (``constrained/postvalidate.py``). ``espalier serve`` runs it in the server process,
over the engine process's messages (``server/engine_process.py``), so neither costs engine-step
time; :class:`~espalier.engine.engine.Engine` runs it in-process. The engine decides that a stop
string ended a request (``StopStringWatch``, the same decoding); this cuts the text there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from espalier.engine.api import (
    ConstraintOptions,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    ValidationResult,
)
from espalier.engine.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from espalier.constrained.base import CompiledGrammar
    from espalier.constrained.spec import GrammarSpec
    from espalier.constrained.tokenizer import TokenizerInfo

log = logging.getLogger(__name__)

CompileFn = Callable[["GrammarSpec", ConstraintOptions], "CompiledGrammar"]
"""The compiled grammar of a spec (blocking), for grammars whose only validator is a replay
through a fresh matcher (EBNF, Lark, structural tags)."""

NOT_VALIDATED = (FinishReason.ABORT, FinishReason.ERROR)
"""Outputs that ended without a verdict: cancelled, or failed (their text is not an answer)."""


@dataclass
class _Stream:
    """One request's text state."""

    detokenizer: IncrementalDetokenizer
    grammar: GrammarSpec | None
    constraint: ConstraintOptions


class OutputProcessor:
    """Per request: token chunks in, the same chunks out with ``text_delta`` (and, on a finished
    constrained one, ``validation``) filled in.

    ``compile``: the compiled grammar for a replay; None: those kinds get ``checked=False``.
    ``postvalidate``: check finished constrained outputs (STOP, LENGTH, LENGTH_UNCLOSED,
    GRAMMAR; never ABORT or ERROR). Thread-safe for one writer per request: :meth:`add` and
    :meth:`discard` may run on another thread than :meth:`process`.
    """

    def __init__(
        self, tokenizer: TokenizerInfo, compile: CompileFn | None, *, postvalidate: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self._compile = compile
        self._postvalidate = postvalidate
        self._token_bytes = tokenizer.token_bytes
        self._skip_ids = tokenizer.special_token_ids
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        if postvalidate:
            load_postvalidation()

    def add(self, request: GenerationRequest) -> None:
        """Start ``request``'s text (before its first chunk can arrive)."""
        detokenizer = IncrementalDetokenizer(
            self._token_bytes, skip_ids=self._skip_ids, stop=request.sampling.stop
        )
        with self._lock:
            self._streams[request.request_id] = _Stream(
                detokenizer, request.grammar, request.constraint
            )

    def discard(self, request_id: str) -> None:
        """Forget a request whose chunks nobody reads any more (its stream closed early)."""
        with self._lock:
            self._streams.pop(request_id, None)

    def process(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """``outputs`` with their text (changed in place; a request's state is dropped with its
        final chunk). Chunks of requests not added (refused before any text) pass unchanged."""
        for out in outputs:
            with self._lock:
                stream = (
                    self._streams.pop(out.request_id, None)
                    if out.finished
                    else self._streams.get(out.request_id)
                )
            if stream is not None:
                self._fill(stream, out)
        return outputs

    def _fill(self, stream: _Stream, out: RequestOutput) -> None:
        count = out.text_tokens
        ids = out.token_ids if count is None else out.token_ids[:count]
        text = stream.detokenizer.push(ids).text
        if not out.finished:
            out.text_delta = text
            return
        if out.finish_reason is not FinishReason.ERROR:  # a failed output keeps what it had
            text += stream.detokenizer.flush().text
        out.text_delta = text
        if not self._postvalidate or stream.grammar is None or out.finish_reason in NOT_VALIDATED:
            return
        try:
            out.validation = self._validate(stream, stream.detokenizer.text)
        except Exception as exc:  # the validator's fault, not the output's: this request alone
            log.error("post-validation of %s failed", out.request_id, exc_info=exc)
            out.finish_reason = FinishReason.ERROR
            out.error = f"internal error in this request's step: {type(exc).__name__}"
            out.text_delta = ""

    def _validate(self, stream: _Stream, text: str) -> ValidationResult:
        from espalier.constrained.postvalidate import postvalidate, replay_with

        spec = stream.grammar
        assert spec is not None
        compile_fn, constraint = self._compile, stream.constraint

        def replay(output: str) -> bool:
            assert compile_fn is not None
            return replay_with(compile_fn(spec, constraint), self.tokenizer)(output)

        result = postvalidate(spec, text, replay=replay if compile_fn is not None else None)
        return ValidationResult(result.checked, result.valid, tuple(result.errors))


def load_postvalidation() -> None:
    """Import jsonschema and its format checkers now (once per process), not when the first
    constrained request finishes: the import builds dozens of parsers (rfc3987-syntax's Lark
    grammars), seconds of CPU that would otherwise stall the streams mid-generation."""
    import jsonschema

    _ = jsonschema.Draft202012Validator.FORMAT_CHECKER
