"""Prefix caching over the paged KV cache: the allocator's hash table and LRU, the hash chain,
and the engine end to end (greedy outputs identical with the cache on and off, for plain,
constrained and speculative requests, mixed batches, preemption and eviction)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import torch

from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import GenerationRequest, RequestOutput, SamplingParams
from espalier.engine.engine import Engine
from espalier.engine.kv_cache import BlockAllocator, NoFreeBlocksError
from espalier.engine.scheduler import prefix_block_hashes
from espalier.engine.spec.ngram import NgramConfig, NgramDrafter
from espalier.engine.spec.strategy import SpecConfig, install
from tests.fixtures.engine_fixtures import drain, make_engine, run_all, tokens_of

SYSTEM = "You are a careful assistant. Answer in JSON only, following the schema. " * 2
SCHEMA_A = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
SCHEMA_B = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0}, "tag": {"enum": ["x", "yy"]}},
    "required": ["tag", "n"],
    "additionalProperties": False,
}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """torch on one thread: results do not depend on the thread count, and the 2 CI cores are
    not fought over by the mask threads and the forwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- the allocator -------------------------------------------------------------------------------


def test_registered_blocks_are_found_shared_and_survive_their_owner() -> None:
    pool = BlockAllocator(4)
    keys = [b"k0", b"k1", b"k2"]
    blocks = pool.allocate(2)
    assert pool.lookup(keys) == []
    assert pool.register(blocks[0], keys[0]) and pool.register(blocks[1], keys[1])
    assert not pool.register(blocks[1], b"other")  # one key per block
    assert pool.lookup(keys) == blocks  # the run stops at the first miss (k2)
    assert pool.lookup([b"k1"]) == [blocks[1]]
    shared = pool.acquire(pool.lookup(keys))
    assert [pool.ref_count(b) for b in shared] == [2, 2]
    pool.free(blocks)
    pool.free(shared)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    assert pool.lookup(keys) == blocks  # free but still cached
    again = pool.acquire(blocks)  # a hit on free blocks takes them off the free list
    assert pool.num_free_blocks == 2 and [pool.ref_count(b) for b in again] == [1, 1]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    pool.free(again)


def test_allocation_evicts_least_recently_freed_cached_blocks_first() -> None:
    pool = BlockAllocator(3)
    a, b, c = pool.allocate(3)
    for block, key in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.register(block, key)
    pool.free([c, a, b])  # LRU order now: c, a, b
    assert pool.allocate(1) == [c]
    assert pool.num_evictions == 1 and pool.lookup([b"c"]) == []
    assert pool.lookup([b"a", b"b"]) == [a, b]
    assert pool.allocate(2) == [a, b] and pool.num_evictions == 3
    assert pool.num_cached_blocks == 0


def test_duplicate_key_and_bad_calls() -> None:
    pool = BlockAllocator(3)
    x, y = pool.allocate(2)
    assert pool.register(x, b"same")
    assert not pool.register(y, b"same")  # computed twice: the first copy is the cached one
    pool.free([y])
    with pytest.raises(ValueError):
        pool.acquire([y])  # not cached
    with pytest.raises(ValueError):
        pool.register(y, b"late")  # not allocated
    pool.free([x])
    with pytest.raises(ValueError):
        pool.fork([x])  # free cached blocks are shared by acquire, not fork


def test_hash_chain_keys_whole_prefixes() -> None:
    base = list(range(12))
    keys = prefix_block_hashes(base, 4)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert prefix_block_hashes(base + [99, 98], 4) == keys  # partial tail block: no key
    changed = [7] + base[1:]  # first block differs, the later blocks' tokens do not
    other = prefix_block_hashes(changed, 4)
    assert all(k != o for k, o in zip(keys, other))
    tail = base[:8] + [0, 0, 0, 0]
    assert (
        prefix_block_hashes(tail, 4)[:2] == keys[:2] and prefix_block_hashes(tail, 4)[2] != keys[2]
    )


# -- the engine ----------------------------------------------------------------------------------


def user_turns(n: int, *, greedy: bool = False, seed_offset: int = 0) -> list[GenerationRequest]:
    """``n`` requests sharing the system prompt; different user turns, grammars and sampling
    (seeded; ``greedy``: all greedy)."""
    grammars = [None, GrammarSpec.json_schema(SCHEMA_A), GrammarSpec.json_schema(SCHEMA_B)]
    out = []
    for i in range(n):
        sampling = SamplingParams(
            temperature=0.0 if greedy else [0.0, 0.0, 0.8][i % 4 % 3],
            seed=1000 + i + seed_offset,
            max_tokens=6 + (i * 5) % 14,
        )
        prompt = f"{SYSTEM}User {i}: tell me about item {i * 7}."
        rid = f"u{i + seed_offset}"
        out.append(
            GenerationRequest(rid, prompt=prompt, sampling=sampling, grammar=grammars[i % 3])
        )
    return out


def waves(engine: Engine, first: list[GenerationRequest], second: list[GenerationRequest]) -> Any:
    """Run ``first`` to completion, then ``second`` (which then finds the prefix cached)."""
    chunks = run_all(engine, first)
    chunks.update(run_all(engine, second))
    assert engine.pool.num_free_blocks == engine.pool.num_blocks  # nothing leaked
    return chunks


def assert_same_tokens(
    with_cache: dict[str, list[RequestOutput]], without: dict[str, list[RequestOutput]]
) -> None:
    assert with_cache.keys() == without.keys()
    for rid, chunks in without.items():
        assert tokens_of(with_cache[rid]) == tokens_of(chunks), rid


def final(chunks: list[RequestOutput]) -> RequestOutput:
    assert chunks[-1].finished
    return chunks[-1]


def test_waves_match_without_cache_and_report_cached_tokens() -> None:
    first, second = user_turns(3), user_turns(6, seed_offset=10)
    on = make_engine(max_num_batched_tokens=32)
    off = make_engine(max_num_batched_tokens=32, prefix_caching=False)
    with_cache, without = waves(on, first, second), waves(off, first, second)
    assert_same_tokens(with_cache, without)
    assert all(final(c).usage.cached_prompt_tokens == 0 for c in without.values())
    for request in second:  # the system prompt (tens of blocks of 4) came from the cache
        assert final(with_cache[request.request_id]).usage.cached_prompt_tokens >= 60
    stats = on.stats()
    assert stats["prefix_hit_tokens"] > 0 and stats["prefix_cached_blocks"] > 0
    assert off.stats()["prefix_hit_tokens"] == 0 and off.stats()["prefix_cached_blocks"] == 0


def test_all_at_once_mixed_batch_with_chunked_prefill_matches() -> None:
    requests = user_turns(9)
    on = make_engine(max_num_batched_tokens=24, max_num_seqs=5)
    off = make_engine(max_num_batched_tokens=24, max_num_seqs=5, prefix_caching=False)
    with_cache, without = run_all(on, requests), run_all(off, requests)
    assert_same_tokens(with_cache, without)
    assert on.stats()["prefix_hit_tokens"] > 0  # later admissions hit the earlier prefills


def test_different_schemas_on_one_prefix_follow_their_own_grammar() -> None:
    engine = make_engine(max_num_batched_tokens=64)
    prompt = SYSTEM + "User: reply."
    sampling = SamplingParams(max_tokens=40)
    a = GenerationRequest(
        "a", prompt=prompt, sampling=sampling, grammar=GrammarSpec.json_schema(SCHEMA_A)
    )
    chunks = run_all(engine, [a])
    b = GenerationRequest(
        "b", prompt=prompt, sampling=sampling, grammar=GrammarSpec.json_schema(SCHEMA_B)
    )
    a2 = GenerationRequest(
        "a2", prompt=prompt, sampling=sampling, grammar=GrammarSpec.json_schema(SCHEMA_A)
    )
    chunks.update(run_all(engine, [b, a2]))
    assert final(chunks["b"]).usage.cached_prompt_tokens > 0
    for rid, schema in (("a", SCHEMA_A), ("b", SCHEMA_B), ("a2", SCHEMA_A)):
        out = final(chunks[rid])
        text = "".join(c.text_delta for c in chunks[rid])
        jsonschema.validate(json.loads(text), schema)  # its own schema, from its first token
        assert out.validation is not None and out.validation.valid, rid
    assert tokens_of(chunks["a2"]) == tokens_of(chunks["a"])  # same prompt + grammar: same output


def test_prompt_of_whole_blocks_still_computes_its_last_token() -> None:
    engine = make_engine(block_size=4)
    prompt = list(range(10, 34))  # 24 tokens: 6 whole blocks
    make = lambda rid: GenerationRequest(  # noqa: E731
        rid, prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=5, ignore_eos=True)
    )
    first = run_all(engine, [make("p1")])["p1"]
    second = run_all(engine, [make("p2")])["p2"]
    assert tokens_of(second) == tokens_of(first)
    assert final(second).usage.cached_prompt_tokens == 20  # the last block is recomputed


def test_preemption_with_shared_blocks_matches() -> None:
    # 48 blocks of 4 tokens; prompts of ~152 tokens share ~36 blocks. Without the cache one
    # request runs at a time; with it several are admitted on the shared prefix, then their
    # decodes outgrow the cache: running requests are preempted and recompute over the prefix.
    requests = user_turns(8)
    # grammar backends warmed first: a process's first compiles (vocabulary views) hold the
    # grammar requests back while the others run, and then nothing is preempted
    run_all(make_engine(num_blocks=48, max_num_batched_tokens=32), user_turns(3))
    on = make_engine(num_blocks=48, max_num_batched_tokens=32)
    off = make_engine(num_blocks=48, max_num_batched_tokens=32, prefix_caching=False)
    with_cache, without = run_all(on, requests), run_all(off, requests)
    assert_same_tokens(with_cache, without)
    assert on.stats()["preemptions"] > 0 and on.stats()["prefix_hit_tokens"] > 0
    assert on.pool.num_free_blocks == on.pool.num_blocks


def test_eviction_under_a_tiny_cache_matches() -> None:
    # distinct long prefixes through a cache that holds about two of them: old ones are evicted
    def request(i: int, rep: int) -> GenerationRequest:
        prompt = f"Document {i}: " + f"fact {i} is {i * 13}; " * 12 + f"Question {rep}?"
        return GenerationRequest(
            f"d{i}-{rep}", prompt=prompt, sampling=SamplingParams(max_tokens=6)
        )

    order = [request(i % 4, rep) for rep in range(2) for i in range(4)] + [request(0, 5)]
    on = make_engine(num_blocks=70, max_num_batched_tokens=64, max_num_seqs=2)
    off = make_engine(
        num_blocks=70, max_num_batched_tokens=64, max_num_seqs=2, prefix_caching=False
    )
    with_cache: dict[str, list[RequestOutput]] = {}
    without: dict[str, list[RequestOutput]] = {}
    for r in order:  # one at a time: each admission sees what the previous ones left cached
        with_cache.update(run_all(on, [r]))
        without.update(run_all(off, [r]))
    assert_same_tokens(with_cache, without)
    stats = on.stats()
    assert stats["prefix_evictions"] > 0
    assert stats["prefix_cached_blocks"] <= on.pool.num_blocks


def test_speculative_requests_match_with_and_without_cache() -> None:
    def engine(prefix_caching: bool) -> Engine:
        built = make_engine(max_num_batched_tokens=48, prefix_caching=prefix_caching)
        config = SpecConfig(num_draft_tokens=5, mask_budget_s=None)
        install(built, config, {"ngram": NgramDrafter(NgramConfig(1, 3))})
        return built

    # greedy: speculative sampling is lossless in distribution, and a sampled token's accept
    # test can flip on last-bit logit differences between batch shapes
    first, second = user_turns(3, greedy=True), user_turns(6, greedy=True, seed_offset=20)
    on, off = engine(True), engine(False)
    with_cache, without = waves(on, first, second), waves(off, first, second)
    assert_same_tokens(with_cache, without)
    assert on.stats()["prefix_hit_tokens"] > 0
    assert any(final(c).speculative is not None for c in with_cache.values())
    on.close()
    off.close()


def test_abort_mid_prefill_leaves_cache_consistent() -> None:
    engine = make_engine(max_num_batched_tokens=8)
    victim, *rest = user_turns(3)
    engine.add_request(victim)
    engine.step()  # part of the prompt computed and cached
    engine.abort(victim.request_id)
    chunks = drain(engine)
    assert final(chunks[victim.request_id]).finish_reason is not None
    fresh = make_engine(max_num_batched_tokens=8, prefix_caching=False)
    for r in rest:
        assert tokens_of(run_all(engine, [r])[r.request_id]) == tokens_of(
            run_all(fresh, [r])[r.request_id]
        )
    assert engine.stats()["prefix_hit_tokens"] > 0
