"""Engine end to end on a tiny random Llama + the toy tokenizer: batching changes nothing,
preemption and aborts lose nothing and leak no blocks, constraints hold and post-validate."""

from __future__ import annotations

import json

import pytest

from espalier.constrained.spec import GrammarKind, GrammarSpec
from espalier.engine.api import (
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
)
from tests.fixtures.engine_fixtures import drain, make_engine, run_all, text_of, tokens_of

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "color"],
    "additionalProperties": False,
}

GRAMMARS: list[GrammarSpec | None] = [
    None,
    GrammarSpec.regex("(yes|no)-[0-9]{2,4}"),
    GrammarSpec.choice(["alpha", "beta", "gamma delta"]),
    GrammarSpec.json_schema(SCHEMA),
    GrammarSpec.ebnf('root ::= "a" [b-d]{1,6} "e"'),
]


def mixed_requests(n: int) -> list[GenerationRequest]:
    """Different prompt lengths, grammars and sampling settings; all seeded."""
    out = []
    for i in range(n):
        sampling = SamplingParams(
            temperature=[0.0, 1.0, 0.7][i % 3],
            top_k=[0, 0, 20][i % 3],
            top_p=[1.0, 0.9, 1.0][i % 3],
            min_p=[0.0, 0.0, 0.05][i % 3],
            seed=100 + i,
            max_tokens=8 + (i * 7) % 20,
        )
        prompt = "hello world, the quick brown fox " * (1 + i % 4) + str(i)
        out.append(
            GenerationRequest(f"r{i}", prompt=prompt, sampling=sampling, grammar=GRAMMARS[i % 5])
        )
    return out


@pytest.fixture(scope="module")
def alone_results() -> dict[str, list[int]]:
    """Each request run alone on a fresh engine (big budget: no chunking)."""
    results = {}
    for request in mixed_requests(10):
        engine = make_engine(max_num_batched_tokens=512)
        results[request.request_id] = tokens_of(run_all(engine, [request])[request.request_id])
    return results


@pytest.fixture(scope="module")
def concurrent_chunks() -> dict[str, list]:
    """All requests at once, small token budget (chunked prefill), few sequences per step."""
    engine = make_engine(max_num_batched_tokens=24, max_num_seqs=6)
    chunks = run_all(engine, mixed_requests(10))
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    return chunks


def test_concurrent_equals_alone_with_chunked_prefill(
    alone_results: dict[str, list[int]], concurrent_chunks: dict[str, list]
) -> None:
    for rid, want in alone_results.items():
        assert tokens_of(concurrent_chunks[rid]) == want, rid


def test_dense_head_without_mask_overlap_changes_nothing(
    alone_results: dict[str, list[int]],
) -> None:
    engine = make_engine(max_num_batched_tokens=512, sparse_head=False, overlap_masks=False)
    chunks = run_all(engine, mixed_requests(10))
    for rid, want in alone_results.items():
        assert tokens_of(chunks[rid]) == want, rid


def test_preemption_loses_nothing(alone_results: dict[str, list[int]]) -> None:
    # 34 blocks of 4 tokens: enough for the longest request alone (prompt 100 + 27 new tokens),
    # far less than the 10 requests need at once, so running requests must be preempted.
    engine = make_engine(num_blocks=34, max_num_batched_tokens=32)
    chunks = run_all(engine, mixed_requests(10))
    for rid, want in alone_results.items():
        assert tokens_of(chunks[rid]) == want, rid
        assert chunks[rid][-1].finished
    assert engine.pool.num_free_blocks == 34
    assert engine.stats()["preemptions"] > 0


def test_aborts_free_blocks_and_leave_others_intact(alone_results: dict[str, list[int]]) -> None:
    engine = make_engine(num_blocks=60, max_num_batched_tokens=16)
    requests = mixed_requests(10)
    for request in requests:
        engine.add_request(request)
    aborted = {"r1", "r4", "r7"}
    chunks: dict[str, list] = {}
    for step in range(10_000):
        if not engine.has_unfinished():
            break
        if step == 3:
            assert engine.abort("r1") and engine.abort("r4")
        if step == 9:
            assert engine.abort("r7")
        for out in engine.step():
            chunks.setdefault(out.request_id, []).append(out)
    assert not engine.abort("r7")  # already gone
    for rid, want in alone_results.items():
        last = chunks[rid][-1]
        assert last.finished
        if rid in aborted:
            assert last.finish_reason is FinishReason.ABORT
            assert want[: len(tokens_of(chunks[rid]))] == tokens_of(chunks[rid])
        else:
            assert tokens_of(chunks[rid]) == want, rid
    assert engine.pool.num_free_blocks == 60
    assert engine.stats()["running"] == 0


def test_constrained_outputs_match_and_postvalidate(concurrent_chunks: dict[str, list]) -> None:
    requests = [r for r in mixed_requests(10) if r.grammar is not None]
    for request in requests:
        chunks = concurrent_chunks[request.request_id]
        last, text = chunks[-1], text_of(chunks)
        assert last.backend
        if last.finish_reason is FinishReason.LENGTH_UNCLOSED:
            assert last.validation is not None and not last.validation.valid, text
            continue  # a random model may run out of tokens inside a long string
        assert last.finish_reason in (FinishReason.STOP, FinishReason.GRAMMAR), last
        assert last.validation is not None and last.validation.valid, (text, last.validation)
        assert request.grammar is not None
        if request.grammar.kind.value == "json_schema":
            assert set(json.loads(text)) == {"ok", "color"}
        elif request.grammar.kind.value == "choice":
            assert text in request.grammar.choices
    finished = [concurrent_chunks[r.request_id][-1].finish_reason for r in requests]
    assert finished.count(FinishReason.LENGTH_UNCLOSED) < len(requests) // 2


def test_stream_text_equals_token_text_and_usage() -> None:
    engine = make_engine()
    request = GenerationRequest(
        "u", prompt="the lazy dog", sampling=SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    )
    chunks = run_all(engine, [request])["u"]
    last = chunks[-1]
    assert last.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert last.usage is not None and last.usage.completion_tokens == len(tokens_of(chunks))
    assert last.usage.prompt_tokens == len(engine.tokenizer.hf.encode("the lazy dog"))
    ids = [t for t in tokens_of(chunks) if t not in engine.tokenizer.stop_token_ids]
    raw = b"".join(engine.tokenizer.token_bytes[t] for t in ids)
    assert text_of(chunks) == raw.decode("utf-8", errors="replace")
    assert last.timings is not None and last.timings.total_s >= last.timings.first_token_s > 0


def test_stop_strings_and_stop_tokens() -> None:
    engine = make_engine()
    base = GenerationRequest("a", prompt="abc", sampling=SamplingParams(max_tokens=30))
    base_chunks = run_all(engine, [base])["a"]
    full, first_tokens = text_of(base_chunks), tokens_of(base_chunks)
    assert len(full) > 4
    stop = full[2:4]
    req = GenerationRequest("b", prompt="abc", sampling=SamplingParams(max_tokens=30, stop=(stop,)))
    chunks = run_all(engine, [req])["b"]
    assert chunks[-1].finish_reason is FinishReason.STOP
    assert text_of(chunks) == full[: full.index(stop)]
    stop_id = first_tokens[1]
    req = GenerationRequest(
        "d", prompt="abc", sampling=SamplingParams(max_tokens=30, stop_token_ids=(stop_id,))
    )
    chunks = run_all(engine, [req])["d"]
    assert chunks[-1].finish_reason is FinishReason.STOP
    assert tokens_of(chunks) == first_tokens[: first_tokens.index(stop_id) + 1]


def test_invalid_requests_are_refused() -> None:
    engine = make_engine(num_blocks=8)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(
            GenerationRequest("x", prompt="a", sampling=SamplingParams(top_p=0.0, max_tokens=0))
        )
    assert {f for f, _ in info.value.violations} == {"top_p", "max_tokens"}
    with pytest.raises(InvalidRequestError):
        engine.add_request(GenerationRequest("y", prompt="abcdefgh " * 20))  # > 32 tokens cache
    engine.add_request(GenerationRequest("z", prompt="a"))
    with pytest.raises(InvalidRequestError):
        engine.add_request(GenerationRequest("z", prompt="b"))
    drain(engine)


def test_bad_grammar_fails_typed_without_blocking_others() -> None:
    from espalier.constrained.errors import GrammarError

    engine = make_engine()
    bad = GenerationRequest("bad", prompt="a", grammar=GrammarSpec(GrammarKind.REGEX, "(unclosed"))
    good = GenerationRequest("good", prompt="a", sampling=SamplingParams(max_tokens=5))
    chunks = run_all(engine, [bad, good])
    last = chunks["bad"][-1]
    assert last.finish_reason is FinishReason.ERROR
    assert isinstance(last.exception, GrammarError)
    assert len(tokens_of(chunks["good"])) == 5
