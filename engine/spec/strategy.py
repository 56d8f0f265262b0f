"""Speculative decoding as the engine's step strategy (``engine/step.py``'s seam).

Per planned step: every sequence that samples becomes a :class:`SpecSeq` (decoding ones get a
draft tree when their request speculates; the last prefill chunk and non-speculating requests get
a root-only tree, i.e. a plain step); sequences that do not sample (prefill chunks) ride along in
the same forward. The scheduler planned one token per decoding sequence; the strategy grows the
block table for the tree from the engine's allocator, and after verification moves
``num_computed_tokens`` past the accepted nodes and gives back blocks the request no longer needs.
The engine then appends the emitted tokens as usual (grammar accept, stops, detokenization).

Settings: :class:`SpecConfig` is the server default; a request's ``SpeculativeOptions`` may turn
speculation on or off, pick methods among the drafters loaded, and set its node budget.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from espalier.constrained.batch import BatchFiller
from espalier.engine.api import SpeculativeStats
from espalier.engine.kv_cache import blocks_needed
from espalier.engine.model.runner import SeqInput
from espalier.engine.spec.base import Drafter
from espalier.engine.spec.combine import FORCED, Proposer
from espalier.engine.spec.decoder import (
    SamplingSpec,
    SpecLaunch,
    SpecSeq,
    SpeculativeDecoder,
    StepTimes,
)
from espalier.engine.spec.decoder import SeqOutcome as DecoderOutcome
from espalier.engine.spec.forced import ForcedConfig
from espalier.engine.spec.masks import MaskBuilder
from espalier.engine.spec.tree_builder import Draft
from espalier.engine.step import PlainLaunch, SeqOutcome, StepResult, StepStrategy

if TYPE_CHECKING:
    import numpy as np

    from espalier.engine.closing import BudgetCloser
    from espalier.engine.engine import Engine
    from espalier.engine.kv_cache import BlockAllocator
    from espalier.engine.model.runner import ModelRunner
    from espalier.engine.request import Request
    from espalier.engine.scheduler import ScheduledSeq, StepPlan


@dataclass(frozen=True)
class SpecConfig:
    """Server default for speculation.

    enabled: speculate unless a request says otherwise. methods: default drafters (names of the
    loaded drafters and/or ``"forced"``). num_draft_tokens: default node budget per tree.
    mask_budget_s: time budget of one tree-mask fill (None = none). mask_threads: CPU threads
    filling tree masks (default: one per core, at most 8; the mask libraries drop the GIL).
    launch_first: launch the verify forward before starting the mask fills (None = on CUDA,
    where the launch is asynchronous; a step no CUDA graph fits starts its fills first even
    then: its eager launch is long; ``engine/spec/decoder.py``). close_ahead: the budget
    closer decides for every tree node on the mask threads while the verify forward runs
    (``engine/closing/ahead.py``); off: each emitted token is decided inline. It cuts the
    closing work left on the engine thread to about half once the jobs start after the step's
    fills (``MaskBuilder.submit``; ``docs/decisions/closing-ahead-after-fills.md``).
    adaptive_drafts: per request, the drafters' share of a tree follows what they got accepted
    lately (``SpeculativeDecoding._max_drafted``); grammar-forced chains are not cut.
    """

    enabled: bool = True
    methods: tuple[str, ...] = ("ngram", FORCED)
    num_draft_tokens: int = 8
    max_draft_tokens: int = 64
    mask_budget_s: float | None = 0.002
    mask_threads: int = field(default_factory=lambda: min(8, os.cpu_count() or 2))
    forced: ForcedConfig = field(default_factory=ForcedConfig)
    launch_first: bool | None = None
    close_ahead: bool = True
    adaptive_drafts: bool = True


@dataclass
class SpecStepLaunch:
    """A speculative step between :meth:`SpeculativeDecoding.launch` and ``finish``: its plan,
    its sampling sequences, their requests by ``id(SpecSeq)``, and the decoder's launch (None:
    a step of prefill chunks alone, already run)."""

    plan: StepPlan
    sampling: list[ScheduledSeq]
    by_seq: dict[int, Request]
    decoding: SpecLaunch | None
    started: float = field(default_factory=time.perf_counter)


ACCEPT_SMOOTHING = 0.5
"""Weight of the past in a request's accepted-drafts rate (per step, exponential)."""


class SpeculativeDecoding:
    """A ``StepStrategy``: speculative steps for the requests that ask, plain for the rest.

    A step none of whose requests may speculate (``settings`` gives them no method) runs on
    ``plain`` when given: the plain sampler's certified draws (``engine/step.py``), not the tree
    sampler's one uniform per step, whose inverse CDF over a large vocabulary moves to an adjacent
    id when the batch changes the logits' last bits. Such requests keep no decoder state.
    """

    def __init__(
        self,
        runner: ModelRunner,
        pool: BlockAllocator,
        config: SpecConfig,
        drafters: Mapping[str, Drafter],
        *,
        mask_vocab_size: int,
        closer: BudgetCloser | None = None,
        max_model_len: int = 0,
        plain: StepStrategy[PlainLaunch] | None = None,
    ) -> None:
        """closer, max_model_len: the engine's budget closer, whose decisions for the draft
        trees are made ahead on the mask threads (``engine/closing/ahead.py``); None: none.
        plain: the strategy for steps where no request may speculate (None: this one)."""
        self.plain = plain
        self.closer = closer
        self.max_model_len = max_model_len
        self.runner = runner
        self.pool = pool
        self.config = config
        self.available = frozenset(drafters) | {FORCED}
        masks = MaskBuilder(
            mask_vocab_size,
            threads=config.mask_threads,
            pin_memory=runner.device.type == "cuda",
            budget_s=config.mask_budget_s,
        )
        self.decoder = SpeculativeDecoder(
            runner,
            Proposer(drafters, config.forced, BatchFiller(config.mask_threads)),
            masks,
            launch_first=config.launch_first,
        )
        # every variant of the verification kernels a step can take, before the first step
        from espalier.constrained.bitmask import words_per_row
        from espalier.kernels.verify import warm_up as warm_up_verify

        warm_up_verify(
            runner.device,
            runner.vocab_size,
            words_per_row(mask_vocab_size),
            config.max_draft_tokens + 1,
            logits_width=runner.vocab_size,
        )
        self._live: dict[str, Request] = {}
        # per request: drafted (not forced) tokens accepted per step, smoothed (adaptive_drafts)
        self._accepted: dict[str, float] = {}

    def settings(self, request: Request) -> tuple[tuple[str, ...], int]:
        """``(methods, num_draft_tokens)`` for ``request``; ``((), 0)`` = does not speculate."""
        options = request.source.speculative if request.source is not None else None
        enabled = self.config.enabled
        methods, budget = self.config.methods, self.config.num_draft_tokens
        if options is not None:
            enabled = enabled if options.enabled is None else options.enabled
            methods = options.methods or methods
            budget = budget if options.num_draft_tokens is None else options.num_draft_tokens
        methods = tuple(m for m in methods if m in self.available)
        budget = min(max(budget, 0), self.config.max_draft_tokens)
        if not enabled or not methods or budget == 0:
            return (), 0
        return methods, budget

    def lookahead(self, request: Request) -> int:
        """Draft-tree nodes ``request`` verifies per decode step at most (the scheduler counts them
        against the step's token budget)."""
        _, budget = self.settings(request)
        return max(0, min(budget, request.sampling.max_tokens - len(request.output_ids) - 1))

    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(plan))

    @torch.inference_mode()
    def launch(
        self, plan: StepPlan, *, behind: Mapping[str, Sequence[int]] | None = None
    ) -> PlainLaunch | SpecStepLaunch:
        """Draft and launch ``plan``'s forward (``StepStrategy.launch``); a step none of whose
        requests may speculate launches on ``plain``."""
        self._release_finished()
        if self.plain is not None and all(self.settings(s.request)[1] == 0 for s in plan.seqs):
            return self.plain.launch(plan, behind=behind)
        sampling = [s for s in plan.seqs if s.samples]
        lag = behind or {}
        seqs = [self._spec_seq(s, lag.get(s.request.request_id, ())) for s in sampling]
        passthrough = [
            (
                s.request.request_id,
                SeqInput(s.request.block_table, s.token_ids, s.context_len, logits="none"),
            )
            for s in plan.seqs
            if not s.samples
        ]
        by_seq = {id(spec): sched.request for spec, sched in zip(seqs, sampling)}

        def ensure(seq: SpecSeq, entries: int) -> None:
            request = by_seq[id(seq)]
            need = blocks_needed(entries, self.runner.block_size) - len(request.block_table)
            need = min(need, self.pool.num_free_blocks)  # short of blocks: a smaller tree
            if need > 0:
                request.block_table.extend(self.pool.allocate(need))

        lookahead = None
        if self.closer is not None:
            lookahead = functools.partial(self._closing_jobs, self.closer, by_seq)
        decoding = None
        if seqs:
            decoding = self.decoder.launch(
                seqs, ensure, passthrough, lookahead, fill_first=behind is None
            )
        elif passthrough:
            self.decoder.prefill(passthrough)
        return SpecStepLaunch(plan, sampling, by_seq, decoding)

    def fill(self, launched: PlainLaunch | SpecStepLaunch) -> None:
        """Start the launch's fills (``StepStrategy.fill``): not for requests ended since."""
        if isinstance(launched, PlainLaunch):
            assert self.plain is not None, "plain launches come from it"
            self.plain.fill(launched)
        elif launched.decoding is not None:
            seqs, by_seq = launched.decoding.seqs, launched.by_seq
            live = [not by_seq[id(seq)].is_finished for seq in seqs]
            self.decoder.fill(launched.decoding, live)

    @torch.inference_mode()
    def finish(self, launched: PlainLaunch | SpecStepLaunch) -> StepResult:
        """Verify the launch (``StepStrategy.finish``); requests ended since it are skipped."""
        if isinstance(launched, PlainLaunch):
            assert self.plain is not None, "plain launches come from it"
            return self.plain.finish(launched)
        plan, sampling = launched.plan, launched.sampling
        outcomes_by_id: dict[int, SeqOutcome] = {}
        faults_by_id: dict[int, BaseException] = {}
        times = StepTimes(0.0, 0.0, 0.0)
        decoding = launched.decoding
        if decoding is not None:
            results, times = self.decoder.finish(decoding)
            for sched, spec, result in zip(sampling, decoding.seqs, results):
                if sched.request.is_finished:
                    continue  # its blocks are freed, its outcome unused
                if result.fault is not None:
                    faults_by_id[id(sched)] = result.fault
                    continue
                if spec.decoding and not result.acceptance.tokens:
                    # every verify step emits at least its bonus token; none means a row with no
                    # token to draw (its logits not finite): the request would loop, never ending
                    faults_by_id[id(sched)] = RuntimeError("the verify step drew no token")
                    continue
                self._account(sched, spec, result.draft.num_draft_tokens, result, times)
                outcomes_by_id[id(sched)] = SeqOutcome(
                    list(result.acceptance.tokens), list(result.logprobs)
                )
        outcomes = [outcomes_by_id.get(id(s)) for s in plan.seqs]
        faults = {i: faults_by_id[id(s)] for i, s in enumerate(plan.seqs) if id(s) in faults_by_id}
        return StepResult(outcomes, forward_s=times.verify_s, mask_s=times.mask_s, faults=faults)

    def _closing_jobs(
        self,
        closer: BudgetCloser,
        requests: Mapping[int, Request],
        specs: Sequence[SpecSeq],
        drafts: Sequence[Draft],
    ) -> list[Callable[[np.ndarray], None]]:
        """The closer's decisions ahead for the draft trees (``requests``: by ``id(spec)``):
        one job, their searches in one native call per wave (``BudgetCloser.lookaheads``),
        given the step's ``filled`` flags (``MaskBuilder.submit``'s ``after``)."""
        trees = [
            (requests[id(spec)], draft.tokens, draft.parents) for spec, draft in zip(specs, drafts)
        ]
        job = closer.lookaheads(trees, self.max_model_len)
        return [job] if job is not None else []

    def _spec_seq(self, sched: ScheduledSeq, behind: Sequence[int]) -> SpecSeq:
        request = sched.request
        methods, budget = self.settings(request) if not sched.is_prefill else ((), 0)
        params = request.sampling
        sampling = None
        if params.temperature > 0:
            sampling = SamplingSpec(
                params.temperature, params.top_k, params.top_p, params.min_p, request.generator
            )
        self._live[request.request_id] = request
        return SpecSeq(
            request_id=request.request_id,
            tokens=request.prompt_ids + request.output_ids,
            block_table=request.block_table,
            matcher=request.matcher,
            methods=methods,
            num_draft_tokens=min(budget, params.max_tokens - len(request.output_ids) - 1),
            sampling=sampling,
            context_len=sched.context_len,
            logprobs=params.logprobs,
            max_drafted=self._max_drafted(request.request_id, budget),
            behind=behind,
        )

    def _max_drafted(self, request_id: str, budget: int) -> int | None:
        """Drafted nodes for the request's next tree: twice what its drafters got accepted per
        step lately, plus one (at least one; forced chains aside). A verify forward costs
        per tree node (on the CPU in proportion; on a GPU in mask work and, at large batches,
        compute), so drafts that keep being rejected are cut back; accepted ones grow the
        tree again within a few steps. None: the whole budget (adaptive_drafts off)."""
        if not self.config.adaptive_drafts:
            return None
        rate = self._accepted.get(request_id)
        if rate is None:
            return None  # no evidence yet: the whole budget
        return max(1, min(budget, math.ceil(2 * rate) + 1))

    def _account(
        self,
        sched: ScheduledSeq,
        spec: SpecSeq,
        drafted: int,
        result: DecoderOutcome,
        times: StepTimes,
    ) -> None:
        request = sched.request
        emitted = len(result.acceptance.tokens)
        request.timeline.mask_s += times.mask_s
        if spec.decoding:
            # the scheduler counted the root; after the step every known token but the last is
            # in the cache (root + accepted nodes, compacted; without a bonus the last accepted
            # node is fed again next step as the root)
            request.num_computed_tokens = spec.context_len + emitted
            keep = blocks_needed(spec.context_len + 1 + emitted, self.runner.block_size)
            if len(request.block_table) > keep:
                self.pool.free(request.block_table[keep:])
                del request.block_table[keep:]
        if not spec.decoding or not spec.methods:
            return
        stats = request.spec_stats
        if stats is None:
            stats = request.spec_stats = SpeculativeStats()
        stats.steps += 1
        stats.draft_tokens += drafted
        stats.accepted_tokens += result.acceptance.accept_length
        stats.forced_tokens += result.acceptance.forced
        stats.draft_s += times.draft_s
        stats.mask_s += times.mask_s
        stats.verify_s += times.verify_s
        got = result.acceptance.accept_length - result.acceptance.forced
        last = self._accepted.get(request.request_id)
        self._accepted[request.request_id] = (
            float(got) if last is None else ACCEPT_SMOOTHING * last + (1 - ACCEPT_SMOOTHING) * got
        )

    def _release_finished(self) -> None:
        """Drop drafter state of requests that finished (or were preempted) since last step."""
        from espalier.engine.request import RequestStatus

        gone = [
            rid
            for rid, r in self._live.items()
            if r.status in (RequestStatus.FINISHED, RequestStatus.PREEMPTED)
        ]
        for rid in gone:
            del self._live[rid]
            self._accepted.pop(rid, None)
            self.decoder.release(rid)

    def close(self) -> None:
        for request_id in self._live:
            self.decoder.release(request_id)
        self._live.clear()
        self.decoder.masks.close()
        if self.plain is not None:
            self.plain.close()


def install(engine: Engine, config: SpecConfig, drafters: Mapping[str, Drafter]) -> Engine:
    """Make ``engine`` decode speculatively (its plain strategy runs the steps where no request
    may speculate; returns it)."""
    strategy = SpeculativeDecoding(
        engine.runner,
        engine.pool,
        config,
        drafters,
        mask_vocab_size=engine.tokenizer.vocab_size,
        closer=engine.closer if config.close_ahead else None,
        max_model_len=engine.max_model_len,
        plain=engine.strategy,
    )
    engine.strategy = strategy
    engine.scheduler.decode_lookahead = strategy.lookahead
    return engine
