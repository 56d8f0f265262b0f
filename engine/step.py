"""How one planned step runs: the seam where plain, overlapped and speculative decoding plug in.

A :class:`StepStrategy` turns a :class:`~espalier.engine.scheduler.StepPlan` into new tokens per
sequence. It does not touch request state beyond timings: the engine appends the tokens, advances
the grammar matchers, detokenizes and checks stop conditions. A speculative strategy returns
several tokens per sequence (already verified against the grammar with per-node masks); the engine
handles them the same way.

:class:`PlainDecoding`: one forward, one token per sampling sequence. Grammar masks depend only on
the tokens accepted so far, so the whole batch's rows are filled by one grammar call
(``constrained.batch``) on a worker thread while the forward runs (``overlap=True``), and applied
to the logits when both are done. The step is three calls (``launch``, ``fill``, ``finish``),
so that an engine can launch the next forward before its matchers have taken the tokens it
samples after (``EngineConfig.grammar_after_launch``).

A sampled draw the sampler cannot certify against last-bit logit differences (``engine/sampler.py``,
step 5: ~1 in 1,000) is redrawn, with the same noise, from canonical logits: the sequence's known
tokens run alone from position 0 in scratch cache blocks, a forward that depends on those tokens
only. So a seeded request's tokens do not depend on which requests share its steps or on prefix
cache hits (while the scratch blocks can be had; a full cache keeps the batch draw).

Faults are per request: a request whose grammar raises while its row is filled (its row then
allows every token), or whose row alone makes the sampler raise, is reported in
:attr:`StepResult.faults` (the engine ends it); the rest go on.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.batch import BatchFiller
from espalier.engine.api import TokenLogprob
from espalier.engine.head_screen import HeadScreen
from espalier.engine.logits import compute_step_logits
from espalier.engine.sampler import RowParams, Sampler, SamplerOutput, apply_token_bitmask

if TYPE_CHECKING:
    from espalier.engine.kv_cache import BlockAllocator
    from espalier.engine.model.runner import ForwardOutput, LogitsSelect, ModelRunner
    from espalier.engine.request import Request
    from espalier.engine.scheduler import ScheduledSeq, StepPlan


class Launched(Protocol):
    """What every strategy's launch carries: its plan, and when it started."""

    @property
    def plan(self) -> StepPlan: ...

    @property
    def started(self) -> float: ...


LaunchT = TypeVar("LaunchT", bound=Launched)

CANONICAL_CHUNK = 512
"""Tokens per forward of a canonical redraw: fixed, so its logits depend on the tokens only."""


@dataclass
class SeqOutcome:
    """Tokens a step produced for one sequence (1 for plain decoding), logprobs aligned or [].

    num_computed_tokens: cache entries of the sequence valid after the step, when a strategy
    wrote more than the scheduler planned (a verified draft tree compacted into place); None =
    as planned. The engine stores it on the request before appending ``token_ids``.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_computed_tokens: int | None = None


@dataclass
class StepResult:
    """``outcomes[i]`` belongs to ``plan.seqs[i]``; None where the step sampled nothing (a
    prefill chunk that does not reach the end of the prompt). ``faults[i]``: the exception
    ``plan.seqs[i]``'s own grammar raised in the step (its outcome is then meaningless)."""

    outcomes: list[SeqOutcome | None]
    forward_s: float = 0.0
    mask_s: float = 0.0
    faults: dict[int, BaseException] = field(default_factory=dict)


@dataclass
class PlainLaunch:
    """A plain step between :meth:`PlainDecoding.launch` and ``finish``: its plan, its sampling
    rows (``sampling[row]`` indexes ``plan.seqs``), the constrained ones among them, their
    parameters; ``out`` the forward's output (on CUDA still being computed), ``masked`` the
    rows :meth:`PlainDecoding.fill` fills (None: not started), ``pending`` that fill's job."""

    plan: StepPlan
    sampling: list[int]
    constrained_rows: list[int]
    params: list[RowParams]
    greedy_rows: set[int]
    use_hidden: bool
    out: ForwardOutput | None = None
    forward_s: float = 0.0
    masked: list[int] | None = None
    pending: Future[tuple[float, dict[int, BaseException]]] | None = None
    started: float = field(default_factory=time.perf_counter)


def closing_logprob(token: int) -> TokenLogprob:
    """The logprob entry of a token the closing policy emitted (``engine/closing/``): chosen
    by the policy, not sampled, so its distribution is the one-token mask of a grammar-forced
    token: logprob 0.0, itself the only alternative."""
    return TokenLogprob(token, 0.0, ((token, 0.0),))


class StepStrategy(Protocol[LaunchT]):
    """How a planned step runs (plain, speculative). ``execute`` is ``finish(launch(plan))``;
    apart, ``launch(plan, behind=...)`` starts the forward while the matchers are still
    ``behind`` the plan's tokens (request id -> the tokens they have not accepted; each
    request's last ones), the caller catches them up (or ends requests), then ``fill`` starts
    the masks of the requests not ended, and ``finish`` waits for both and samples (its
    outcome for a request ended since the launch is unused)."""

    def execute(self, plan: StepPlan) -> StepResult: ...

    def launch(
        self, plan: StepPlan, *, behind: Mapping[str, Sequence[int]] | None = None
    ) -> LaunchT: ...

    def fill(self, launched: LaunchT) -> None: ...

    def finish(self, launched: LaunchT) -> StepResult: ...

    def close(self) -> None: ...


class PlainDecoding:
    """One batched forward per step; masks for constrained sequences filled alongside it.

    mask_vocab_size: vocabulary the bitmask rows cover (the tokenizer's model vocab V).
    max_rows: most sequences one step samples from (the scheduler's ``max_num_seqs``).
    scratch: the KV block pool that canonical redraws borrow blocks from (the engine's); None =
    no redraws (uncertain draws keep their batch token).
    sparse_head: compute only the allowed rows of the LM head for constrained sequences whose
    mask is sparse (``engine/logits.py``); exact, and most of a small model's decode time. On
    CPU it also screens the head in fp16 for greedy rows (``engine/head_screen.py``; exact).
    """

    def __init__(
        self,
        runner: ModelRunner,
        *,
        mask_vocab_size: int,
        max_rows: int,
        overlap: bool = True,
        sparse_head: bool = True,
        sampler: Sampler | None = None,
        scratch: BlockAllocator | None = None,
    ) -> None:
        self.runner = runner
        self.sampler = sampler or Sampler()
        self.scratch = scratch
        self.num_canonical_redraws = 0
        self.mask_vocab_size = mask_vocab_size
        on_cuda = runner.device.type == "cuda"
        # On CUDA the full LM head is one GEMM (0.5 ms for 262,144 x 4096 bf16 on an H200); the
        # sparse head's per-row host work and weight gathers cost more than they save there.
        self.sparse_head = sparse_head and not on_cuda
        self.screen: HeadScreen | None = None
        if self.sparse_head and runner.dtype == torch.float32:
            self.screen = HeadScreen.for_model(runner.model)
        self._bitmask = bm.allocate(max_rows, mask_vocab_size, pin_memory=on_cuda)
        if on_cuda:  # the masking kernel built before the first step, not in it
            logits = torch.zeros((1, runner.vocab_size), dtype=torch.float32, device=runner.device)
            apply_token_bitmask(logits, self._bitmask[:1], [0])
        # CUDA: a step is a few ms, so the batch call spreads its rows over native threads;
        # CPU: one, the forward needs the cores
        self._filler = BatchFiller(4 if on_cuda else 1)
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="espalier-grammar") if overlap else None
        )

    def execute(self, plan: StepPlan) -> StepResult:
        """Run ``plan`` to its tokens: the masks filled while the forward runs."""
        return self.finish(self.launch(plan))

    @torch.inference_mode()
    def launch(
        self, plan: StepPlan, *, behind: Mapping[str, Sequence[int]] | None = None
    ) -> PlainLaunch:
        """Start ``plan``'s forward (asynchronous on CUDA). ``behind`` None: the mask fill
        starts before it (:meth:`fill`); else the caller starts it when the matchers are where
        this step samples from (their tokens of the step before accepted)."""
        from espalier.engine.model.runner import SeqInput

        sampling = [i for i, s in enumerate(plan.seqs) if s.samples]
        constrained_rows = [
            row for row, i in enumerate(sampling) if plan.seqs[i].request.matcher is not None
        ]
        # Constrained rows may skip most of the LM head, greedy rows too once the screen is
        # ready (engine/logits.py): ask for the final hidden states instead of logits then.
        params = [_row_params(plan.seqs[i]) for i in sampling]
        greedy_rows = {r for r, p in enumerate(params) if p.greedy and not p.logprobs}
        screening = self.screen is not None and self.screen.ready and bool(greedy_rows)
        use_hidden = self.sparse_head and (bool(constrained_rows) or screening)
        launched = PlainLaunch(plan, sampling, constrained_rows, params, greedy_rows, use_hidden)
        if behind is None:
            self.fill(launched)
        logits_mode: LogitsSelect = "none" if use_hidden else "last"
        inputs = [
            SeqInput(
                block_table=s.request.block_table,
                token_ids=s.token_ids,
                context_len=s.context_len,
                logits=logits_mode if s.samples else "none",
            )
            for s in plan.seqs
        ]
        final_layer = self.runner.model_config.num_layers
        t0 = time.perf_counter()
        launched.out = self.runner.forward(
            inputs, hidden_layers=(final_layer,) if use_hidden else ()
        )
        launched.forward_s = time.perf_counter() - t0
        return launched

    def fill(self, launched: PlainLaunch) -> None:
        """Start filling the launch's constrained rows from their matchers (on the grammar
        worker when ``overlap``, else at :meth:`finish`); a request that ended since the launch
        is left out (its row allows every token, and its draw is never used)."""
        plan, sampling = launched.plan, launched.sampling
        launched.masked = [
            row
            for row in launched.constrained_rows
            if not plan.seqs[sampling[row]].request.is_finished
        ]
        requests = [plan.seqs[sampling[row]].request for row in launched.masked]
        if requests and self._pool is not None:
            launched.pending = self._pool.submit(self._fill_masks, requests, launched.masked)

    @torch.inference_mode()
    def finish(self, launched: PlainLaunch) -> StepResult:
        """Wait for the launch's forward and masks; sample its rows."""
        plan, sampling, params = launched.plan, launched.sampling, launched.params
        masked = launched.masked
        if masked is None:
            self.fill(launched)
            masked = launched.masked
            assert masked is not None
        if launched.pending is not None:
            mask_s, faulty = launched.pending.result()
        else:
            requests = [plan.seqs[sampling[row]].request for row in masked]
            mask_s, faulty = self._fill_masks(requests, masked)
        out, forward_s = launched.out, launched.forward_s
        assert out is not None
        outcomes: list[SeqOutcome | None] = [None] * len(plan.seqs)
        faults = {sampling[masked[j]]: exc for j, exc in faulty.items()}
        if not sampling:
            return StepResult(outcomes, forward_s, mask_s, faults)
        rows = self._bitmask[: len(sampling)]
        for row in set(launched.constrained_rows).difference(masked):
            rows[row].fill_(-1)  # its request ended: any draw will do
        logits, masked_rows = out.logits, masked
        if launched.use_hidden:
            final_layer = self.runner.model_config.num_layers
            ends = list(itertools.accumulate(s.num_new_tokens for s in plan.seqs))
            last = torch.tensor([ends[i] - 1 for i in sampling], device=self.runner.device)
            hidden = out.hidden_states[final_layer].index_select(0, last)
            step_logits = compute_step_logits(
                self.runner.model,
                hidden,
                rows,
                masked,
                vocab_size=self.mask_vocab_size,
                screen=self.screen,
                greedy_rows=launched.greedy_rows,
            )
            logits, masked_rows = step_logits.logits, step_logits.masked_rows
        try:
            sampled = self.sampler(logits, params, bitmask=rows, masked_rows=masked_rows)
        except Exception:  # one row's parameters or generator: find it, row by row
            sampled, bad = self._sample_alone(logits, params, rows, masked_rows)
            faults.update({sampling[row]: exc for row, exc in bad.items()})
        for row, noise in sampled.uncertain.items():
            seq = plan.seqs[sampling[row]]
            if seq.request.is_finished:
                continue
            constrained = seq.request.matcher is not None  # sparse-head rows too: mask them
            token = self._canonical_redraw(seq, params[row], noise, rows[row], constrained)
            if token is not None:
                sampled.token_ids[row] = token
        for row, i in enumerate(sampling):
            if i in faults:
                continue
            lp = sampled.logprobs[row]
            outcomes[i] = SeqOutcome([sampled.token_ids[row]], [lp] if lp is not None else [])
        return StepResult(outcomes, forward_s, mask_s, faults)

    def _canonical_redraw(
        self,
        seq: ScheduledSeq,
        params: RowParams,
        noise: torch.Tensor,
        bitmask_row: torch.Tensor,
        masked: bool,
    ) -> int | None:
        """The draw of ``seq``'s uncertain row from canonical logits: its known tokens (through
        this step's) forwarded alone from position 0, in chunks of ``CANONICAL_CHUNK``, into
        scratch blocks, freed after (reused first, before any cached block is evicted). None
        when the pool has not the blocks (the batch draw stands)."""
        from espalier.engine.kv_cache import blocks_needed
        from espalier.engine.model.runner import SeqInput

        if self.scratch is None:
            return None
        num_tokens = seq.context_len + seq.num_new_tokens
        need = blocks_needed(num_tokens, self.runner.block_size)
        if need > self.scratch.num_free_blocks:
            return None
        blocks = self.scratch.allocate(need)
        try:
            for start in range(0, num_tokens, CANONICAL_CHUNK):
                stop = min(start + CANONICAL_CHUNK, num_tokens)
                chunk = SeqInput(
                    block_table=blocks,
                    token_ids=seq.request.token_slice(start, stop),
                    context_len=start,
                    logits="last" if stop == num_tokens else "none",
                )
                out = self.runner.forward([chunk])
        finally:
            self.scratch.free_first(blocks)
        logits = out.logits[:1].float()
        if masked:
            apply_token_bitmask(logits, bitmask_row.unsqueeze(0), [0])
        self.num_canonical_redraws += 1
        return self.sampler.redraw(logits[0], params, noise)

    def _sample_alone(
        self,
        logits: torch.Tensor,
        params: Sequence[RowParams],
        bitmask: torch.Tensor,
        masked_rows: Sequence[int],
    ) -> tuple[SamplerOutput, dict[int, BaseException]]:
        """The batch's sampling failed: each row sampled alone, and the exception of each row
        that fails alone too (its request's fault). Greedy rows come out as in the batch; a
        sampled row draws from its generator as the failed batch left it."""
        masked = set(masked_rows)
        tokens: list[int] = [0] * len(params)
        logprobs: list[TokenLogprob | None] = [None] * len(params)
        bad: dict[int, BaseException] = {}
        uncertain: dict[int, torch.Tensor] = {}
        for row, p in enumerate(params):
            try:
                one = self.sampler(
                    logits[row : row + 1],
                    [p],
                    bitmask=bitmask[row : row + 1],
                    masked_rows=[0] if row in masked else [],
                )
            except Exception as exc:
                bad[row] = exc
                continue
            tokens[row], logprobs[row] = one.token_ids[0], one.logprobs[0]
            if 0 in one.uncertain:
                uncertain[row] = one.uncertain[0]
        return SamplerOutput(tokens, logprobs, uncertain), bad

    def _fill_masks(
        self, requests: Sequence[Request], rows: Sequence[int]
    ) -> tuple[float, dict[int, BaseException]]:
        """Fill bitmask row ``rows[j]`` from ``requests[j]``'s matcher, all in one batch call;
        the call's seconds (shared out over the requests' timelines) and the faults by ``j``."""
        t0 = time.perf_counter()
        matchers = [r.matcher for r in requests]
        assert all(m is not None for m in matchers)
        faults = self._filler.fill_next_rows(matchers, self._bitmask, rows)  # type: ignore[arg-type]
        total = time.perf_counter() - t0
        for request in requests:
            request.timeline.mask_s += total / len(requests)
        return total, faults

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _row_params(seq: ScheduledSeq) -> RowParams:
    p = seq.request.sampling
    return RowParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        generator=seq.request.generator,
        logprobs=p.logprobs,
    )
