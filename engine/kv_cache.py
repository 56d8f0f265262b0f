"""Paged KV cache: a pure-python block allocator and the per-layer K/V tensors.

Layout (shared with the attention backends, flashinfer's "NHD" paged layout):
``k[layer], v[layer]``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype on
the runner's device. Physical slot ``s = block * block_size + offset``; a sequence's cache index
``i`` lives in block ``block_table[i // block_size]`` at offset ``i % block_size``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from espalier.engine.config import CacheConfig, ModelConfig


class NoFreeBlocksError(RuntimeError):
    """The allocator cannot satisfy a request; the scheduler should preempt or wait."""


class BlockAllocator:
    """Free list + reference counts over ``num_blocks`` block ids, with a prefix cache. No torch.

    ``allocate`` hands out blocks with ref count 1; ``fork`` shares blocks (ref count + 1);
    ``free`` drops one reference and returns a block to the free list when none remain.

    Prefix cache: a full block whose K/V is computed can be ``register``-ed under its key (the
    scheduler's ``prefix_block_hashes``). It stays findable (``lookup``) while referenced and
    after its last owner frees it: a free cached block keeps its K/V until ``allocate`` reuses
    it. The free list is in LRU order (least recently freed first), so ``allocate`` evicts the
    cached blocks unused the longest. ``acquire`` takes a reference to looked-up blocks, free or
    not. A registered block is read-only for every owner: only the writer of a block registers
    it, and only once every entry of it is computed.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))  # insertion order = LRU
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out: never used, or free and cached (evictable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by ``lookup`` (referenced or free)."""
        return len(self._block_of)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (ref count 1 each), evicting the least recently freed cached blocks;
        raises ``NoFreeBlocksError`` if fewer are free."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            b = next(iter(self._free))
            del self._free[b]
            key = self._hash_of.pop(b, None)
            if key is not None:
                del self._block_of[key]
                self.num_evictions += 1
            self._refs[b] = 1
            blocks.append(b)
        return blocks

    def fork(self, blocks: Iterable[int]) -> list[int]:
        """Share ``blocks`` with another owner: one more reference each; returns them as a list."""
        shared = list(blocks)
        for b in shared:
            if self._refs[b] <= 0:
                raise ValueError(f"fork of unallocated block {b}")
            self._refs[b] += 1
        return shared

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; a block with no references goes back to the pool,
        at the end of the LRU order (pass a sequence's blocks tail first: its prefix lasts)."""
        for b in blocks:
            refs = self._refs[b]
            if refs <= 0:
                raise ValueError(f"double free of block {b}")
            self._refs[b] = refs - 1
            if refs == 1:
                self._free[b] = None

    def free_first(self, blocks: Sequence[int]) -> None:
        """Free blocks whose K/V nobody will look up (never registered, e.g. scratch): they go
        to the head of the LRU order, so the next ``allocate`` reuses them before evicting a
        cached block."""
        for b in blocks:
            if self._refs[b] != 1 or b in self._hash_of:
                raise ValueError(f"free_first of shared or cached block {b}")
        for b in blocks:
            self._refs[b] = 0
        self._free = dict.fromkeys([*blocks, *self._free])

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def is_shared(self, block: int) -> bool:
        """True when more than one owner holds ``block`` (a write needs copy-on-write first)."""
        return self._refs[block] > 1

    # -- prefix cache -------------------------------------------------------------------------

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """Cached blocks of the longest run of ``hashes`` found from the start (no side effect)."""
        found = []
        for key in hashes:
            b = self._block_of.get(key)
            if b is None:
                break
            found.append(b)
        return found

    def acquire(self, blocks: Iterable[int]) -> list[int]:
        """One more reference to each cached block (a free one leaves the free list)."""
        taken = list(blocks)
        for b in taken:
            if b not in self._hash_of:
                raise ValueError(f"acquire of uncached block {b}")
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1
        return taken

    def register(self, block: int, key: bytes) -> bool:
        """Make the allocated, fully computed ``block`` findable under ``key``; False (nothing
        done) when the block or the key is cached already (another owner computed it too)."""
        if self._refs[block] <= 0:
            raise ValueError(f"register of unallocated block {block}")
        if block in self._hash_of or key in self._block_of:
            return False
        self._hash_of[block] = key
        self._block_of[key] = block
        return True


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks covering ``num_tokens`` cache entries."""
    return -(-num_tokens // block_size)


@dataclass
class KVCache:
    """Per-layer K and V tensors, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_size: int

    @property
    def num_blocks(self) -> int:
        return int(self.k[0].shape[0])

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @classmethod
    def allocate(
        cls,
        model: ModelConfig,
        cache: CacheConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> KVCache:
        """Zeroed tensors; ``num_blocks`` from ``cache`` or sized from available memory."""
        per_block = (
            2 * model.num_layers * cache.block_size * model.num_kv_heads * model.head_dim
        ) * torch.empty((), dtype=dtype).element_size()
        num_blocks = cache.num_blocks or _blocks_from_memory(cache, per_block, device)
        shape = (num_blocks, cache.block_size, model.num_kv_heads, model.head_dim)
        k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(model.num_layers)]
        v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(model.num_layers)]
        return cls(k=k, v=v, block_size=cache.block_size)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v: [T, Hkv, D]`` at physical ``slots: int64[T]`` of ``layer``."""
        self.k[layer].view(-1, *self.k[layer].shape[2:]).index_copy_(0, slots, k)
        self.v[layer].view(-1, *self.v[layer].shape[2:]).index_copy_(0, slots, v)

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of ``layer`` viewed as ``[num_blocks * block_size, Hkv, D]``."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy slots ``src[i] -> dst[i]`` in every layer (all reads happen before writes)."""
        if len(src) != len(dst):
            raise ValueError("src and dst differ in length")
        if not src:
            return
        device = self.k[0].device
        src_t = torch.tensor(list(src), dtype=torch.int64, device=device)
        dst_t = torch.tensor(list(dst), dtype=torch.int64, device=device)
        for layer in range(self.num_layers):
            for flat in self.flat(layer):
                flat.index_copy_(0, dst_t, flat.index_select(0, src_t))

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy whole blocks ``src[i] -> dst[i]`` in every layer (copy-on-write after a fork)."""
        if len(src) != len(dst):
            raise ValueError("src and dst differ in length")
        if not src:
            return
        device = self.k[0].device
        src_t = torch.tensor(list(src), dtype=torch.int64, device=device)
        dst_t = torch.tensor(list(dst), dtype=torch.int64, device=device)
        for tensors in (self.k, self.v):
            for t in tensors:
                t.index_copy_(0, dst_t, t.index_select(0, src_t))


def _blocks_from_memory(cache: CacheConfig, per_block: int, device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * cache.memory_fraction)
    else:
        budget = cache.cpu_memory_bytes
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"not enough memory for one KV block ({per_block} bytes)")
    return int(num_blocks)
