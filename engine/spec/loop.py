"""A small batch generation loop around :class:`SpeculativeDecoder` (greedy), for the lossless
tests, the benchmark and ``generate --local`` without the full engine.

All prompts are prefilled in one forward (every token but the last; the last is the first tree's
root), then speculative steps run until every request has finished. A request finishes on a stop
token (kept in its output), when its grammar terminates, or at ``max_tokens``. Emitted tokens are
applied one at a time, so a stop in the middle of an accepted path ends the request exactly where
plain decoding would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from espalier.engine.api import SpeculativeStats
from espalier.engine.kv_cache import BlockAllocator, blocks_needed
from espalier.engine.runner import SeqInput
from espalier.engine.spec.decoder import SpecSeq, SpeculativeDecoder, StepTimes
from espalier.engine.spec.verify import Acceptance

if TYPE_CHECKING:
    from espalier.constrained.base import GrammarMatcher


@dataclass
class LoopRequest:
    """One greedy generation. ``num_draft_tokens == 0`` decodes plainly (shares the batch)."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    matcher: GrammarMatcher | None = None
    methods: tuple[str, ...] = ()
    num_draft_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()


@dataclass
class LoopResult:
    request_id: str
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)


@dataclass
class _State:
    request: LoopRequest
    result: LoopResult
    tokens: list[int]
    block_table: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return bool(self.result.finish_reason)


class SpecLoop:
    """Generates a batch of requests to completion on ``decoder.runner``."""

    def __init__(self, decoder: SpeculativeDecoder) -> None:
        self.decoder = decoder
        self.runner = decoder.runner
        self.allocator = BlockAllocator(self.runner.num_blocks)

    def generate(self, requests: Sequence[LoopRequest]) -> list[LoopResult]:
        states = [_State(r, LoopResult(r.request_id), list(r.prompt_ids)) for r in requests]
        try:
            self._prefill([s for s in states if len(s.tokens) > 1])
            while True:
                live = [s for s in states if not s.finished]
                if not live:
                    break
                self._step(live)
        finally:
            for state in states:
                self._release(state)
        return [s.result for s in states]

    def _ensure(self, state: _State, entries: int) -> None:
        need = blocks_needed(entries, self.runner.block_size) - len(state.block_table)
        if need > 0:
            state.block_table.extend(self.allocator.allocate(need))

    def _release(self, state: _State) -> None:
        if state.block_table:
            self.allocator.free(state.block_table)
            state.block_table = []
        self.decoder.release(state.request.request_id)

    def _prefill(self, states: list[_State]) -> None:
        if not states:
            return
        for state in states:
            self._ensure(state, len(state.tokens) - 1)
        self.decoder.prefill(
            [
                (s.request.request_id, SeqInput(s.block_table, s.tokens[:-1], 0, logits="none"))
                for s in states
            ]
        )

    def _step(self, states: list[_State]) -> None:
        seqs = [
            SpecSeq(
                s.request.request_id,
                s.tokens,
                s.block_table,
                s.request.matcher,
                s.request.methods,
                min(s.request.num_draft_tokens, s.request.max_tokens - len(s.result.output_ids)),
            )
            for s in states
        ]
        by_id = {id(seq): state for seq, state in zip(seqs, states)}

        def ensure(seq: SpecSeq, entries: int) -> None:
            self._ensure(by_id[id(seq)], entries)

        outcomes, times = self.decoder.step(seqs, ensure)
        for outcome in outcomes:
            if outcome.fault is not None:  # no per-request isolation here: the loop fails
                raise outcome.fault
        for state, outcome in zip(states, outcomes):
            self._record(state, outcome.draft.num_draft_tokens, outcome.acceptance, times)
            for token in outcome.acceptance.tokens:
                self._emit(state, token)
                if state.finished:
                    break
            if state.finished:
                self._release(state)
            else:  # keep blocks for the known tokens only
                keep = blocks_needed(len(state.tokens), self.runner.block_size)
                if len(state.block_table) > keep:
                    self.allocator.free(state.block_table[keep:])
                    del state.block_table[keep:]

    @staticmethod
    def _record(state: _State, drafted: int, acceptance: Acceptance, times: StepTimes) -> None:
        stats = state.result.stats
        stats.steps += 1
        stats.draft_tokens += drafted
        stats.accepted_tokens += acceptance.accept_length
        stats.forced_tokens += acceptance.forced
        stats.draft_s += times.draft_s
        stats.mask_s += times.mask_s
        stats.verify_s += times.verify_s

    def _emit(self, state: _State, token: int) -> None:
        request = state.request
        if request.matcher is not None and not request.matcher.accept(token):
            raise AssertionError(f"verification emitted token {token} the grammar rejects")
        state.tokens.append(token)
        state.result.output_ids.append(token)
        if token in request.stop_token_ids:
            state.result.finish_reason = "stop"
        elif request.matcher is not None and request.matcher.is_terminated():
            state.result.finish_reason = "grammar"
        elif len(state.result.output_ids) >= request.max_tokens:
            state.result.finish_reason = "length"
