"""Per-request state inside the engine: tokens, status, KV blocks, grammar, sampling, timings.

Pure python (no torch import): the scheduler reads and writes these objects; the engine attaches
the torch-side pieces (the sampling generator, the grammar matcher) as opaque attributes.

Token accounting: ``all_token_ids = prompt_ids + output_ids``; ``num_computed_tokens`` of them have
their K/V in the cache (cache indices ``0 .. num_computed_tokens-1``, held by ``block_table``). The
next forward feeds tokens ``num_computed_tokens ..`` and, when it reaches the last known token,
samples one new token. After a preemption ``num_computed_tokens`` drops to 0 (recompute).
"""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from espalier.engine.api import (
    FinishReason,
    GenerationRequest,
    SamplingParams,
    SpeculativeStats,
    Timings,
    Usage,
)

if TYPE_CHECKING:
    from espalier.constrained.base import CompiledGrammar, GrammarMatcher
    from espalier.constrained.errors import KeywordIssue
    from espalier.engine.detokenizer import StopStringWatch


class RequestStatus(enum.Enum):
    """WAITING_FOR_GRAMMAR → WAITING → RUNNING ⇄ PREEMPTED; any state → FINISHED. A request
    whose grammar compiled but whose matcher is still being made may go from WAITING_FOR_GRAMMAR
    to RUNNING directly (its prompt computed but for the last token: ``num_feedable_tokens``)."""

    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # compile Future not done yet
    WAITING = "waiting"  # ready, not admitted
    RUNNING = "running"  # holds KV blocks, scheduled every step
    PREEMPTED = "preempted"  # blocks freed; waits at the queue front to recompute
    FINISHED = "finished"


@dataclass
class RequestTimeline:
    """Monotonic timestamps (``time.perf_counter``) and accumulated seconds of one request."""

    arrival: float = field(default_factory=time.perf_counter)
    grammar_ready: float | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    compile_s: float = 0.0
    compile_queue_s: float = 0.0
    compile_run_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    mask_s: float = 0.0

    def to_timings(self) -> Timings:
        end = self.finished if self.finished is not None else time.perf_counter()
        ready = self.grammar_ready if self.grammar_ready is not None else self.arrival
        queue = (self.first_scheduled - ready) if self.first_scheduled is not None else end - ready
        return Timings(
            queue_s=max(queue, 0.0),
            compile_s=self.compile_s,
            compile_queue_s=self.compile_queue_s,
            compile_run_s=self.compile_run_s,
            prefill_s=self.prefill_s,
            decode_s=self.decode_s,
            mask_s=self.mask_s,
            first_token_s=(self.first_token - self.arrival) if self.first_token else 0.0,
            total_s=end - self.arrival,
        )


@dataclass(eq=False)
class Request:
    """One request's mutable state. Identity semantics (``eq=False``): usable in sets and dicts.

    ``arrival_seq`` orders requests FIFO; the scheduler never reorders by anything else.
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival_seq: int
    source: GenerationRequest | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    # prefix cache: keys of the prompt's full blocks (set at first admission), and how many
    # prompt tokens the first admission found cached (``usage.cached_prompt_tokens``)
    prompt_block_hashes: list[bytes] | None = None
    num_cached_tokens: int = 0
    # grammar: the Future of (compiled, report, own matcher); ``grammar_compiled`` is set (from
    # the compile's thread) once the compile succeeded, while the matcher may still be in making
    grammar_future: Future[Any] | None = None
    grammar_compiled: bool = False
    compiled: CompiledGrammar | None = None
    matcher: GrammarMatcher | None = None
    backend: str = ""
    weakened: tuple[KeywordIssue, ...] = ()
    # sampling: a torch.Generator seeded per request (None = greedy or unseeded default)
    generator: Any = None
    # output
    stop_watch: StopStringWatch | None = None  # set when the request has stop strings
    stop_ids: set[int] | None = None  # its stop token ids, made on first use (never changed)
    finish_reason: FinishReason | None = None
    closed_by_budget: bool = False  # the closing policy ended the output (engine/closing/)
    error: str | None = None
    timeline: RequestTimeline = field(default_factory=RequestTimeline)
    spec_stats: SpeculativeStats | None = None

    # -- token accounting ---------------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt + generated."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens whose K/V is not in the cache yet (>= 1 while running)."""
        return self.num_tokens - self.num_computed_tokens

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Known tokens ``[start, stop)`` of ``prompt_ids + output_ids`` without concatenating."""
        n_prompt = len(self.prompt_ids)
        if stop <= n_prompt:
            return self.prompt_ids[start:stop]
        if start >= n_prompt:
            return self.output_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: stop - n_prompt]

    # -- status -------------------------------------------------------------------------------

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def grammar_pending(self) -> bool:
        """Constrained, and its matcher not made yet: it may not sample (its prompt may be
        computed, all but the last token, once ``grammar_compiled``)."""
        return self.grammar_future is not None and self.matcher is None

    @property
    def num_feedable_tokens(self) -> int:
        """Uncomputed tokens a step may feed now: all of them, or while its matcher is being
        made (``grammar_pending``) all but the last, whose logits would need the matcher."""
        return self.num_uncomputed_tokens - int(self.grammar_pending)

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            cached_prompt_tokens=self.num_cached_tokens,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={len(self.prompt_ids)}, "
            f"out={len(self.output_ids)}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)})"
        )
