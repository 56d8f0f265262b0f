"""Which slice of each weight a rank keeps (Megatron-style tensor parallelism).

Per rank of ``world`` ranks, for a checkpoint in Hugging Face names:

- attention: ``num_heads / world`` query heads (contiguous); KV heads sharded the same way when
  ``num_kv_heads >= world`` (``num_kv_heads % world == 0``), else replicated: rank r keeps the
  one KV head its query heads read (``world % num_kv_heads == 0``; Gemma 3 270M has one);
  q/k/v are column-parallel (output rows), o_proj row-parallel (input columns, all-reduce after);
- MLP: gate/up column-parallel, down row-parallel (``intermediate_size / world`` each);
- embedding and LM head: vocabulary-parallel, ``ceil(V / world)`` rows per rank, the last rank's
  tail zero-padded (those logits are cut after the gather);
- biases of row-parallel projections live on rank 0 (added once by the all-reduce); norms and
  QK-norms are replicated.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from espalier.engine.config import ModelConfig

_ROW = ("o_proj", "down_proj")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def check_shardable(config: ModelConfig, world: int) -> None:
    """Raise ``ValueError`` naming the dimension that ``world`` ranks cannot split."""
    problems = []
    if config.num_heads % world:
        problems.append(f"{config.num_heads} attention heads")
    kv = config.num_kv_heads
    if (kv >= world and kv % world) or (kv < world and world % kv):
        problems.append(f"{kv} KV heads")
    if config.intermediate_size % world:
        problems.append(f"intermediate size {config.intermediate_size}")
    if problems:
        raise ValueError(
            f"--tensor-parallel {world} does not divide the model's {', '.join(problems)}"
        )


def local_config(config: ModelConfig, world: int) -> ModelConfig:
    """The architecture one rank builds: its heads, KV heads, MLP width and vocabulary slice."""
    check_shardable(config, world)
    return replace(
        config,
        num_heads=config.num_heads // world,
        num_kv_heads=max(config.num_kv_heads // world, 1),
        intermediate_size=config.intermediate_size // world,
        vocab_size=vocab_shard_size(config.vocab_size, world),
    )


def vocab_shard_size(vocab_size: int, world: int) -> int:
    return -(-vocab_size // world)


def shard_state_dict(
    config: ModelConfig, state: dict[str, torch.Tensor], rank: int, world: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s copy of ``state`` (HF names, full model ``config``); new tensors, so the
    full checkpoint can be freed."""
    check_shardable(config, world)
    return {name: _shard(config, name, tensor, rank, world) for name, tensor in state.items()}


def _shard(
    config: ModelConfig, name: str, tensor: torch.Tensor, rank: int, world: int
) -> torch.Tensor:
    if name in _VOCAB:
        return _vocab_rows(tensor, rank, world)
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
    d = config.head_dim
    if module == "q_proj":
        per = config.num_heads // world * d
        return tensor[rank * per : (rank + 1) * per].clone()
    if module in ("k_proj", "v_proj"):
        first, count = _kv_heads(config.num_kv_heads, rank, world)
        return tensor[first * d : (first + count) * d].clone()
    if module in ("gate_proj", "up_proj"):
        per = config.intermediate_size // world
        return tensor[rank * per : (rank + 1) * per].clone()
    if module in _ROW and kind == "weight":
        per = tensor.shape[1] // world
        return tensor[:, rank * per : (rank + 1) * per].clone()
    if module in _ROW and kind == "bias":
        return tensor.clone() if rank == 0 else torch.zeros_like(tensor)
    return tensor.clone()


def _kv_heads(num_kv_heads: int, rank: int, world: int) -> tuple[int, int]:
    """(first KV head, count) kept by ``rank``: a contiguous share, or the one head its query
    heads read when there are fewer KV heads than ranks."""
    if num_kv_heads >= world:
        per = num_kv_heads // world
        return rank * per, per
    return rank * num_kv_heads // world, 1


def _vocab_rows(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = vocab_shard_size(tensor.shape[0], world)
    rows = tensor[rank * per : (rank + 1) * per]
    if rows.shape[0] == per:
        return rows.clone()
    padded = torch.zeros((per, *tensor.shape[1:]), dtype=tensor.dtype)
    padded[: rows.shape[0]] = rows
    return padded
