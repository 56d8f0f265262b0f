"""Plain results of client calls (the raw proto message stays reachable as ``.raw``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from espalier_client._proto import espalier_pb2 as pb

_FINISH_NAMES = {
    pb.FINISH_REASON_UNSPECIFIED: "",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_LENGTH_UNCLOSED: "length_unclosed",
    pb.FINISH_REASON_GRAMMAR: "grammar",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
}


@dataclass(frozen=True)
class KeywordIssue:
    keyword: str
    pointer: str
    support: str
    backend: str = ""


@dataclass(frozen=True)
class ToolCall:
    """A function call parsed from a chat generation with a forced ``tool_choice``."""

    id: str
    name: str
    arguments: dict[str, Any]  # validated against the tool's parameters by the server


def tool_calls_of(msg: pb.GenerateResponse) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(c.id, c.name, json.loads(c.arguments)) for c in msg.tool_calls)


@dataclass(frozen=True)
class Chunk:
    """One streamed piece; ``finished`` marks the last, which carries ``finish_reason``."""

    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str
    raw: Any = field(repr=False, compare=False)

    @classmethod
    def from_proto(cls, msg: pb.GenerateResponse) -> Chunk:
        return cls(
            msg.text,
            tuple(msg.token_ids),
            msg.finished,
            _FINISH_NAMES.get(msg.finish_reason, ""),
            msg,
        )


@dataclass(frozen=True)
class Generation:
    """A whole generation: text, tokens, why it stopped, and the server's accounting."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    backend: str
    weakened: tuple[KeywordIssue, ...]
    prompt_tokens: int
    completion_tokens: int
    valid: bool | None  # post-validation: None when the server did not check
    validation_errors: tuple[str, ...]
    raw: Any = field(repr=False, compare=False)
    tool_calls: tuple[ToolCall, ...] = ()

    @classmethod
    def from_proto(cls, msg: pb.GenerateResponse) -> Generation:
        checked = msg.HasField("validation") and msg.validation.checked
        return cls(
            request_id=msg.request_id,
            text=msg.text,
            token_ids=tuple(msg.token_ids),
            finish_reason=_FINISH_NAMES.get(msg.finish_reason, ""),
            backend=msg.backend,
            weakened=tuple(
                KeywordIssue(w.keyword, w.pointer, w.support, w.backend) for w in msg.weakened
            ),
            prompt_tokens=msg.usage.prompt_tokens,
            completion_tokens=msg.usage.completion_tokens,
            valid=msg.validation.valid if checked else None,
            validation_errors=tuple(msg.validation.errors),
            raw=msg,
            tool_calls=tool_calls_of(msg),
        )

    @classmethod
    def from_chunks(cls, chunks: list[pb.GenerateResponse]) -> Generation:
        """Fold streamed chunks the way GenerateUnary does."""
        merged = pb.GenerateResponse()
        merged.CopyFrom(chunks[-1])
        merged.text = "".join(c.text for c in chunks)
        del merged.token_ids[:]
        merged.token_ids.extend(t for c in chunks for t in c.token_ids)
        return cls.from_proto(merged)


@dataclass(frozen=True)
class CompileResult:
    backend: str
    weakened: tuple[KeywordIssue, ...]
    compile_seconds: float
    cache_hit: bool
    cache_key: str
    queue_seconds: float  # the compile's wait for a place to run, apart from compile_seconds
    raw: Any = field(repr=False, compare=False)

    @classmethod
    def from_proto(cls, msg: pb.CompileGrammarResponse) -> CompileResult:
        return cls(
            msg.backend,
            tuple(KeywordIssue(w.keyword, w.pointer, w.support, w.backend) for w in msg.weakened),
            msg.compile_seconds,
            msg.cache_hit,
            msg.cache_key,
            msg.queue_seconds,
            msg,
        )
