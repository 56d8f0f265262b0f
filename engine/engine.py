"""The engine: requests in, streamed :class:`RequestOutput` chunks out, one step at a time.

:class:`EngineCore` makes tokens (``espalier serve``'s engine process runs it); the text, stop
strings aside, is made from its chunks by :class:`~espalier.engine.output.OutputProcessor`, in
the server process when served and inside :class:`Engine` (the core and its text in one
process: ``espalier generate --local``, tests, benches).

Single-threaded: ``add_request``, ``abort`` and ``step`` are called from one thread (the engine
loop's thread). Each ``step``:

1. moves requests whose grammar finished compiling to the ready queue (or fails them);
2. asks the scheduler for a plan (continuous batching, chunked prefill, preemption);
3. runs it through the :class:`~espalier.engine.step.StepStrategy` (plain decoding now; the
   speculative and overlapped GPU paths plug in here);
4. appends the new tokens: grammar accept, stop tokens, grammar termination, stop strings
   (:class:`~espalier.engine.detokenizer.StopStringWatch`), max tokens.
   Near the end of a constrained request's budget, a token after which the grammar could no
   longer be completed within max_tokens is replaced by a closing path and a stop token
   (``engine/closing/``), so constrained outputs finish valid instead of being cut.

Faults are the request's own: an exception raised by one request's grammar (mask fill, accept,
closing search) ends that request alone with ``ERROR`` (a typed
:class:`~espalier.constrained.errors.GrammarError` in ``exception`` when its input caused it,
else a message naming only the exception's type) and the step goes on for the others. Only a
failure of the batched forward or sampler fails the step's whole batch.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from espalier.constrained.batch import BatchFiller
from espalier.engine.api import (
    ConstraintOptions,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    RequestOutput,
)
from espalier.engine.closing import BudgetCloser
from espalier.engine.constraints import GrammarService
from espalier.engine.detokenizer import StopStringWatch
from espalier.engine.kv_cache import BlockAllocator
from espalier.engine.output import OutputProcessor
from espalier.engine.request import Request, RequestStatus
from espalier.engine.sampler import DEFAULT_MARGIN, Sampler, make_generator
from espalier.engine.scheduler import Scheduler, SchedulerConfig
from espalier.engine.step import (
    Launched,
    PlainDecoding,
    SeqOutcome,
    StepStrategy,
    closing_logprob,
)

if TYPE_CHECKING:
    from typing import Self

    from espalier.constrained.base import CompiledGrammar, GrammarMatcher
    from espalier.constrained.spec import GrammarSpec
    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.engine.model.runner import ModelRunner, RunnerConfig
    from espalier.engine.scheduler import StepPlan

log = logging.getLogger(__name__)

AFTER_LAUNCH_MIN = 8
"""``EngineConfig.grammar_after_launch``'s value on CUDA: the fewest requests whose appends can
wait for which a step launches ahead. The work it hides grows with the
requests; what it risks does not: a launch whose every row the grammar's verdicts end is a
forward for nothing, likely when few requests are left (at batch 1, the last step of every
request)."""


@dataclass(frozen=True)
class EngineConfig:
    """scheduler: batching limits (its block_size is taken from the runner's cache).
    max_model_len: most tokens (prompt + output) per request; None = the model's limit capped
        by the cache capacity. compile_timeout_s: per grammar. overlap_masks: fill grammar masks
        on a CPU thread while the forward runs. sparse_head: compute only the allowed LM-head
        rows for constrained sequences with sparse masks (exact; ``engine/logits.py``).
        postvalidate: check each finished constrained output against the full constraint
        (:class:`Engine`'s text; a served engine's server always checks).
        close_within_budget: near max_tokens, close a constrained output along a short path that
        completes its grammar rather than cut it (``engine/closing/``); ignore_eos requests
        are never closed. sampling_margin: the sampler's certification lead (``Sampler.margin``):
        sampled draws closer than this to a tie are redrawn from canonical logits
        (``engine/step.py``), so seeded outputs do not depend on the batch; 0 = never.
        grammar_after_launch: when at least this many requests' appends can wait (their
        tokens can end them only through the grammar: unconstrained ones never), launch the
        next forward (plain or speculative) before them, make them (closing decisions,
        accepts, termination, bookkeeping) while the forward runs, then start its mask
        fills; 0: never; None: :data:`AFTER_LAUNCH_MIN` on CUDA (where the launch only
        enqueues), 0 elsewhere (a CPU forward runs to its end inside the launch). Outputs are
        the same either way (``bench/gpu.py --grammar-after-launch=0`` turns it off)."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_model_len: int | None = None
    compile_timeout_s: float = 30.0
    overlap_masks: bool = True
    sparse_head: bool = True
    postvalidate: bool = True
    close_within_budget: bool = True
    sampling_margin: float = DEFAULT_MARGIN
    grammar_after_launch: int | None = None


class EngineCore:
    """Requests in, token chunks out: ``text_delta`` empty and ``validation`` None (their
    maker is :class:`~espalier.engine.output.OutputProcessor`); ``text_tokens`` on a final
    chunk says which of its tokens make text."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: TokenizerInfo,
        *,
        grammar: GrammarService | None = None,
    ) -> None:
        sched_cfg = replace(config.scheduler, block_size=runner.block_size)
        self.config = replace(config, scheduler=sched_cfg)
        self.runner = runner
        self.tokenizer = tokenizer
        self.pool = BlockAllocator(runner.num_blocks)
        self.scheduler = Scheduler(sched_cfg, self.pool, runner.num_blocks)
        self.grammar = grammar or GrammarService(
            tokenizer, compile_timeout_s=config.compile_timeout_s
        )
        self.strategy: StepStrategy[Any] = PlainDecoding(
            runner,
            mask_vocab_size=tokenizer.vocab_size,
            max_rows=sched_cfg.max_num_seqs,
            overlap=config.overlap_masks,
            sparse_head=config.sparse_head and runner.full_head,  # a TP rank holds a slice
            sampler=Sampler(margin=config.sampling_margin),
            scratch=self.pool,
        )
        limit = runner.model_config.max_position_embeddings
        if config.max_model_len is not None:
            limit = min(limit, config.max_model_len)
        self.max_model_len = min(limit, self.scheduler.capacity_tokens)
        self._requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []
        self._arrivals = itertools.count()
        self._skip_ids = tokenizer.special_token_ids
        # CUDA: a step's closing searches spread over native threads; CPU: one (the forward's)
        closing_threads = 8 if runner.device.type == "cuda" else 1
        enabled = config.close_within_budget
        self.closer = BudgetCloser(
            tokenizer,
            enabled=enabled,
            threads=closing_threads,
            paths=self.grammar.closing_paths() if enabled else None,
        )
        # the step's accepts, one call per grammar library (the engine thread's own entry points)
        self._batch = BatchFiller(4 if runner.device.type == "cuda" else 1)
        self._token_bytes = tokenizer.token_bytes
        self._inflight: Launched | None = None  # the step launched, not yet finished
        after = config.grammar_after_launch
        if after is None:
            after = AFTER_LAUNCH_MIN if runner.device.type == "cuda" else 0
        self.after_launch = after  # EngineConfig.grammar_after_launch, resolved
        self.num_steps = 0
        self.num_dropped_rows = 0  # rows of a launched step whose request ended behind it
        self.num_generated_tokens = 0
        self.num_preemptions = 0

    @classmethod
    def from_model(
        cls,
        path: str | os.PathLike[str],
        config: EngineConfig | None = None,
        runner_config: RunnerConfig | None = None,
        *,
        runner: ModelRunner | None = None,
    ) -> Self:
        """Load a model (HF directory or ``.gguf`` file) and its tokenizer; ``runner``: the
        model at ``path`` already built (a tensor-parallel rank 0): only the tokenizer is read."""
        from espalier.constrained.tokenizer import TokenizerInfo
        from espalier.engine.model.runner import ModelRunner

        if runner is None:
            runner = ModelRunner.from_pretrained(path, runner_config)
        text = str(path)
        if text.endswith(".gguf"):
            tok = TokenizerInfo.from_gguf(text, vocab_size=runner.vocab_size)
        else:
            tok = TokenizerInfo.from_pretrained(text, vocab_size=runner.vocab_size)
        if tok.vocab_size != max(runner.vocab_size, tok.tokenizer_vocab_size):
            tok = TokenizerInfo(tok.hf, vocab_size=runner.vocab_size, name=tok.name)
        return cls(config or EngineConfig(), runner, tok)

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, source: GenerationRequest) -> None:
        """Queue a request; raises :class:`InvalidRequestError` for a request it cannot run."""
        bad = list(source.sampling.validate())
        if source.request_id in self._requests:
            bad.append(("request_id", f"{source.request_id!r} is already in use"))
        if source.prompt_token_ids is not None:
            prompt = list(source.prompt_token_ids)
            if any(not 0 <= t < self.runner.vocab_size for t in prompt):
                bad.append(("prompt_token_ids", "ids must be in [0, vocab size)"))
        else:
            prompt = self.tokenizer.hf.encode(source.prompt or "", add_special_tokens=True)
        if not prompt:
            bad.append(("prompt", "must not be empty"))
        elif len(prompt) >= self.max_model_len:
            bad.append(("prompt", f"{len(prompt)} tokens; the limit is {self.max_model_len - 1}"))
        if bad:
            raise InvalidRequestError(bad)
        request = Request(
            request_id=source.request_id,
            prompt_ids=prompt,
            sampling=source.sampling,
            arrival_seq=next(self._arrivals),
            source=source,
        )
        if source.sampling.temperature > 0:
            request.generator = make_generator(source.sampling.seed, self.runner.device)
        if any(source.sampling.stop):
            request.stop_watch = StopStringWatch(
                self._token_bytes, skip_ids=self._skip_ids, stop=source.sampling.stop
            )
        if source.grammar is not None:
            future = self.grammar.submit_request(
                source.grammar,
                source.constraint,
                on_compiled=lambda: setattr(request, "grammar_compiled", True),
            )
            timeline = request.timeline
            future.add_done_callback(lambda _f: setattr(timeline, "grammar_ready", _now()))
            request.grammar_future = future
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self._requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str, *, error: str | None = None) -> bool:
        """Stop a request wherever it is and free its blocks; its final chunk (``ABORT``, or
        ``ERROR`` with ``error``) comes out of the next ``step`` (or :meth:`take_pending`).
        False when no such request is unfinished."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        if request.grammar_future is not None and request.matcher is None:
            request.grammar_future.cancel()
        reason = FinishReason.ABORT if error is None else FinishReason.ERROR
        self._pending.append(self._finish(request, reason, error=error))
        return True

    def take_pending(self) -> list[RequestOutput]:
        """The final chunks of aborted requests not yet returned by ``step``."""
        pending, self._pending = self._pending, []
        return pending

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending) or self._inflight is not None

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns a chunk for every request that produced tokens or finished.

        With ``grammar_after_launch``, a step finishes the forward launched by the step before
        (if any), appends the tokens that cannot need the grammar to end their request,
        launches the next forward with the rest appended tentatively, then makes the grammar's
        verdicts on those (:meth:`_deferrable`) while it runs, and starts the launch's mask
        fills: a request the grammar ends there (a closing path, a rejected token,
        termination) has its rows of the launched step dropped."""
        outputs, self._pending = self._pending, []
        self._poll_grammars(outputs)
        launched, self._inflight = self._inflight, None
        if launched is not None:
            plan, t0 = launched.plan, launched.started
            try:
                result = self.strategy.finish(launched)
            except Exception as exc:  # a failed forward or sampler fails its batch
                return self._fail_batch(plan, exc, outputs)
        else:
            planned = self._plan()
            if planned is None:
                self._wait_for_grammars()
                return outputs
            plan, t0 = planned, _now()
            try:
                result = self.strategy.execute(plan)
            except Exception as exc:  # a failed forward or sampler fails its batch, not the engine
                return self._fail_batch(plan, exc, outputs)
        elapsed = _now() - t0
        self.scheduler.cache_computed(plan)  # the K/V it wrote is valid: share full prompt blocks
        appending: dict[int, tuple[Request, SeqOutcome]] = {}
        for i, (seq, outcome) in enumerate(zip(plan.seqs, result.outcomes)):
            request = seq.request
            if request.is_finished:  # ended since the launch (aborted, or by the grammar)
                self.num_dropped_rows += launched is not None
                continue
            timeline = request.timeline
            if seq.is_prefill:
                timeline.prefill_s += elapsed
            else:
                timeline.decode_s += elapsed
            fault = result.faults.get(i)
            if fault is not None:
                outputs.append(self._fail(request, fault))
            elif outcome is not None:
                appending[i] = (request, outcome)
        deferred = self._deferrable(appending)
        self._append_all({i: a for i, a in appending.items() if i not in deferred}, outputs)
        if deferred:
            self._launch_next(deferred)
            live = {i: a for i, a in deferred.items() if not a[0].is_finished}
            self._append_all(live, outputs)
            inflight = self._inflight
            if inflight is not None:
                try:
                    self.strategy.fill(inflight)
                except Exception as exc:  # as a failed step: its batch fails
                    self._inflight = None
                    return self._fail_batch(inflight.plan, exc, outputs)
        return outputs

    def _plan(self) -> StepPlan | None:
        """The next step's plan, counted (None: nothing to run)."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return None
        self.num_steps += 1
        self.num_preemptions += len(plan.preempted)
        return plan

    def _fail_batch(
        self, plan: StepPlan, exc: BaseException, outputs: list[RequestOutput]
    ) -> list[RequestOutput]:
        log.error("step failed", exc_info=exc)
        for seq in plan.seqs:
            if not seq.request.is_finished:
                out = self._finish(seq.request, FinishReason.ERROR, error=repr(exc))
                outputs.append(out)
        return outputs

    def _deferrable(
        self, appending: dict[int, tuple[Request, SeqOutcome]]
    ) -> dict[int, tuple[Request, SeqOutcome]]:
        """The appends that can wait behind the next launch (``grammar_after_launch``): those
        whose step tokens cannot end their request but through the grammar (no stop token,
        stop string, max_tokens or context end; unconstrained requests then go on for sure),
        when there are at least ``grammar_after_launch`` of them (else none)."""
        least = self.after_launch
        if least <= 0:
            return {}
        deferred: dict[int, tuple[Request, SeqOutcome]] = {}
        for i, (request, outcome) in appending.items():
            tokens = outcome.token_ids
            if (
                tokens
                and request.stop_watch is None
                and outcome.num_computed_tokens is None
                and self._stops(request).isdisjoint(tokens)
                and len(request.output_ids) + len(tokens) < request.sampling.max_tokens
                and request.num_tokens + len(tokens) < self.max_model_len
            ):
                deferred[i] = (request, outcome)
        return deferred if len(deferred) >= least else {}

    def _launch_next(self, deferred: dict[int, tuple[Request, SeqOutcome]]) -> None:
        """Plan and launch the next step with ``deferred``'s tokens appended for the plan
        (taken back after it: their appends come next, and put them back unless their request
        ends); the launch is told its matchers are behind by them. A launch that fails leaves
        the next step to plan again."""
        behind: dict[str, Sequence[int]] = {}
        for request, outcome in deferred.values():
            request.output_ids.extend(outcome.token_ids)
            behind[request.request_id] = outcome.token_ids
        try:
            plan = self._plan()
            if plan is not None:
                try:
                    self._inflight = self.strategy.launch(plan, behind=behind)
                except Exception as exc:  # as a failed step: its batch fails
                    self._fail_batch(plan, exc, self._pending)
        finally:
            for request, outcome in deferred.values():
                del request.output_ids[-len(outcome.token_ids) :]

    def _append_all(
        self, appending: dict[int, tuple[Request, SeqOutcome]], outputs: list[RequestOutput]
    ) -> None:
        """Append each request's outcome (by plan index): the runs accepted in one batch call,
        the closing decisions prepared together, the next tokens accepted together."""
        if not appending:
            return
        runs = self._accept_runs(appending)
        self._prepare_closing(appending, runs)
        started: dict[int, _Appending] = {}
        for i, (request, outcome) in appending.items():
            run = runs.get(i)
            if isinstance(run, BaseException):  # its grammar raised in the batch accept
                outputs.append(self._fail(request, run))
                continue
            try:
                started[i] = self._begin_append(request, outcome, run)
            except Exception as exc:  # this request's grammar: its fault alone
                outputs.append(self._fail(request, exc))
        faults = self._accept_firsts(started)
        for i, appending_one in started.items():
            try:
                if i in faults:
                    raise faults[i]
                outputs.append(self._end_append(appending_one))
            except Exception as exc:  # this request's grammar: its fault alone
                outputs.append(self._fail(appending_one.request, exc))

    def _fail(self, request: Request, exc: BaseException) -> RequestOutput:
        """End ``request`` alone for an exception its own grammar or sampler raised: a
        :class:`GrammarError` (its input's fault) is passed on typed for the server's
        INVALID_ARGUMENT; anything else is internal, and the message names only its type."""
        from espalier.constrained.errors import GrammarError

        if isinstance(exc, GrammarError):
            log.info("request %s ended by its grammar: %s", request.request_id, exc)
            return self._finish(request, FinishReason.ERROR, error=str(exc), exception=exc)
        log.error("request %s failed", request.request_id, exc_info=exc)
        error = f"internal error in this request's step: {type(exc).__name__}"
        return self._finish(request, FinishReason.ERROR, error=error)

    def _stops(self, request: Request) -> set[int]:
        """The request's stop token ids (made once: every step asks, per request)."""
        stops = request.stop_ids
        if stops is None:
            stops = set(request.sampling.stop_token_ids)
            if not request.sampling.ignore_eos:
                stops.update(self.tokenizer.stop_token_ids)
            request.stop_ids = stops
        return stops

    def _begin_append(self, request: Request, outcome: SeqOutcome, run: _Run | None) -> _Appending:
        """The first part of a request's append (:meth:`_append_all`): its run taken (``run``:
        its leading tokens the step's batch accept took, :meth:`_accept_runs`), and for a
        constrained request the closing decision on its next token made
        (``_Appending.decided``), which :meth:`_accept_firsts` then accepts with the batch's
        others."""
        if outcome.num_computed_tokens is not None:
            request.num_computed_tokens = outcome.num_computed_tokens
        if request.timeline.first_token is None:
            request.timeline.first_token = _now()
        stops = run.stops if run is not None else self._stops(request)
        appending = _Appending(request, outcome, stops)
        if run is not None:
            appending.start, appending.reason, appending.error = self._take_run(
                request, run, appending.new_ids, appending.text_ids
            )
        start, tokens = appending.start, outcome.token_ids
        if appending.reason is None and start < len(tokens) and request.matcher is not None:
            appending.closing = self.closer.instead(
                request, tokens[start], stops, self.max_model_len
            )
            appending.decided = True
        return appending

    def _accept_firsts(self, started: dict[int, _Appending]) -> dict[int, BaseException]:
        """What each constrained request of ``started`` goes on with after its run, accepted for
        the whole batch in one call per grammar library (``BatchFiller.accept_runs``): its next
        token when its decision kept it, else the closing path it emits instead (the stop token
        after it is accepted with the emit); sets ``_Appending.taken``. Returns the faults by
        key."""
        keys = [i for i, a in started.items() if a.decided]
        if not keys:
            return {}
        matchers = [started[i].request.matcher for i in keys]
        runs = [
            [a.outcome.token_ids[a.start]] if a.closing is None else a.closing
            for a in (started[i] for i in keys)
        ]
        counts, faults = self._batch.accept_runs(matchers, runs)  # type: ignore[arg-type]
        for k, i in enumerate(keys):
            started[i].taken = counts[k]
        return {keys[k]: exc for k, exc in faults.items()}

    def _end_append(self, appending: _Appending) -> RequestOutput:
        """The rest of a request's append, from the token past the run."""
        request, outcome, stops = appending.request, appending.outcome, appending.stops
        params = request.sampling
        new_ids, text_ids = appending.new_ids, appending.text_ids
        reason, error, start = appending.reason, appending.error, appending.start
        tokens = outcome.token_ids
        kept = len(tokens)  # model tokens emitted (logprobs align with these)
        for i in range(start, len(tokens) if reason is None else start):
            token = tokens[i]
            first = i == start and appending.decided  # decided and accepted in the batch
            if first:
                closing = appending.closing
            else:
                closing = self.closer.instead(request, token, stops, self.max_model_len)
            if closing is not None:
                kept = i
                taken = (appending.taken or 0) if first else 0
                self.closer.emit(request, closing, new_ids, text_ids, taken)
                request.closed_by_budget = True
                reason = FinishReason.STOP
                break
            request.output_ids.append(token)
            new_ids.append(token)
            matcher = request.matcher
            if first and appending.taken is not None:
                accepted = appending.taken == 1
            else:
                accepted = matcher is None or matcher.accept(token)
            if not accepted:
                reason, error = FinishReason.ERROR, _rejected(matcher, token)
                break
            if token in stops:
                reason = FinishReason.STOP
                break
            text_ids.append(token)
            if matcher is not None and matcher.is_terminated():
                reason = FinishReason.GRAMMAR
                break
            if len(request.output_ids) >= params.max_tokens or (
                request.num_tokens >= self.max_model_len
            ):
                reason = _length_reason(matcher)
                break
        self.num_generated_tokens += len(new_ids)
        watch = request.stop_watch
        if watch is not None and watch.push(text_ids) and reason is not FinishReason.ERROR:
            reason = FinishReason.STOP
        logprobs = tuple(outcome.logprobs[: min(kept, len(new_ids))])
        if params.logprobs and kept < len(new_ids):  # the closing path and its stop token
            logprobs += tuple(closing_logprob(t) for t in new_ids[kept:])
        if reason is None:
            return RequestOutput(request.request_id, "", tuple(new_ids), logprobs=logprobs)
        out = self._finish(request, reason, error=error)
        out.token_ids = tuple(new_ids)
        out.text_tokens = len(text_ids)
        out.logprobs = logprobs
        return out

    def _accept_runs(
        self, appending: dict[int, tuple[Request, SeqOutcome]]
    ) -> dict[int, _Run | BaseException]:
        """The leading tokens of each constrained request's step that cannot end it
        (:meth:`_plan_run`), accepted for the whole batch with one call per grammar library
        (``BatchFiller.accept_runs``); by the key of ``appending``, the run and its accepted
        count, or the exception the request's grammar raised (its fault alone)."""
        planned: dict[int, tuple[list[int], set[int]]] = {}
        results: dict[int, _Run | BaseException] = {}
        for i, (request, outcome) in appending.items():
            if request.matcher is None or len(outcome.token_ids) < 2:
                continue
            stops = self._stops(request)
            try:
                planned[i] = (self._plan_run(request, outcome.token_ids, stops), stops)
            except Exception as exc:  # its closing decisions: its grammar's fault
                results[i] = exc
        keys = [i for i, (head, _) in planned.items() if head]
        matchers = [appending[i][0].matcher for i in keys]
        counts, faults = self._batch.accept_runs(
            matchers,  # type: ignore[arg-type]  # constrained: matchers are set
            [planned[i][0] for i in keys],
        )
        for k, i in enumerate(keys):
            results[i] = faults[k] if k in faults else _Run(planned[i][0], counts[k], planned[i][1])
        for i, (head, stops) in planned.items():
            if not head:
                results[i] = _Run([], 0, stops)
        return results

    def _prepare_closing(
        self,
        appending: dict[int, tuple[Request, SeqOutcome]],
        runs: dict[int, _Run | BaseException],
    ) -> None:
        """The closing decisions the appends will make first, for all constrained requests at
        once (``BudgetCloser.prepare``: their searches in one native call): each one's first
        token past its accepted run."""
        items: list[tuple[Request, int, int, set[int]]] = []
        for i, (request, outcome) in appending.items():
            run = runs.get(i)
            if request.matcher is None or isinstance(run, BaseException):
                continue
            start = len(run.head) if run is not None else 0
            if run is not None and run.accepted < start:
                continue  # the grammar rejected a token of the run: no decision follows
            if start < len(outcome.token_ids):
                stops = run.stops if run is not None else self._stops(request)
                here = len(request.output_ids) + start  # the run is appended in ``_take_run``
                items.append((request, outcome.token_ids[start], here, stops))
        self.closer.prepare(items, self.max_model_len)

    def _plan_run(self, request: Request, tokens: Sequence[int], stops: set[int]) -> list[int]:
        """The leading tokens that can be appended as one run (no stop token, not the last
        one, before the budget's last token, none the closing policy must check): the same
        outcome as appending them one by one. The closing policy's memo is moved past them."""
        room = min(
            request.sampling.max_tokens - len(request.output_ids),
            self.max_model_len - request.num_tokens,
        )
        limit = min(len(tokens) - 1, room - 1)
        run = 0
        while run < limit and tokens[run] not in stops:
            run += 1
        if run < 2:
            return []
        # the closing policy's verdicts for these tokens, as one by one (memo updated)
        run = self.closer.pass_through(request, tokens[:run], self.max_model_len)
        return list(tokens[:run]) if run else []

    def _take_run(
        self, request: Request, run: _Run, new_ids: list[int], text_ids: list[int]
    ) -> tuple[int, FinishReason | None, str | None]:
        """Append a run the matcher has accepted ``run.accepted`` tokens of; returns how many
        tokens were taken, and a finish reason if the grammar ended or rejected one of them."""
        matcher = request.matcher
        assert matcher is not None
        head, accepted = run.head, run.accepted
        if not head:
            return 0, None, None
        taken = head[:accepted]
        request.output_ids.extend(taken)
        new_ids.extend(taken)
        text_ids.extend(taken)
        if accepted == len(head):
            if matcher.is_terminated():
                return accepted, FinishReason.GRAMMAR, None
            return accepted, None, None
        if matcher.is_terminated():  # it ended at the last accepted token (one by one: GRAMMAR)
            return accepted, FinishReason.GRAMMAR, None
        token = head[accepted]  # one by one, the rejected token is appended, then the error
        request.output_ids.append(token)
        new_ids.append(token)
        return accepted, FinishReason.ERROR, _rejected(matcher, token)

    def _finish(
        self,
        request: Request,
        reason: FinishReason,
        *,
        error: str | None = None,
        exception: BaseException | None = None,
    ) -> RequestOutput:
        """Free the request everywhere and build its final chunk (no tokens: the caller sets
        them)."""
        self.scheduler.finish(request)
        self._requests.pop(request.request_id, None)
        self.closer.forget(request.request_id)
        request.finish_reason = reason
        request.error = error
        request.timeline.finished = _now()
        return RequestOutput(
            request.request_id,
            "",
            (),
            finished=True,
            finish_reason=reason,
            usage=request.usage(),
            timings=request.timeline.to_timings(),
            error=error,
            weakened=request.weakened,
            backend=request.backend,
            closed_by_budget=request.closed_by_budget,
            speculative=request.spec_stats,
            exception=exception,
        )

    # -- grammars -----------------------------------------------------------------------------

    def _poll_grammars(self, outputs: list[RequestOutput]) -> None:
        """Give each request whose grammar Future finished its matcher (or its error): waiting
        ones, and running ones prefilled while their matcher was being made."""
        for request in list(self.scheduler.requests()):
            if not request.grammar_pending:
                continue
            future = request.grammar_future
            assert future is not None
            if not future.done():
                continue
            timeline = request.timeline
            timeline.compile_s = (timeline.grammar_ready or _now()) - timeline.arrival
            try:
                compiled, report, matcher = future.result()
            except Exception as exc:
                out = self._finish(request, FinishReason.ERROR, error=str(exc), exception=exc)
                outputs.append(out)
                continue
            request.compiled = compiled
            request.matcher = matcher
            if not report.cache_hit:
                timeline.compile_queue_s = report.queue_seconds
                timeline.compile_run_s = report.compile_seconds
            request.backend = report.backend
            request.weakened = tuple(report.weakened)
            if request.status is RequestStatus.WAITING_FOR_GRAMMAR:
                request.status = RequestStatus.WAITING

    def _wait_for_grammars(self, timeout_s: float = 0.02) -> None:
        """Nothing to run: block briefly until a compile finishes (instead of spinning)."""
        futures = [
            r.grammar_future
            for r in self.scheduler.requests()
            if r.grammar_pending and r.grammar_future is not None
        ]
        if futures:
            concurrent.futures.wait(
                futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED
            )

    # -- introspection ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        waiting = list(self.scheduler.waiting)
        compiling = sum(r.status is RequestStatus.WAITING_FOR_GRAMMAR for r in waiting)
        return {
            "running": self.scheduler.num_running,
            "waiting": len(waiting) - compiling,
            "compiling": compiling,
            "free_blocks": self.pool.num_free_blocks,
            "total_blocks": self.pool.num_blocks,
            "steps": self.num_steps,
            "dropped_rows": self.num_dropped_rows,
            "generated_tokens": self.num_generated_tokens,
            "preemptions": self.num_preemptions,
            "prefix_queried_tokens": self.scheduler.prefix_queried_tokens,
            "prefix_hit_tokens": self.scheduler.prefix_hit_tokens,
            "prefix_cached_blocks": self.pool.num_cached_blocks,
            "prefix_evictions": self.pool.num_evictions,
        }

    def close(self) -> None:
        self.strategy.close()
        self.grammar.close()


@dataclass
class _Appending:
    """A request's append between :meth:`EngineCore._begin_append` and ``_end_append``: the
    tokens taken so far (``new_ids``; of them ``text_ids``), where the rest starts, a finish
    reason already met; ``decided``: the closing decision on ``token_ids[start]`` is made,
    ``closing`` (None: keep the token); ``taken``: how much of that token or closing path the
    step's batch accept took (None: it was not accepted there)."""

    request: Request
    outcome: SeqOutcome
    stops: set[int]
    new_ids: list[int] = field(default_factory=list)
    text_ids: list[int] = field(default_factory=list)
    start: int = 0
    reason: FinishReason | None = None
    error: str | None = None
    decided: bool = False
    closing: list[int] | None = None
    taken: int | None = None


@dataclass(frozen=True)
class _Run:
    """A request's leading tokens of a step (``head``: empty when none), how many of them its
    matcher accepted, and its stop tokens."""

    head: list[int]
    accepted: int
    stops: set[int]


def _now() -> float:
    return time.perf_counter()


def _rejected(matcher: GrammarMatcher | None, token: int) -> str:
    """The error of a request whose grammar refused the token it sampled: its row filter's
    reason when the refusal was a dead end (``RowFilter.refusal``), else the token."""
    row_filter = None if matcher is None else matcher.row_filter
    why = None if row_filter is None else row_filter.refusal()
    return why if why is not None else f"the grammar rejected sampled token {token}"


def _length_reason(matcher: GrammarMatcher | None) -> FinishReason:
    """The reason for a request cut by max_tokens or the context: LENGTH unless its grammar
    cannot end here (the closing policy, off or without a path, left it open), so that a
    client never takes an unfinished constrained prefix for a complete output."""
    if matcher is None or matcher.can_terminate():
        return FinishReason.LENGTH
    return FinishReason.LENGTH_UNCLOSED


class Engine(EngineCore):
    """The core and its text in one process (``espalier generate --local``, tests, benches):
    :class:`EngineCore`'s chunks through the same
    :class:`~espalier.engine.output.OutputProcessor` that ``espalier serve``'s server process
    runs over the engine process's messages, so both give the same text and verdicts."""

    @functools.cached_property
    def output(self) -> OutputProcessor:
        """Made with the first request (it loads the post-validation's checkers)."""
        return OutputProcessor(
            self.tokenizer, self._compiled, postvalidate=self.config.postvalidate
        )

    def add_request(self, source: GenerationRequest) -> None:
        super().add_request(source)
        self.output.add(source)

    def step(self) -> list[RequestOutput]:
        return self.output.process(super().step())

    def take_pending(self) -> list[RequestOutput]:
        return self.output.process(super().take_pending())

    def _compiled(self, spec: GrammarSpec, options: ConstraintOptions) -> CompiledGrammar:
        """The request's compiled grammar again (a compile-cache hit), for post-validation
        by replay."""
        compiled: CompiledGrammar = self.grammar.submit(spec, options).result()[0]
        return compiled
