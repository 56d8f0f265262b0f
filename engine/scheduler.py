"""Continuous batching with chunked prefill, admission by free KV blocks and recompute preemption.

Pure python (no torch). Each :meth:`Scheduler.schedule` call plans one forward step under a
token budget, in three passes:

1. running requests that decode (one uncomputed token), oldest first, so a long prefill never
   holds a decode back; a decode costs 1 + ``decode_lookahead(request)`` budget tokens (a
   speculative strategy's draft-tree nodes, verified in the same forward);
2. running requests still prefilling (a chunked prompt, or a recompute after preemption), oldest
   first, each getting the chunk that fits in the budget left;
3. waiting requests in FIFO order while the budget, ``max_num_seqs`` and free blocks allow.

When a running request needs a block and none is free, the newest running request not yet
planned this step is preempted (possibly the request itself): its blocks are freed and it goes
back to the front of the waiting queue to be recomputed.

A request whose grammar is still compiling (``WAITING_FOR_GRAMMAR``) keeps its queue position but is
skipped, so it never blocks the requests behind it. One whose grammar compiled but whose own
matcher is still being made (``Request.grammar_pending``) is admitted like a ready one, but fed
its prompt only up to the last token (``Request.num_feedable_tokens``): the last token's logits
need the matcher. So a burst of constrained requests prefills together in one step, whatever
order its matchers come in, and each request's last prompt token later joins a decode step
(a one-token step: a CUDA-graph replay) once its matcher is there. The engine flips a waiting
request to ``WAITING`` once its grammar Future is done.

The scheduler owns the block tables: it allocates blocks from a :class:`BlockPool` (the KV cache's
allocator) and frees them on finish, abort and preemption.

Prefix cache (``SchedulerConfig.prefix_caching``): a request admitted with no blocks takes the
cached blocks of the longest run of its prompt's full blocks (keys: :func:`prefix_block_hashes`)
and computes only the rest, at least one token (so the step has logits). After each successful
forward, :meth:`Scheduler.cache_computed` registers the prompt blocks the step completed. Only
prompt blocks are cached: they are written once, by a causal prefill; generated tokens' K/V may
come from draft-tree verification (compacted into place) or be followed by a closing path that
was never fed, so their blocks stay private. A hit shares K/V only: grammar state is per request.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from espalier.engine.request import Request, RequestStatus


class BlockPool(Protocol):
    """The KV block allocator as the scheduler sees it (``engine/kv_cache.py`` provides it)."""

    @property
    def num_free_blocks(self) -> int: ...

    def allocate(self, n: int) -> list[int]:
        """``n`` free block ids; raises if fewer are free."""
        ...

    def free(self, blocks: Sequence[int]) -> None: ...

    def ref_count(self, block: int) -> int: ...

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Cached blocks of the longest run of ``hashes`` from the start."""
        ...

    def acquire(self, blocks: Sequence[int]) -> list[int]:
        """One more reference to each looked-up block (free ones leave the free list)."""
        ...

    def register(self, block: int, key: bytes) -> bool:
        """Make a fully computed block findable under ``key``."""
        ...


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits.

    max_num_seqs: most requests running at once.
    max_num_batched_tokens: token budget of one forward step (prefill chunks + decodes).
    block_size: tokens per KV block (must equal the cache's).
    admission_watermark_blocks: free blocks kept in reserve when admitting a new request, so that
        running requests can keep decoding without preempting it right away.
    prefix_caching: reuse cached K/V blocks of identical prompt prefixes (module docstring).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    admission_watermark_blocks: int = 0
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.block_size < 1:
            raise ValueError(f"invalid scheduler config {self}")


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step.

    context_len: tokens already in the cache before this step.
    num_new_tokens: known tokens fed this step (``token_ids``), at cache indices
        ``context_len .. context_len + num_new_tokens - 1``.
    samples: the chunk reaches the last known token, so the step yields logits to sample from.
    """

    request: Request
    context_len: int
    num_new_tokens: int
    samples: bool

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_slice(self.context_len, self.context_len + self.num_new_tokens)

    @property
    def is_prefill(self) -> bool:
        """Feeds prompt tokens (first pass or recompute after preemption)."""
        return self.context_len < self.request.num_prompt_tokens


@dataclass
class StepPlan:
    """What one forward step runs. ``preempted`` lost their blocks during planning."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    """Owns the waiting queue, the running set and every request's block table."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, num_blocks: int) -> None:
        self.config = config
        self.pool = pool
        self.num_blocks = num_blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival_seq: oldest first
        self._running_keys: list[int] = []
        # extra tokens a decoding request feeds beyond its one known token (a speculative
        # strategy's draft tree): they count against the step's token budget
        self.decode_lookahead: Callable[[Request], int] | None = None
        # prefix cache: prompt tokens of admissions, and those found cached
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    # -- queue management ---------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole cache holds: one request can never grow past this."""
        return self.num_blocks * self.config.block_size

    def add(self, request: Request) -> None:
        """Queue a new request (``WAITING`` or ``WAITING_FOR_GRAMMAR``) at the back."""
        assert request.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_GRAMMAR)
        self.waiting.append(request)

    def finish(self, request: Request) -> None:
        """Remove a request from wherever it is and free its blocks (finish or abort)."""
        if request.status is RequestStatus.RUNNING:
            self._remove_running(request)
        elif request.status is not RequestStatus.FINISHED:
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
        self._free_blocks(request)
        request.status = RequestStatus.FINISHED

    def requests(self) -> Iterator[Request]:
        """Every unfinished request: running, then waiting."""
        yield from self.running
        yield from self.waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    # -- planning -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan one step; allocates the blocks it needs and advances ``num_computed_tokens``."""
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        planned: set[int] = set()  # id() of the requests planned so far
        budget = self._schedule_running(plan, budget, planned, decodes=True)
        budget = self._schedule_running(plan, budget, planned, decodes=False)
        if not plan.preempted:
            self._schedule_waiting(plan, budget)
        return plan

    def _schedule_running(
        self, plan: StepPlan, budget: int, planned: set[int], *, decodes: bool
    ) -> int:
        """One pass over the running requests, oldest first: the decoding ones (``decodes``) or
        the prefilling ones; returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            uncomputed = request.num_uncomputed_tokens
            feedable = request.num_feedable_tokens  # its last token waits for its matcher
            if id(request) in planned or feedable <= 0 or (uncomputed == 1) != decodes:
                i += 1  # planned already, nothing to feed (yet), or the other pass's
                continue
            n = min(feedable, budget)
            if not self._grow(request, request.num_computed_tokens + n, plan, planned):
                break  # it preempted itself: every unplanned request after it is gone too
            plan.seqs.append(self._commit(request, n))
            planned.add(id(request))
            extra = self.decode_lookahead(request) if decodes and self.decode_lookahead else 0
            budget -= min(budget, n + extra)
            i += 1
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        now = time.perf_counter()
        # blocks promised this step to admitted requests' whole prompts but not allocated yet
        promised = 0
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if request.status is RequestStatus.WAITING_FOR_GRAMMAR and not request.grammar_compiled:
                continue  # keeps its place, blocks nobody
            hits = self._cached_prefix(request)
            start = request.num_computed_tokens + len(hits) * self.config.block_size
            # a request whose matcher is being made computes its prompt but the last token
            n = min(request.num_tokens - start - int(request.grammar_pending), budget)
            if n <= 0:
                continue  # nothing to feed before its matcher: keeps its place
            held = len(request.block_table) + len(hits)
            whole = self._blocks_for(request.num_tokens + 1) - held
            # cached blocks nobody holds count as free now, but the hit takes them
            free = self.pool.num_free_blocks - promised
            free -= sum(self.pool.ref_count(b) == 0 for b in hits)
            # FIFO: a ready request that does not fit holds back the ones behind it, unless
            # nothing runs (then only the blocks for its first chunk are required).
            if whole + self.config.admission_watermark_blocks > free and (
                self.running or self._blocks_for(start + n) - held > free
            ):
                return
            self.waiting.remove(request)
            self._insert_running(request)
            request.status = RequestStatus.RUNNING
            self._take_prefix(request, hits)
            if request.timeline.first_scheduled is None:
                request.timeline.first_scheduled = now
            planned = {id(s.request) for s in plan.seqs}
            ok = self._grow(request, request.num_computed_tokens + n, plan, planned)
            assert ok, "admission checked the free blocks"
            plan.seqs.append(self._commit(request, n))
            promised += max(self._blocks_for(request.num_tokens + 1) - len(request.block_table), 0)
            budget -= n

    def _cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks for the start of a request admitted without blocks (none when prefix
        caching is off): at most its prompt's full blocks, and never its last known token."""
        if not self.config.prefix_caching or request.block_table:
            return []
        size = self.config.block_size
        if request.prompt_block_hashes is None:
            request.prompt_block_hashes = prefix_block_hashes(request.prompt_ids, size)
        limit = (request.num_tokens - 1) // size
        return self.pool.lookup(request.prompt_block_hashes[:limit])

    def _take_prefix(self, request: Request, hits: list[int]) -> None:
        """Admit ``request`` onto its cached prefix ``hits`` (from :meth:`_cached_prefix`)."""
        if not self.config.prefix_caching:
            return
        cached = len(hits) * self.config.block_size
        if hits:
            request.block_table = self.pool.acquire(hits)
            request.num_computed_tokens = cached
        if request.timeline.first_scheduled is None:
            request.num_cached_tokens = cached
        self.prefix_queried_tokens += request.num_prompt_tokens
        self.prefix_hit_tokens += cached

    def cache_computed(self, plan: StepPlan) -> None:
        """After ``plan``'s forward succeeded: register the full prompt blocks it computed, so
        later requests can share them. Requests the step finished are skipped."""
        if not self.config.prefix_caching:
            return
        size = self.config.block_size
        for seq in plan.seqs:
            request, hashes = seq.request, seq.request.prompt_block_hashes
            if hashes is None or request.is_finished:
                continue
            end = min(seq.context_len + seq.num_new_tokens, len(hashes) * size)
            for i in range(seq.context_len // size, end // size):
                self.pool.register(request.block_table[i], hashes[i])

    def _commit(self, request: Request, n: int) -> ScheduledSeq:
        context = request.num_computed_tokens
        request.num_computed_tokens += n
        return ScheduledSeq(request, context, n, samples=request.num_uncomputed_tokens == 0)

    # -- blocks -------------------------------------------------------------------------------

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _grow(self, request: Request, num_tokens: int, plan: StepPlan, planned: set[int]) -> bool:
        """Give ``request`` blocks for ``num_tokens`` cache entries, preempting the newest running
        requests not in ``planned`` while short. False when ``request`` itself had to be
        preempted."""
        need = self._blocks_for(num_tokens) - len(request.block_table)
        while need > self.pool.num_free_blocks:
            victim = next(r for r in reversed(self.running) if id(r) not in planned)
            self._preempt(victim, plan)
            if victim is request:
                return False
        if need > 0:
            request.block_table.extend(self.pool.allocate(need))
        return True

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self._remove_running(request)
        self._free_blocks(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        plan.preempted.append(request)

    def _free_blocks(self, request: Request) -> None:
        if request.block_table:  # tail first: its cached prefix is evicted last
            self.pool.free(request.block_table[::-1])
            request.block_table = []

    def _insert_running(self, request: Request) -> None:
        i = bisect.bisect(self._running_keys, request.arrival_seq)
        self._running_keys.insert(i, request.arrival_seq)
        self.running.insert(i, request)

    def _remove_running(self, request: Request) -> None:
        i = self.running.index(request)
        del self.running[i]
        del self._running_keys[i]


def prefix_block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Prefix-cache keys of the full blocks of ``tokens`` (a partial tail block has none).

    Hash chain: a block's key is SHA-256 of its predecessor's key and its token ids, so equal keys
    mean equal whole prefixes up to the block's end, with no token-by-token compare."""
    keys = []
    parent = b""
    for i in range(len(tokens) // block_size):
        chunk = array("q", tokens[i * block_size : (i + 1) * block_size]).tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        keys.append(parent)
    return keys
