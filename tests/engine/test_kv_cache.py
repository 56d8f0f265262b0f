"""Block allocator (free list, ref counts, fork/free, no leaks) and the KV tensors' copy helpers."""

from __future__ import annotations

import random

import pytest
import torch

from espalier.engine.config import CacheConfig, ModelConfig
from espalier.engine.kv_cache import BlockAllocator, KVCache, NoFreeBlocksError, blocks_needed


def test_allocate_and_free_returns_every_block() -> None:
    allocator = BlockAllocator(8)
    a = allocator.allocate(3)
    b = allocator.allocate(5)
    assert len(set(a) | set(b)) == 8 and allocator.num_free_blocks == 0
    assert all(allocator.ref_count(x) == 1 for x in a + b)
    with pytest.raises(NoFreeBlocksError):
        allocator.allocate(1)
    allocator.free(a)
    assert allocator.num_free_blocks == 3 and allocator.can_allocate(3)
    assert not allocator.can_allocate(4)
    allocator.free(b)
    assert allocator.num_free_blocks == 8 and allocator.num_used_blocks == 0


def test_failed_allocation_takes_nothing() -> None:
    allocator = BlockAllocator(4)
    allocator.allocate(3)
    with pytest.raises(NoFreeBlocksError):
        allocator.allocate(2)
    assert allocator.num_free_blocks == 1


def test_fork_shares_until_last_owner_frees() -> None:
    allocator = BlockAllocator(4)
    parent = allocator.allocate(2)
    child = allocator.fork(parent)
    assert child == parent
    assert all(allocator.ref_count(x) == 2 and allocator.is_shared(x) for x in parent)
    allocator.free(parent)
    assert allocator.num_free_blocks == 2
    assert all(allocator.ref_count(x) == 1 and not allocator.is_shared(x) for x in child)
    allocator.free(child)
    assert allocator.num_free_blocks == 4


def test_double_free_and_fork_of_free_block_raise() -> None:
    allocator = BlockAllocator(2)
    blocks = allocator.allocate(1)
    allocator.free(blocks)
    with pytest.raises(ValueError):
        allocator.free(blocks)
    with pytest.raises(ValueError):
        allocator.fork(blocks)
    assert allocator.num_free_blocks == 2


def test_free_first_blocks_are_reused_before_cached_ones_are_evicted() -> None:
    pool = BlockAllocator(4)
    cached = pool.allocate(2)
    assert pool.register(cached[0], b"k0") and pool.register(cached[1], b"k1")
    pool.free(cached[::-1])  # free and findable: the LRU order is now [2, 3, 1, 0]
    scratch = pool.allocate(2)
    assert scratch == [2, 3]
    pool.free_first(scratch)
    assert pool.allocate(2) == [2, 3]  # the scratch blocks again, not an eviction
    assert pool.num_evictions == 0 and pool.lookup([b"k0", b"k1"]) == cached
    with pytest.raises(ValueError):
        pool.free_first(pool.acquire([cached[0]]))  # cached: its K/V is worth keeping
    shared = pool.fork([2])
    with pytest.raises(ValueError):
        pool.free_first(shared)


def test_random_workload_never_leaks() -> None:
    """Random allocate / fork / free / grow against a reference count model."""
    rng = random.Random(0)
    allocator = BlockAllocator(64)
    owners: list[list[int]] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.35 and allocator.can_allocate(3):
            owners.append(allocator.allocate(rng.randint(0, 3)))
        elif op < 0.5 and owners:
            owners.append(allocator.fork(rng.choice(owners)))
        elif op < 0.65 and owners and allocator.can_allocate(1):
            rng.choice(owners).extend(allocator.allocate(1))
        elif owners:
            allocator.free(owners.pop(rng.randrange(len(owners))))
        expected: dict[int, int] = {}
        for blocks in owners:
            for x in blocks:
                expected[x] = expected.get(x, 0) + 1
        assert allocator.num_free_blocks == 64 - len(expected)
        assert all(allocator.ref_count(x) == n for x, n in expected.items())
    for blocks in owners:
        allocator.free(blocks)
    assert allocator.num_free_blocks == 64


def test_blocks_needed() -> None:
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def tiny_config() -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
    )


def test_kv_tensors_layout_write_and_copies() -> None:
    cache = KVCache.allocate(
        tiny_config(),
        CacheConfig(block_size=4, num_blocks=6),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    assert cache.num_layers == 2 and cache.num_blocks == 6
    assert cache.k[0].shape == (6, 4, 1, 4)
    values = torch.arange(3 * 4, dtype=torch.float32).view(3, 1, 4)
    cache.write(1, torch.tensor([5, 9, 22]), values, -values)
    assert torch.equal(cache.k[1][1, 1], values[0]) and torch.equal(cache.v[1][5, 2], -values[2])
    assert not cache.k[0].any()
    cache.copy_slots([9, 22], [0, 1])  # slot = block * 4 + offset
    assert torch.equal(cache.k[1][0, 0], values[1]) and torch.equal(cache.v[1][0, 1], -values[2])
    cache.copy_blocks([1], [4])
    assert torch.equal(cache.k[1][4], cache.k[1][1]) and torch.equal(cache.v[1][4], cache.v[1][1])


def test_num_blocks_from_memory_budget() -> None:
    config = tiny_config()
    per_block = 2 * 2 * 4 * 1 * 4 * 4  # k+v, layers, block, kv heads, head dim, fp32 bytes
    cache = KVCache.allocate(
        config,
        CacheConfig(block_size=4, cpu_memory_bytes=per_block * 7 + 5),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    assert cache.num_blocks == 7
