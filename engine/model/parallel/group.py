"""The process group of one tensor-parallel engine and the collectives the model uses.

One ``RankGroup`` per process: ``device_group`` carries the model's tensors (NCCL on CUDA, gloo
on CPU), every collective with the configured timeout, so a dead peer ends a step with an error
instead of a hang. Steps are announced to the workers over pipes (``launch.py``), not over the
group: an idle worker waits on its pipe with no deadline.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


class TensorParallelError(RuntimeError):
    """A rank died or a collective failed: this engine cannot run another step."""


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism over ``world_size`` ranks of one host.

    backend: "auto" (NCCL on CUDA, gloo on CPU), "nccl" or "gloo".
    timeout_s: deadline of every collective (a peer that died or hangs fails the step).
    port: TCP port of the rendezvous on 127.0.0.1 (0: a free one, picked by the launcher).
    """

    world_size: int = 1
    backend: str = "auto"
    timeout_s: float = 120.0
    port: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {self.world_size}")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"unknown tensor parallel backend {self.backend!r} (nccl, gloo)")

    def backend_for(self, device: torch.device) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if device.type == "cuda" else "gloo"


class RankGroup:
    """This process's rank in a tensor-parallel group of ``world_size`` ranks (one host)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        device_group: dist.ProcessGroup | None,
        backend: str = "gloo",
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device_group = device_group
        self.backend = backend

    @classmethod
    def join(cls, config: ParallelConfig, rank: int, device: torch.device) -> RankGroup:
        """Rendezvous with the other ranks on ``127.0.0.1:config.port`` (blocks until all came)."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = config.backend_for(device)
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://127.0.0.1:{config.port}",
            rank=rank,
            world_size=config.world_size,
            timeout=datetime.timedelta(seconds=config.timeout_s),
        )
        return cls(rank, config.world_size, dist.group.WORLD, backend)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x`` (same shape, dtype, device)."""
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x [n, c]`` from every rank -> ``[n, world_size * c]``, rank r's columns at
        ``r*c:(r+1)*c`` (the vocabulary-parallel logits laid side by side)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=1)

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` over the ranks (the KV block count they all can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.device_group)
        return int(t.item())  # host sync: once, at start-up

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
