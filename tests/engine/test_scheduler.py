"""Scheduler: token budget, chunked prefill, admission, preemption, FIFO, grammar waits, aborts."""

from __future__ import annotations

import random
from concurrent.futures import Future

from espalier.engine.api import SamplingParams
from espalier.engine.kv_cache import BlockAllocator
from espalier.engine.request import Request, RequestStatus
from espalier.engine.scheduler import Scheduler, SchedulerConfig, StepPlan

BLOCK = 4


def make(num_blocks: int = 32, **kw: int) -> tuple[Scheduler, BlockAllocator]:
    pool = BlockAllocator(num_blocks)
    cfg = SchedulerConfig(block_size=BLOCK, **kw)
    return Scheduler(cfg, pool, num_blocks), pool


_seq = 0


def req(prompt_len: int, max_tokens: int = 8, rid: str | None = None) -> Request:
    global _seq
    _seq += 1
    return Request(
        request_id=rid or f"r{_seq}",
        prompt_ids=list(range(1, prompt_len + 1)),
        sampling=SamplingParams(max_tokens=max_tokens),
        arrival_seq=_seq,
    )


def finish_step(sched: Scheduler, plan: StepPlan, token: int = 7) -> list[Request]:
    """What the engine does after a forward: append one token where sampled, finish at max."""
    done = []
    for s in plan.seqs:
        if s.samples:
            s.request.output_ids.append(token)
            if len(s.request.output_ids) >= s.request.sampling.max_tokens:
                sched.finish(s.request)
                done.append(s.request)
    return done


def check_blocks(sched: Scheduler, pool: BlockAllocator) -> None:
    held = [b for r in sched.requests() for b in r.block_table]
    assert len(held) == len(set(held)), "a block is owned twice"
    assert len(held) == pool.num_used_blocks
    for r in sched.requests():
        assert len(r.block_table) * BLOCK >= r.num_computed_tokens


def test_chunked_prefill_respects_budget() -> None:
    sched, _pool = make(max_num_batched_tokens=10)
    a = req(23)
    sched.add(a)
    chunks = []
    while True:
        plan = sched.schedule()
        assert plan.num_tokens <= 10
        chunks.append((plan.seqs[0].context_len, plan.seqs[0].num_new_tokens, plan.seqs[0].samples))
        finish_step(sched, plan)
        if a.output_ids:
            break
    assert chunks == [(0, 10, False), (10, 10, False), (20, 3, True)]
    assert plan.seqs[0].token_ids == [21, 22, 23]
    assert len(a.block_table) == 6  # ceil(23 / 4)
    plan = sched.schedule()  # decode: the sampled token
    assert [(s.context_len, s.num_new_tokens, s.samples) for s in plan.seqs] == [(23, 1, True)]
    assert plan.seqs[0].token_ids == [7]


def test_decodes_first_then_prefill_chunk_of_new_request() -> None:
    sched, _pool = make(max_num_batched_tokens=8)
    a, b = req(3), req(20)
    sched.add(a)
    finish_step(sched, sched.schedule())
    sched.add(b)
    plan = sched.schedule()
    assert [(s.request, s.num_new_tokens) for s in plan.seqs] == [(a, 1), (b, 7)]
    assert not plan.seqs[1].samples


def test_an_older_request_prefilling_never_holds_back_a_decode() -> None:
    # a is older (as after a preemption: recomputes keep their arrival order) but still prefills
    sched, _pool = make(max_num_batched_tokens=12)
    a, b = req(40), req(2)
    sched.add(b)
    sched.add(a)
    plan = sched.schedule()
    assert [(s.request, s.num_new_tokens) for s in plan.seqs] == [(b, 2), (a, 10)]
    finish_step(sched, plan)
    for chunk in (11, 11, 8):  # b decodes every step; a gets what is left of the budget
        plan = sched.schedule()
        assert [(s.request, s.num_new_tokens) for s in plan.seqs] == [(b, 1), (a, chunk)]
        finish_step(sched, plan)
    assert a.output_ids and len(b.output_ids) == 4


def test_max_num_seqs() -> None:
    sched, _ = make(max_num_seqs=2, max_num_batched_tokens=100)
    rs = [req(2) for _ in range(3)]
    for r in rs:
        sched.add(r)
    plan = sched.schedule()
    assert [s.request for s in plan.seqs] == rs[:2]
    assert rs[2].status is RequestStatus.WAITING


def test_admission_by_free_blocks_and_fifo() -> None:
    sched, pool = make(num_blocks=6, max_num_batched_tokens=100)
    big, small = req(16), req(2)  # big needs ceil(17/4)=5 blocks
    first = req(3)
    sched.add(first)
    finish_step(sched, sched.schedule())  # first holds 1 block, 5 free
    assert pool.num_free_blocks == 5
    sched.add(big)
    sched.add(small)
    plan = sched.schedule()
    # big needs 5 blocks for prompt + 1 token: admitted; 4 allocated now, 1 promised to it.
    assert [s.request for s in plan.seqs] == [first, big]
    assert pool.num_free_blocks == 1
    # small would take the block promised to big
    assert small.status is RequestStatus.WAITING


def test_ready_request_that_does_not_fit_blocks_later_ones() -> None:
    sched, _pool = make(num_blocks=4, max_num_batched_tokens=100)
    first = req(8)  # 2 blocks + 1 for its next token
    sched.add(first)
    finish_step(sched, sched.schedule())
    big, small = req(8), req(1)
    sched.add(big)
    sched.add(small)
    plan = sched.schedule()
    assert [s.request for s in plan.seqs] == [first]  # big does not fit; small waits behind it


def test_grammar_waiting_request_does_not_block_others() -> None:
    sched, _ = make()
    compiling, ready = req(4), req(4)
    fut: Future[None] = Future()
    compiling.grammar_future = fut
    compiling.status = RequestStatus.WAITING_FOR_GRAMMAR
    sched.add(compiling)
    sched.add(ready)
    plan = sched.schedule()
    assert [s.request for s in plan.seqs] == [ready]
    finish_step(sched, plan)
    compiling.status = RequestStatus.WAITING  # what the engine does when the Future is done
    plan = sched.schedule()
    assert [s.request for s in plan.seqs] == [ready, compiling]
    assert sched.running == [compiling, ready]  # FIFO order by arrival


def test_matcher_pending_prefills_all_but_the_last_token() -> None:
    """A compiled request whose matcher is still being made is admitted with the ready ones and
    computes its prompt but the last token; that token is fed (and sampled) once the matcher is
    there, as a one-token chunk next to the others' decodes. One still compiling waits."""
    sched, pool = make(max_num_batched_tokens=100)
    ready, pending, compiling = req(6), req(6), req(6)
    for r in (pending, compiling):
        r.grammar_future = Future()
        r.status = RequestStatus.WAITING_FOR_GRAMMAR
    pending.grammar_compiled = True
    for r in (ready, pending, compiling):
        sched.add(r)
    plan = sched.schedule()
    chunks = {s.request.request_id: (s.num_new_tokens, s.samples) for s in plan.seqs}
    assert chunks == {ready.request_id: (6, True), pending.request_id: (5, False)}
    finish_step(sched, plan)
    plan = sched.schedule()  # the matcher is not there yet: only the ready request decodes
    assert [(s.request, s.num_new_tokens) for s in plan.seqs] == [(ready, 1)]
    finish_step(sched, plan)
    pending.matcher = object()  # type: ignore[assignment]  # what the engine sets when done
    plan = sched.schedule()
    chunks = {s.request.request_id: (s.context_len, s.num_new_tokens, s.samples) for s in plan.seqs}
    assert chunks == {ready.request_id: (7, 1, True), pending.request_id: (5, 1, True)}
    assert compiling in sched.waiting and not compiling.block_table
    check_blocks(sched, pool)


def test_preemption_frees_newest_and_requeues_at_front() -> None:
    sched, pool = make(num_blocks=4, max_num_batched_tokens=100)
    a, b = req(4, max_tokens=20), req(4, max_tokens=20)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    finish_step(sched, plan)
    assert pool.num_free_blocks == 2  # each holds 1 block with 4 tokens
    plan = sched.schedule()  # each needs a 2nd block for token 5
    finish_step(sched, plan)
    assert pool.num_free_blocks == 0
    # advance until a needs a third block: b (newest) is preempted
    preempted: list[Request] = []
    for _ in range(10):
        plan = sched.schedule()
        check_blocks(sched, pool)
        preempted += plan.preempted
        finish_step(sched, plan)
        if preempted:
            break
    assert preempted == [b]
    assert b.status is RequestStatus.PREEMPTED and b.block_table == []
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.waiting[0] is b
    assert b.output_ids  # generated tokens are kept and recomputed later


def test_preempted_request_recomputes_prompt_and_output() -> None:
    sched, pool = make(num_blocks=5, max_num_batched_tokens=100)
    a, b = req(6, max_tokens=6), req(6, max_tokens=14)  # 12 and 20 tokens; 20 fit the cache
    sched.add(a)
    sched.add(b)
    seen_recompute = False
    for _ in range(200):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        check_blocks(sched, pool)
        for s in plan.seqs:
            if s.request is b and b.num_preemptions and s.context_len == 0:
                assert s.token_ids == b.prompt_ids + b.output_ids
                seen_recompute = True
        finish_step(sched, plan)
    assert not sched.has_unfinished()
    assert seen_recompute
    assert a.output_ids == [7] * 6 and b.output_ids == [7] * 14
    assert pool.num_free_blocks == 5


def test_abort_anywhere_frees_blocks() -> None:
    sched, pool = make(num_blocks=16, max_num_batched_tokens=6)
    a, b, c = req(10), req(10), req(3)
    c.status = RequestStatus.WAITING_FOR_GRAMMAR
    for r in (a, b, c):
        sched.add(r)
    sched.schedule()  # a mid-prefill
    assert a.block_table and a.status is RequestStatus.RUNNING
    sched.finish(a)  # abort while running mid-prefill
    sched.finish(c)  # abort while compiling
    assert a.status is RequestStatus.FINISHED and a.block_table == []
    assert c not in sched.waiting
    plan = sched.schedule()
    assert [s.request for s in plan.seqs] == [b]
    sched.finish(b)
    sched.finish(b)  # idempotent
    assert pool.num_free_blocks == 16 and not sched.has_unfinished()


def test_random_workload_no_leaks_nothing_lost() -> None:
    rng = random.Random(0)
    sched, pool = make(num_blocks=24, max_num_batched_tokens=16, max_num_seqs=6)
    all_requests: list[Request] = []
    aborted: set[Request] = set()
    for step in range(3000):
        if step < 400 and rng.random() < 0.3:
            r = req(rng.randint(1, 30), max_tokens=rng.randint(1, 25))
            if rng.random() < 0.2:
                r.status = RequestStatus.WAITING_FOR_GRAMMAR
            sched.add(r)
            all_requests.append(r)
        for r in list(sched.waiting):
            if r.status is RequestStatus.WAITING_FOR_GRAMMAR and rng.random() < 0.2:
                r.status = RequestStatus.WAITING
        if rng.random() < 0.03:
            live = [r for r in sched.requests()]
            if live:
                victim = rng.choice(live)
                sched.finish(victim)
                aborted.add(victim)
        plan = sched.schedule()
        assert plan.num_tokens <= 16
        assert len(plan.seqs) <= 6
        assert len({id(s.request) for s in plan.seqs}) == len(plan.seqs)
        for s in plan.seqs:
            assert len(s.request.block_table) * BLOCK >= s.context_len + s.num_new_tokens
        finish_step(sched, plan)
        check_blocks(sched, pool)
        if step > 400 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert pool.num_free_blocks == 24
    for r in all_requests:
        assert r.status is RequestStatus.FINISHED
        if r not in aborted:
            assert r.output_ids == [7] * r.sampling.max_tokens


def test_decode_lookahead_counts_draft_tree_tokens_against_the_budget() -> None:
    # a speculating decode verifies its draft tree in the same forward: a prefill chunk gets
    # only what the tree leaves of the budget
    sched, _pool = make(max_num_batched_tokens=12)
    a, b = req(3), req(20)
    sched.add(a)
    finish_step(sched, sched.schedule())
    sched.decode_lookahead = lambda r: 5 if r is a else 0
    sched.add(b)
    plan = sched.schedule()
    assert [(s.request, s.num_new_tokens) for s in plan.seqs] == [(a, 1), (b, 6)]
    # a tree larger than the budget still lets the decode run (the tree shrinks), nothing else
    finish_step(sched, plan)
    sched.decode_lookahead = lambda r: 50 if r is a else 0
    plan = sched.schedule()
    assert [(s.request, s.num_new_tokens) for s in plan.seqs] == [(a, 1)]
