"""ModelRunner: owns one model and its paged KV cache, runs one batched forward per call.

The scheduler (engine loop) owns block allocation (``BlockAllocator`` in ``engine/kv_cache.py``,
pure python); the runner only reads the block tables it is given and writes K/V into the slots
they name. One call = one step: any mix of prefill chunks, decodes and (later) draft trees.

Contract of one sequence's ``SeqInput`` in a step:

- The sequence already has ``context_len`` tokens in the cache, at sequence-local cache indices
  ``0 .. context_len-1``. The ``q_len = len(token_ids)`` new tokens are written at cache indices
  ``context_len .. context_len+q_len-1``; cache index ``i`` lives in physical slot
  ``block_table[i // block_size] * block_size + i % block_size``. ``block_table`` must cover
  ``context_len + q_len`` entries.
- ``positions`` (rope positions) default to ``context_len + arange(q_len)``. A draft tree passes
  its own (``context_len + depth``); several new tokens may share a position.
- ``custom_mask`` (optional): bool ``[q_len, context_len + q_len]``, True = may attend. Default
  is causal over cache indices. A tree's mask is "all of the context + own ancestors + self".
  Cached (context) entries are assumed to sit at position == cache index (the accepted prefix is
  compacted into place), which sliding-window layers use together with ``positions``.
- ``logits``: which of the new tokens get logits: ``"last"`` (default), ``"all"`` or ``"none"``.

Typical use (engineer F's scheduler)::

    runner = ModelRunner.from_pretrained(gguf_path, RunnerConfig(cache=CacheConfig(num_blocks=512)))
    out = runner.forward([SeqInput(block_table=[0, 1], token_ids=prompt, context_len=0),
                          SeqInput(block_table=[7], token_ids=[last_tok], context_len=12)])
    out.logits          # fp32 [2, V] on runner.device: one row per sequence ("last")
    out.logits_indptr   # [0, 1, 2]: rows of sequence b are logits[indptr[b]:indptr[b+1]]
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

import torch

from espalier.engine.config import CacheConfig, ModelConfig, RunnerConfig

if TYPE_CHECKING:
    from espalier.engine.model.cuda_graphs import StepGraphs
    from espalier.engine.model.parallel import RankGroup

LogitsSelect = Literal["last", "all", "none"]


@dataclass(frozen=True)
class SeqInput:
    """One sequence's share of a forward step (see the module docstring for the contract).

    block_table: physical block ids of the sequence, in order (python ints).
    token_ids: the new tokens, q_len >= 1.
    context_len: tokens of this sequence already in the cache (0 for the first prefill chunk).
    positions: rope position per new token; None = ``context_len + arange(q_len)``.
    custom_mask: bool ``[q_len, context_len + q_len]`` (CPU or runner device) or None = causal.
    logits: which new tokens get logits rows: "last" (1 row), "all" (q_len rows) or "none".
    """

    block_table: Sequence[int]
    token_ids: Sequence[int]
    context_len: int = 0
    positions: Sequence[int] | None = None
    custom_mask: torch.Tensor | None = None
    logits: LogitsSelect = "last"

    @property
    def q_len(self) -> int:
        return len(self.token_ids)

    @property
    def kv_len(self) -> int:
        """Cache entries this sequence has after the step (context + new tokens)."""
        return self.context_len + len(self.token_ids)


@dataclass
class ForwardOutput:
    """Result of one ``ModelRunner.forward``.

    logits: fp32 ``[n, V]`` on the runner's device; rows ordered by sequence, then token.
    logits_indptr: python list of length ``B + 1``: sequence b owns rows ``indptr[b]:indptr[b+1]``.
    hidden_states: layer index -> ``[n_tokens, H]`` in the model dtype, one row per new token
        (all tokens of the step, ordered like the inputs), for the layers requested: index
        ``i < L`` is the output of decoder layer i (the residual stream), index ``L``
        (= num_layers) the final normed hidden state (the LM head's input).
    """

    logits: torch.Tensor
    logits_indptr: list[int]
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    """A model + its paged KV cache on one device, running batched forwards.

    ``device``/``dtype`` come from ``RunnerConfig`` (CPU fp32 and CUDA bf16 use the same code).
    ``num_blocks`` / ``block_size`` give the cache geometry that the scheduler's
    ``BlockAllocator(num_blocks)`` must use.

    ``tensor_parallel``: this process's rank of a tensor-parallel group; the runner then holds
    the rank's shard (``parallel/shard.py``: its heads, KV heads, MLP and vocabulary slices of
    the full ``state_dict``), every forward is a collective of all ranks, and its logits are
    still full-vocabulary. ``model_config`` stays the full model's.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        config: RunnerConfig,
        *,
        tensor_parallel: RankGroup | None = None,
    ) -> None:
        from espalier.engine.kv_cache import KVCache
        from espalier.engine.model.attention.base import get_attention_backend
        from espalier.engine.model.models import build_model

        self.model_config = model_config
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.tensor_parallel = tensor_parallel
        if tensor_parallel is not None:
            from espalier.engine.model.parallel.shard import local_config, shard_state_dict

            world = tensor_parallel.world_size
            state_dict = shard_state_dict(model_config, state_dict, tensor_parallel.rank, world)
            model_config = local_config(model_config, world)
        self.model = build_model(
            model_config, state_dict, device=self.device, dtype=self.dtype, options=config.options
        )
        if tensor_parallel is not None:
            from espalier.engine.model.parallel.layers import parallelize

            parallelize(self.model, tensor_parallel, self.model_config.vocab_size)
        if self.device.type == "cuda":  # one GEMM for q/k/v and one for gate/up
            from espalier.kernels.fused import fuse_projections

            fuse_projections(self.model)
        else:  # oneDNN-packed projections for batches of rows (``models/cpu_packed.py``)
            from espalier.engine.model.models.cpu_packed import pack_linears

            pack_linears(self.model)
        # the backend first: its device workspace is not free memory for the KV cache
        self.attention = get_attention_backend(
            config.attention_backend,
            model_config,
            device=self.device,
            dtype=self.dtype,
            options=config.options,
        )
        use_graphs = self.attention.name == "flashinfer" and bool(config.cuda_graph_batch_sizes)
        cache = config.cache
        self._reserved_blocks = int(use_graphs)  # the graphs' scratch block (padded rows)
        if use_graphs and cache.num_blocks:
            cache = replace(cache, num_blocks=cache.num_blocks + 1)
        self.kv_cache = KVCache.allocate(model_config, cache, device=self.device, dtype=self.dtype)
        self._num_blocks = self.kv_cache.num_blocks - self._reserved_blocks
        if tensor_parallel is not None:  # ranks sized from their own free memory: the least
            # (also the group's first collective: NCCL creates its communicator here, before
            # any graph capture, which cannot)
            self._num_blocks = tensor_parallel.min_int(self._num_blocks, self.device)
        self.graphs: StepGraphs | None = None
        # every kernel variant a step can launch, before any step (and before the captures)
        self.attention.warm_up(self.block_size, self._num_blocks * self.block_size)
        self._warm_up_steps()
        if use_graphs:
            from espalier.engine.model.cuda_graphs import StepGraphs

            self.graphs = StepGraphs(
                self,
                config.cuda_graph_batch_sizes,
                config.cuda_graph_tree_sizes,
                scratch_block=self.kv_cache.num_blocks - 1,
            )
            self.graphs.capture()

    WARM_UP_ROWS = (1, 2, 16, 17)
    """Rows of the warm-up steps: one row (PDL; the skinny GEMM's one-row variant), a few, 16
    (Triton's multiple-of-16 variant), more than the skinny GEMM takes (cuBLAS, the separate
    activation kernel, flashinfer's prefill)."""

    def _warm_up_steps(self) -> None:
        """On CUDA, one eager step per ``WARM_UP_ROWS`` (one sequence, logits for every row),
        so the model's Triton kernels (the skinny GEMMs of every weight, the LM head's included,
        which no graph capture runs; norms, rope, activation) have every variant a step can take
        before the first one: Triton specializes on a launch's row count being 1 or a multiple of
        16, and a variant first built mid-run stalled every stream (issue 28). The steps write
        into the first cache blocks (nothing holds any yet) and zero them again. Not under tensor
        parallelism (a forward is a collective of all ranks)."""
        if self.device.type != "cuda" or self.tensor_parallel is not None:
            return
        blocks = list(range(-(-max(self.WARM_UP_ROWS) // self.block_size)))
        if len(blocks) > self.num_blocks:
            return
        for rows in self.WARM_UP_ROWS:
            self.forward([SeqInput(blocks, [0] * rows, logits="all")])
        for layer in range(len(self.kv_cache.k)):  # blocks 0 .. n-1: a view, zeroed in place
            self.kv_cache.k[layer][: len(blocks)].zero_()
            self.kv_cache.v[layer][: len(blocks)].zero_()

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike[str], config: RunnerConfig | None = None
    ) -> ModelRunner:
        """Load an HF directory or a ``.gguf`` file."""
        from espalier.engine.model.weights import load_weights

        config = config or RunnerConfig()
        model_config, state_dict = load_weights(path)
        return cls(model_config, state_dict, config)

    # -- geometry ------------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def full_head(self) -> bool:
        """Whether ``model.head_weight()`` is the whole LM head (False: a rank's vocabulary
        slice under tensor parallelism, so logits come only from ``forward``)."""
        return self.tensor_parallel is None

    # -- the step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self, batch: Sequence[SeqInput], *, hidden_layers: Sequence[int] = ()
    ) -> ForwardOutput:
        """Run one batched forward: write new K/V into the cache, return the requested logits."""
        from espalier.engine.model.attention.base import build_metadata

        if self.graphs is not None:
            replayed = self.graphs.forward(batch, hidden_layers)
            if replayed is not None:
                return replayed
        meta = build_metadata(batch, block_size=self.block_size, device=self.device)
        self.attention.prepare(meta)
        hidden, captured = self.model(
            meta.token_ids, meta.positions, meta, self.kv_cache, self.attention, hidden_layers
        )
        selected = hidden.index_select(0, meta.logits_rows)
        logits = self.model.compute_logits(selected)
        return ForwardOutput(
            logits=logits, logits_indptr=meta.logits_indptr, hidden_states=captured
        )

    def replays(self, batch: Sequence[SeqInput], *, hidden_layers: Sequence[int] = ()) -> bool:
        """Whether :meth:`forward` would replay a CUDA graph for ``batch`` (its call then only
        enqueues work); False: it runs eagerly (on CUDA its call launches kernel by kernel from
        Python: many times a replay's host time, ``docs/decisions/padded-tree-graphs.md``)."""
        return self.graphs is not None and self.graphs.fits(batch, hidden_layers)

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy K/V of physical slots ``src[i]`` to ``dst[i]`` in every layer.

        Used to compact accepted tree nodes into place and for copy-on-write of forked blocks
        (slot = block * block_size + offset).
        """
        self.kv_cache.copy_slots(src, dst)

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy whole blocks ``src[i]`` -> ``dst[i]`` in every layer (copy-on-write after fork)."""
        self.kv_cache.copy_blocks(src, dst)

    def close(self) -> None:
        """Release what outlives this object: nothing on one device (a tensor-parallel rank 0
        stops the other ranks). Its owner calls it, not the engines sharing it."""


__all__ = ["CacheConfig", "ForwardOutput", "ModelRunner", "RunnerConfig", "SeqInput"]
