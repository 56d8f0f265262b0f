"""Ranks 1..N-1: load the model, join the group, then run the steps rank 0 announces.

A worker holds its shard and KV cache and does nothing of its own: each message from rank 0's
pipe is one runner call (``forward``, ``copy_slots``, ``copy_blocks``) that rank 0 makes at the
same time, so every rank enters the same collectives in the same order. A worker exits when told
to, when rank 0's end of the pipe closes or rank 0 is gone, and with status 1 when a call fails
(a fault on one rank leaves the group out of step: rank 0's watchdog then fails the engine).
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from espalier.engine.config import ModelConfig, RunnerConfig
from espalier.engine.model.parallel.group import ParallelConfig, RankGroup

log = logging.getLogger(__name__)

WeightsLoader = Callable[[], tuple[ModelConfig, dict[str, torch.Tensor]]]
"""Picklable (a module-level function or a ``functools.partial`` of one): each rank calls it
to read the full checkpoint, then keeps its shard."""

_POLL_S = 1.0


@dataclass(frozen=True)
class RankSetup:
    """What every rank needs to build its runner (sent to each worker at spawn)."""

    loader: WeightsLoader
    runner_config: RunnerConfig
    parallel: ParallelConfig
    threads: int  # torch intra-op threads of each rank (the host's cores split between ranks)


def rank_config(config: RunnerConfig, rank: int) -> RunnerConfig:
    """``config`` for ``rank``: on CUDA rank r runs on GPU r of the host."""
    from dataclasses import replace

    if torch.device(config.device).type != "cuda":
        return config
    return replace(config, device=f"cuda:{rank}")


def build_rank(setup: RankSetup, rank: int, model: tuple[ModelConfig, dict[str, Any]]) -> Any:
    """Join the group as ``rank`` and build the runner over its shard of ``model``."""
    from espalier.engine.model.runner import ModelRunner

    config = rank_config(setup.runner_config, rank)
    group = RankGroup.join(setup.parallel, rank, torch.device(config.device))
    model_config, state = model
    return ModelRunner(model_config, state, config, tensor_parallel=group)


def worker_main(rank: int, setup: RankSetup, pipe: Connection) -> None:
    """Entry point of rank ``rank`` (a spawned process): load, say so on ``pipe`` (or say why
    not, and exit 1), join the group, serve."""
    torch.set_num_threads(setup.threads)
    try:
        model = setup.loader()
    except Exception as exc:
        pipe.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}")))
        raise SystemExit(1) from None
    pipe.send_bytes(pickle.dumps(("loaded", None)))
    runner = build_rank(setup, rank, model)
    del model
    try:
        _serve(runner, pipe)
    finally:
        runner.tensor_parallel.leave()


def _serve(runner: Any, pipe: Connection) -> None:
    parent = multiprocessing.parent_process()
    while True:
        if not pipe.poll(_POLL_S):
            if parent is not None and not parent.is_alive():
                return
            continue
        try:
            op, args, kwargs = pickle.loads(pipe.recv_bytes())
        except EOFError:
            return
        if op == "stop":
            return
        try:
            getattr(runner, op)(*args, **kwargs)
        except Exception:
            log.exception("tensor-parallel rank %d: %s failed", runner.tensor_parallel.rank, op)
            raise SystemExit(1) from None
