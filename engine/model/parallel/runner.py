"""Rank 0's runner: a ``ModelRunner`` over rank 0's shard that announces each call to the workers.

The engine on rank 0 uses it like any runner (the scheduler, grammar work, sampling and
speculation stay on rank 0, once); ``forward``, ``copy_slots`` and ``copy_blocks`` are first sent
to every worker (``worker.py``), then run here, each rank on its shard, meeting in the
collectives. A worker that exits (``launch.RankWatch``) or a collective that fails or times out
ends the engine: this call and every later one raise ``TensorParallelError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from espalier.engine.config import ModelConfig, RunnerConfig
from espalier.engine.model.parallel.group import RankGroup, TensorParallelError
from espalier.engine.model.parallel.launch import RankWatch
from espalier.engine.model.runner import ForwardOutput, ModelRunner, SeqInput


class TensorParallelRunner(ModelRunner):
    """Rank 0 of a tensor-parallel group; ``watch`` holds the other ranks' processes."""

    def __init__(
        self,
        model_config: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        config: RunnerConfig,
        *,
        tensor_parallel: RankGroup,
        watch: RankWatch,
    ) -> None:
        self.watch = watch
        super().__init__(model_config, state_dict, config, tensor_parallel=tensor_parallel)

    def forward(
        self, batch: Sequence[SeqInput], *, hidden_layers: Sequence[int] = ()
    ) -> ForwardOutput:
        portable = [_portable(seq) for seq in batch]
        self.watch.send("forward", (portable,), {"hidden_layers": tuple(hidden_layers)})
        try:
            return super().forward(batch, hidden_layers=hidden_layers)
        except Exception as exc:
            raise self.watch.failed(exc) from exc

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self.watch.send("copy_slots", (list(src), list(dst)))
        super().copy_slots(src, dst)

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self.watch.send("copy_blocks", (list(src), list(dst)))
        super().copy_blocks(src, dst)

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1, in rank order."""
        return [p.pid for p in self.watch.processes if p.pid is not None]

    def close(self) -> None:
        """Stop the workers and leave the group (idempotent). A failed NCCL group is not torn
        down (destroying a communicator with a dead peer may block): the process is ending."""
        self.watch.stop()
        group = self.tensor_parallel
        if group is not None and (self.watch.reason is None or group.backend == "gloo"):
            group.leave()


def _portable(seq: SeqInput) -> SeqInput:
    """``seq`` as the workers can unpickle it: the tree mask on the CPU (a CUDA tensor would
    land on rank 0's GPU), the token and block lists as plain lists."""
    mask = seq.custom_mask
    return replace(
        seq,
        block_table=list(seq.block_table),
        token_ids=list(seq.token_ids),
        positions=None if seq.positions is None else list(seq.positions),
        custom_mask=None if mask is None else mask.cpu(),
    )


__all__ = ["TensorParallelError", "TensorParallelRunner"]
