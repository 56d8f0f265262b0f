"""Where a constrained speculative step's mask time goes on the GPU machine: ``bench/gpu.py``
with timing probes around the tree-mask fills, printing one JSON line per equal-work run.

Per run of ``bench/gpu_spec.py``'s ``_run`` (its warm-up engine run included, so counts are per
two runs of the same requests): ``fills`` and ``fill_s`` (``MaskBuilder._fill_one`` calls and
their summed wall time, every thread), ``native_s`` (the part inside llguidance's native walk
call, GIL re-acquisition on return included), ``result_wait_s`` and ``results`` (the engine
thread's ``PendingMasks.result()``: helping with fills, then waiting), ``submit_s``, and the
threads that filled. Everything else is ``bench/gpu.py``'s own output.

    python3 bench/gpu_mask_diag.py --tokenizer .data/gpu/gemma_tok --skip-decode \\
        --spec-reps 3 --spec-batches 32 --profile-batch 0
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import gpu  # bench/gpu.py (this folder is on sys.path)
import gpu_spec  # bench/gpu_spec.py

import espalier.constrained.traverse_llguidance as walks
import espalier.engine.spec.masks as masks

_lock = threading.Lock()
_stats: dict[str, Any] = {}


def _reset() -> None:
    _stats.update(fills=0, fill_s=0.0, native_s=0.0, result_wait_s=0.0, results=0, submit_s=0.0)
    _stats["threads"] = set()


def _timed(key: str, function: Callable[..., Any], count: str | None = None) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            with _lock:
                _stats[key] += time.perf_counter() - start
                if count is not None:
                    _stats[count] += 1
                if count == "fills":  # the threads that filled (result() runs on the engine's)
                    _stats["threads"].add(threading.current_thread().name)

    return wrapper


def install() -> None:
    """Wrap the fill, the native walk, submit and result (module attributes, looked up at call
    time by their callers), and ``gpu_spec._run`` to print each run's numbers."""
    _reset()
    masks.MaskBuilder._fill_one = _timed("fill_s", masks.MaskBuilder._fill_one, "fills")  # type: ignore[method-assign]
    masks.MaskBuilder.submit = _timed("submit_s", masks.MaskBuilder.submit)  # type: ignore[method-assign]
    masks.PendingMasks.result = _timed("result_wait_s", masks.PendingMasks.result, "results")  # type: ignore[method-assign]
    walks.native.walk = _timed("native_s", walks.native.walk)  # type: ignore[attr-defined]
    run = gpu_spec._run

    def run_and_print(factory: Any, groups: list[list[Any]], profile: bool = False) -> Any:
        _reset()
        out = run(factory, groups, profile)
        constrained = any(r.grammar is not None for group in groups for r in group)
        record = {k: (sorted(v) if isinstance(v, set) else v) for k, v in _stats.items()}
        print(
            json.dumps(
                {"part": "mask_diag", "constrained": constrained, "tok_per_s": out["tok_per_s"]}
                | record
            ),
            flush=True,
        )
        return out

    gpu_spec._run = run_and_print


if __name__ == "__main__":
    install()
    sys.exit(gpu.main(sys.argv[1:]))
