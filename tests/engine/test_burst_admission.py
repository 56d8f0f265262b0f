"""A burst of constrained requests prefills together even while their matchers are being made.

Each request's own matcher is made on the grammar service's two matcher threads, so a burst's
matchers come one after another; a request whose grammar compiled is admitted anyway and its
prompt computed but the last token (``Request.num_feedable_tokens``), which is fed, and
sampled, once its matcher is there. Before issue 28 such a burst was admitted in waves (one
eager prefill step per wave, mixed with the first wave's decodes). Outputs are unchanged.
"""

from __future__ import annotations

import threading

from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import GenerationRequest, SamplingParams
from tests.fixtures.engine_fixtures import drain, make_engine, run_all, tokens_of

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
}
GRAMMARS = [
    GrammarSpec.json_schema(SCHEMA),
    GrammarSpec.regex("(yes|no)-[0-9]{2,4}"),
    GrammarSpec.ebnf('root ::= "a" [b-d]{1,6} "e"'),
]


def burst() -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"b{i}",
            prompt="the quick brown fox " * (1 + i % 3) + str(i),
            sampling=SamplingParams(temperature=0.0, max_tokens=12),
            grammar=GRAMMARS[i % len(GRAMMARS)],
        )
        for i in range(6)
    ]


def test_burst_prefills_in_one_step_while_matchers_are_made() -> None:
    want = {r: tokens_of(c) for r, c in run_all(make_engine(), burst()).items()}
    engine = make_engine(max_num_batched_tokens=512)
    requests = burst()
    for request in requests:  # compiled and cached: only the matchers are left to make
        engine.grammar.submit(request.grammar, request.constraint).result(timeout=60)
    gate = threading.Event()
    pool = engine.grammar._matcher_pool()
    held = [pool.submit(gate.wait) for _ in range(2)]  # both matcher threads busy
    try:
        for request in requests:
            engine.add_request(request)
        assert engine.step() == []  # one step: every prompt computed, nothing sampled yet
        assert engine.num_steps == 1
        running = engine.scheduler.running
        assert len(running) == len(requests)
        assert all(r.num_computed_tokens == r.num_prompt_tokens - 1 for r in running)
        assert engine.step() == [] and engine.num_steps == 1  # nothing may run without matchers
    finally:
        gate.set()
    for future in held:
        future.result(timeout=60)
    chunks = drain(engine)
    assert {r: tokens_of(c) for r, c in chunks.items()} == want
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
