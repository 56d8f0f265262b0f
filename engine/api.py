"""The engine's public data types: what a request asks for and what comes back.

The server converts proto messages to and from these; nothing here imports grpc or proto code.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from espalier.constrained.errors import KeywordIssue
from espalier.constrained.spec import GrammarSpec

MIN_TEMPERATURE = 1e-5
"""Temperatures above 0 and below this are greedy: ``logits / T`` overflows fp32 towards
``T = 1e-38`` (rows of inf and NaN, from which no token can be drawn), and long before that a
draw is the argmax (vLLM draws the same line, its ``_SAMPLING_EPS``)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` means greedy (top_k/top_p/min_p ignored); so
    does a temperature below :data:`MIN_TEMPERATURE` (made 0 here)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()  # stop strings (not included in the output)
    stop_token_ids: tuple[int, ...] = ()  # extra stop ids beyond the tokenizer's
    ignore_eos: bool = False
    logprobs: int = 0  # top-n logprobs per emitted token, 0 = none

    def __post_init__(self) -> None:
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)

    def validate(self) -> list[tuple[str, str]]:
        """Field violations as (field, description); empty when valid."""
        bad: list[tuple[str, str]] = []
        if not self.temperature >= 0.0:
            bad.append(("temperature", "must be >= 0"))
        if self.top_k < 0:
            bad.append(("top_k", "must be >= 0"))
        if not 0.0 < self.top_p <= 1.0:
            bad.append(("top_p", "must be in (0, 1]"))
        if not 0.0 <= self.min_p <= 1.0:
            bad.append(("min_p", "must be in [0, 1]"))
        if self.max_tokens < 1:
            bad.append(("max_tokens", "must be >= 1"))
        if self.logprobs < 0 or self.logprobs > 20:
            bad.append(("logprobs", "must be in [0, 20]"))
        return bad


@dataclass(frozen=True)
class ConstraintOptions:
    """How to compile the constraint. ``backend='auto'`` picks one that enforces every keyword."""

    backend: str = "auto"
    allow_weakening: bool = False


@dataclass(frozen=True)
class SpeculativeOptions:
    """Per-request speculation; ``None`` fields take the server default."""

    enabled: bool | None = None
    methods: tuple[str, ...] = ()  # subset of {"ngram", "draft", "eagle", "forced"}
    num_draft_tokens: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """One generation. Exactly one of ``prompt`` / ``prompt_token_ids`` is set. Under a
    constraint without free text, ``sampling.stop`` and ``stop_token_ids`` are emptied: the
    constraint decides where the output ends (``__post_init__``)."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    grammar: GrammarSpec | None = None
    constraint: ConstraintOptions = field(default_factory=ConstraintOptions)
    speculative: SpeculativeOptions = field(default_factory=SpeculativeOptions)

    def __post_init__(self) -> None:
        # A constraint decides where its output ends: a stop string or stop token inside the
        # constrained text would cut it where the grammar cannot end (finish "stop", invalid).
        # So they apply only where a structural tag lets free text through (reasoning, text
        # around triggered tags); under any other constraint they are not applied.
        sampling, grammar = self.sampling, self.grammar
        if grammar is None or not (sampling.stop or sampling.stop_token_ids):
            return
        from espalier.constrained.structural_tag import has_free_text

        if not has_free_text(grammar):
            object.__setattr__(self, "sampling", replace(sampling, stop=(), stop_token_ids=()))


class FinishReason(enum.Enum):
    STOP = "stop"  # stop token or stop string
    LENGTH = "length"  # max_tokens or the model's context; a constrained output may end here
    # max_tokens or the context cut a constrained output where its grammar cannot end and the
    # closing policy could not close it: an unfinished prefix, never a complete output
    LENGTH_UNCLOSED = "length_unclosed"
    GRAMMAR = "grammar"  # the grammar terminated
    ABORT = "abort"  # client cancel / deadline / shutdown
    ERROR = "error"


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass
class Timings:
    """Seconds spent per phase of one request."""

    queue_s: float = 0.0
    compile_s: float = 0.0  # arrival → grammar and matcher ready
    compile_queue_s: float = 0.0  # the compile's waits (CompileReport.queue_seconds), 0 on a hit
    compile_run_s: float = 0.0  # the compile's run (CompileReport.compile_seconds), 0 on a hit
    prefill_s: float = 0.0
    decode_s: float = 0.0
    mask_s: float = 0.0
    first_token_s: float = 0.0  # arrival → first emitted token
    total_s: float = 0.0


@dataclass
class SpeculativeStats:
    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    forced_tokens: int = 0
    draft_s: float = 0.0
    mask_s: float = 0.0
    verify_s: float = 0.0

    @property
    def mean_accept_length(self) -> float:
        return (self.accepted_tokens / self.steps) if self.steps else 0.0


@dataclass
class ValidationResult:
    """Post-validation of the final output against the full constraint."""

    checked: bool
    valid: bool
    errors: tuple[str, ...] = ()  # messages, each prefixed by the JSON pointer where known


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the constrained distribution, and ``top``: the
    most likely ``(token id, logprob)`` pairs, most likely first. Tokens the constraint forbids
    (logprob -inf) are dropped from ``top``, so it can be shorter than asked for (JSON has no
    -inf: the OpenAI API would write null)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if any(value == -math.inf for _, value in self.top):
            self.top = tuple(pair for pair in self.top if pair[1] != -math.inf)


@dataclass
class RequestOutput:
    """One streamed chunk. ``finished`` is True on the last; only it carries the final fields.
    The engine core fills the token fields; ``text_delta`` and ``validation`` come from the
    text's maker (``engine/output.py``), in the server process when served."""

    request_id: str
    text_delta: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    speculative: SpeculativeStats | None = None
    validation: ValidationResult | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    error: str | None = None
    weakened: tuple[KeywordIssue, ...] = ()  # what the chosen backend weakened (allow_weakening)
    backend: str = ""  # the grammar backend used, "" when unconstrained
    closed_by_budget: bool = False  # the closing policy ended it within max_tokens (STOP)
    # How many leading ``token_ids`` make text (not the stop token or the rejected token that
    # ended the request); None: all of them. Set by the engine for its text's maker
    # (``engine/output.py``).
    text_tokens: int | None = None
    # The typed exception behind ``error`` (e.g. a GrammarError from compiling), for the server to
    # map to a status; never serialized.
    exception: BaseException | None = field(default=None, repr=False, compare=False)

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """This unfinished chunk and the same request's ``later`` one as one chunk: tokens, text
        and logprobs joined, the final fields (``later``'s) kept. Why: a stream whose reader lags
        the engine sends one message for what piled up, not one per step."""
        assert not self.finished and later.request_id == self.request_id
        text_tokens = None  # an unfinished chunk's tokens all make text
        if later.text_tokens is not None:
            text_tokens = len(self.token_ids) + later.text_tokens
        return replace(
            later,
            text_delta=self.text_delta + later.text_delta,
            token_ids=self.token_ids + later.token_ids,
            logprobs=self.logprobs + later.logprobs,
            text_tokens=text_tokens,
        )


class InvalidRequestError(ValueError):
    """A request the engine refuses before queueing it; ``violations`` as (field, description)."""

    def __init__(self, violations: list[tuple[str, str]]) -> None:
        self.violations = list(violations)
        listed = "; ".join(f"{name}: {why}" for name, why in self.violations)
        super().__init__(f"invalid request: {listed}")
