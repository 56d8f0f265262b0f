"""Start a tensor-parallel runner: rank 0 here, ranks 1..N-1 spawned, and a watch on them.

``start_tensor_parallel`` is what ``espalier serve/generate --tensor-parallel N`` call: the user
types one command. Rank 0 loads the checkpoint first (a bad model or a model that N ranks cannot
split fails here, before anything is spawned), then spawns the workers (``torch.multiprocessing``,
"spawn": no CUDA state is forked) and joins the group with them.

``RankWatch`` owns the workers: it announces calls over one pipe per worker, and a thread waits
on the worker processes; the first that exits while the engine runs marks the group failed and
calls ``on_failure`` (the server then fails its requests and exits), so nothing waits on a dead
rank longer than a collective's timeout.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import torch

from espalier.engine.config import RunnerConfig
from espalier.engine.model.parallel.group import ParallelConfig, TensorParallelError
from espalier.engine.model.parallel.worker import RankSetup, WeightsLoader

if TYPE_CHECKING:
    from espalier.engine.model.parallel.runner import TensorParallelRunner

log = logging.getLogger(__name__)

_STOP_GRACE_S = 10.0


class RankWatch:
    """The worker processes of one group (rank ``i + 1`` = ``processes[i]``) and their pipes."""

    def __init__(
        self,
        processes: Sequence[BaseProcess],
        pipes: Sequence[Connection],
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.processes = list(processes)
        self.pipes = list(pipes)
        self.on_failure = on_failure
        self.reason: str | None = None
        self._failed = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._watch, name="espalier-tp-watch", daemon=True)

    def await_loaded(self) -> None:
        """Wait until every worker read the checkpoint (raises ``TensorParallelError`` naming
        the first that failed or died), then start watching them."""
        for rank, (process, pipe) in enumerate(zip(self.processes, self.pipes), start=1):
            wait([pipe, process.sentinel])
            message = pickle.loads(pipe.recv_bytes()) if pipe.poll() else None
            if message is None:
                process.join(1.0)  # its exit code
            if message is None or message[0] != "loaded":
                why = message[1] if message is not None else f"exit code {process.exitcode}"
                raise TensorParallelError(f"tensor-parallel rank {rank} did not start: {why}")
        self._thread.start()

    def send(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
        """Announce one runner call ``op(*args, **kwargs)`` to every worker; raises
        ``TensorParallelError`` once the group has failed."""
        if self.reason is not None:
            raise TensorParallelError(self.reason)
        data = pickle.dumps((op, args, kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for pipe in self.pipes:
                pipe.send_bytes(data)
        except OSError as exc:  # a worker's end closed: it is gone
            raise self.failed(exc) from exc

    def failed(self, cause: BaseException) -> TensorParallelError:
        """The error to raise for ``cause``, a failure of this rank's step: the dead worker's
        exit when the watch saw one (or sees one within a second), else the cause itself."""
        self._failed.wait(1.0)
        if self.reason is None:
            self._fail(f"tensor-parallel step failed on rank 0: {cause!r}")
        assert self.reason is not None
        return TensorParallelError(self.reason)

    def stop(self) -> None:
        """Tell the workers to exit, wait a little, then terminate what is left (idempotent)."""
        if self._stopping:
            return
        self._stopping = True
        for pipe in self.pipes:
            with contextlib.suppress(OSError):  # already gone
                pipe.send_bytes(pickle.dumps(("stop", (), {})))
        for process in self.processes:
            process.join(_STOP_GRACE_S)
            if process.is_alive():
                process.terminate()
                process.join(_STOP_GRACE_S)
        for pipe in self.pipes:
            pipe.close()

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        ready = wait(list(sentinels))
        if self._stopping:
            return
        rank = sentinels[ready[0]]  # type: ignore[index]
        process = self.processes[rank - 1]
        process.join(1.0)  # its exit code
        code = process.exitcode
        self._fail(f"tensor-parallel rank {rank} exited (code {code}): the engine cannot continue")

    def _fail(self, reason: str) -> None:
        if self.reason is not None:
            return
        self.reason = reason
        self._failed.set()
        log.error("%s", reason)
        if self.on_failure is not None and not self._stopping:
            self.on_failure(reason)


def start_tensor_parallel(
    loader: WeightsLoader,
    config: RunnerConfig,
    parallel: ParallelConfig,
    *,
    on_failure: Callable[[str], None] | None = None,
) -> TensorParallelRunner:
    """Rank 0's runner of a ``parallel.world_size``-rank group (the workers spawned and joined).

    ``loader`` (picklable) reads the full checkpoint in each rank. On CPU the host's torch
    threads are split between the ranks (this process's count is lowered too). Raises
    ``ValueError`` for a model the ranks cannot split, ``TensorParallelError`` when a worker dies
    before the group is up."""
    from espalier.engine.model.parallel.runner import TensorParallelRunner
    from espalier.engine.model.parallel.shard import check_shardable
    from espalier.engine.model.parallel.worker import rank_config, worker_main

    model_config, state = loader()
    check_shardable(model_config, parallel.world_size)
    on_cuda = torch.device(config.device).type == "cuda"
    if on_cuda and torch.cuda.device_count() < parallel.world_size:
        raise ValueError(
            f"--tensor-parallel {parallel.world_size} needs as many GPUs, "
            f"{torch.cuda.device_count()} visible"
        )
    parallel = replace(parallel, port=parallel.port or _free_port())
    threads = 1
    if torch.device(config.device).type == "cpu":
        threads = max(1, torch.get_num_threads() // parallel.world_size)
        torch.set_num_threads(threads)
    setup = RankSetup(loader, config, parallel, threads)
    context = torch.multiprocessing.get_context("spawn")
    processes, pipes = [], []
    for rank in range(1, parallel.world_size):
        ours, theirs = context.Pipe()
        process = context.Process(
            target=worker_main,
            args=(rank, setup, theirs),
            name=f"espalier-tp-rank{rank}",
            daemon=True,  # never outlives rank 0, even one that exits without close()
        )
        process.start()
        theirs.close()
        processes.append(process)
        pipes.append(ours)
    watch = RankWatch(processes, pipes, on_failure)
    try:
        from espalier.engine.model.parallel.group import RankGroup

        watch.await_loaded()
        group = RankGroup.join(parallel, 0, torch.device(rank_config(config, 0).device))
        return TensorParallelRunner(
            model_config, state, rank_config(config, 0), tensor_parallel=group, watch=watch
        )
    except Exception as exc:
        watch.stop()
        if watch.reason is not None:
            raise TensorParallelError(watch.reason) from exc
        raise


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
