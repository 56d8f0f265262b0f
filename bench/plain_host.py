"""Host work of a plain (non-speculative) constrained step at batch 32, on the CPU, as JSON lines.

The H200's plain constrained step is slower than the unconstrained one by host work: the
grammar's accepts, closing decisions and bookkeeping on the engine thread, and the batch fill
on its worker thread, whose Python can hold the interpreter lock while the engine thread
launches the forward. That work is CPU work, so it is measured here on the same engine flow as
the GPU benches (``bench/gpu_spec.py``'s equal work: a plain constrained greedy run gives each
request's length, the unconstrained requests get those lengths as max_tokens; JSONSchemaBench
schemas, llguidance, the real Gemma tokenizer, 262,144-token vocabulary, ``max_tokens`` 96 as
in ``bench/inputs/h200_b32_streams.jsonl``: every token inside the closing window) with a tiny
random-weight target (``bench/spec_host.py``'s) and the full LM head on both sides, as on CUDA.
The target's forward and the sampler (device work on a GPU) are timed and subtracted.

Per side and rep (``plain_host``), CPU time (``time.thread_time``: far steadier than wall time
on a shared machine) in ms per engine step:

- ``host_cpu_ms``: the engine thread's, less its CPU time inside the forward and the sampler;
- ``fill_cpu_ms``: the batch fill's (``PlainDecoding._fill_masks``) on its worker thread: its
  Python, and here (one native thread) the key tracker's row filter (llguidance's fill runs
  on its executor's own threads);
- ``phases_cpu_ms``: the engine thread's CPU time in ``prepare`` (``BudgetCloser.prepare``,
  the GPU timeline's ``closing_batch``), of it ``stitch`` (``ClosingPaths.stitch``) and
  ``searches`` (closing-path searches of a batch of decisions, native and fallback), ``append``
  (``EngineCore._begin_append``, ``_accept_firsts``, ``_end_append``: all requests; an anchor
  tree's ``_append``), ``execute`` (the strategy) and ``post`` (``step`` less ``execute``:
  schedule, accepts, closing, appends, finishing). ``execute``'s host part (outside the forward
  and the sampler) jumps to ~4 ms in some runs of either side here:
  ``post`` is the steadier figure of the constrained-only work;
- ``gc_ms`` and ``gc_per_step``: garbage collections (any thread: wall ms, and how many of each
  generation) per step: a constrained step's garbage is collected inside whatever allocates
  next, on the GPU the forward's launch too;

reps alternate the sides (U C C U ...); a ``plain_host_summary`` line has the medians, the
constrained extra (``extra_host_cpu_ms``: constrained less unconstrained host CPU per step), a
digest of the constrained outputs (``outputs_digest``: tokens of every request, in order), and
with ``--profile`` the top host functions of one more constrained run (cProfile of the engine
thread timed by its CPU time, paused in the forward and sampler). With ``--anchor DIR`` the
same bench runs first under that checkout's code (its ``.venv``), then here; the last line has
this tree over the anchor and whether the outputs are equal.

    .venv/bin/python bench/plain_host.py [--batch 32] [--max-tokens 96] [--schemas 6]
        [--reps 4] [--profile] [--anchor /work/main]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import json
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import gpu_spec  # bench/gpu_spec.py (this folder is on sys.path)
import spec as spec_bench  # bench/spec.py
import spec_host  # bench/spec_host.py: the tiny target and the profile's table
from anchor import run_anchor  # bench/anchor.py

PHASES = (  # (phase, module, class or None, attribute): engine-thread CPU time inside each
    ("prepare", "espalier.engine.closing", "BudgetCloser", "prepare"),
    ("stitch", "espalier.engine.closing", "ClosingPaths", "stitch"),
    ("searches", "espalier.engine.closing.batch", None, "_search_all"),
    ("append", "espalier.engine.engine", "EngineCore", "_begin_append"),
    ("append", "espalier.engine.engine", "EngineCore", "_accept_firsts"),
    ("append", "espalier.engine.engine", "EngineCore", "_end_append"),
    ("append", "espalier.engine.engine", "EngineCore", "_append"),  # an anchor tree's
    ("execute", "espalier.engine.step", "PlainDecoding", "execute"),
)


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


class Probe:
    """CPU time of the device work and the phases (engine thread) and of the fill (its
    worker), by wrapping a few functions in place."""

    def __init__(self) -> None:
        self.main = threading.main_thread()
        self.device_cpu = 0.0
        self.fill_cpu = 0.0
        self.phases: dict[str, float] = defaultdict(float)
        self.profiler: cProfile.Profile | None = None
        self.collections: dict[int, int] = defaultdict(int)  # by generation, any thread
        self.gc_s = 0.0
        self._gc_start = 0.0

    def reset(self) -> None:
        self.device_cpu = self.fill_cpu = self.gc_s = 0.0
        self.phases.clear()
        self.collections.clear()

    def gc_callback(self, phase: str, info: dict[str, int]) -> None:
        """``gc.callbacks``: collections (they run inside whatever allocates: on the GPU, a
        forward's launch too) and their wall time."""
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_start
            self.collections[info.get("generation", -1)] += 1

    @contextmanager
    def installed(self, runner: Any) -> Iterator[Probe]:
        import importlib
        from contextlib import ExitStack
        from unittest import mock

        from espalier.engine import sampler, step

        def patch(owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
            stack.enter_context(mock.patch.object(owner, name, wrap(getattr(owner, name))))

        with ExitStack() as stack:
            gc.callbacks.append(self.gc_callback)
            stack.callback(gc.callbacks.remove, self.gc_callback)
            patch(runner, "forward", self._device)
            patch(sampler.Sampler, "__call__", self._device)
            patch(step.PlainDecoding, "_fill_masks", self._fill)
            for phase, module, cls, attr in PHASES:
                owner = importlib.import_module(module)
                owner = getattr(owner, cls) if cls is not None else owner
                if hasattr(owner, attr):  # a tree may have renamed it
                    patch(owner, attr, lambda f, phase=phase: self._phase(phase, f))
            yield self

    def _device(self, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not self.main:
                return function(*args, **kwargs)
            profiler = self.profiler
            if profiler is not None:
                profiler.disable()
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.device_cpu += time.thread_time() - start
                if profiler is not None:
                    profiler.enable()

        return wrapper

    def _fill(self, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.fill_cpu += time.thread_time() - start

        return wrapper

    def _phase(self, phase: str, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not self.main:
                return function(*args, **kwargs)
            start, device = time.thread_time(), self.device_cpu
            try:
                return function(*args, **kwargs)
            finally:
                own = time.thread_time() - start - (self.device_cpu - device)
                self.phases[phase] += own

        return wrapper


def measure(engine: Any, requests: list[Any], probe: Probe) -> dict[str, Any]:
    """One run of ``requests`` on ``engine`` (idle), step by step; CPU ms per step, outputs."""
    probe.reset()
    first_step = engine.num_steps
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    cpu = 0.0
    profiler = probe.profiler
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        start = time.thread_time()
        if profiler is not None:
            profiler.enable()
        chunks = engine.step()
        if profiler is not None:
            profiler.disable()
        cpu += time.thread_time() - start
        for out in chunks:
            outputs[out.request_id].extend(out.token_ids)
    steps = engine.num_steps - first_step
    host = cpu - probe.device_cpu
    phases = dict(probe.phases)
    phases["post"] = host - phases.get("execute", 0.0)

    def per_step(seconds: float) -> float:
        return round(1e3 * seconds / steps, 3)

    return {
        "engine_steps": steps,
        "tokens": sum(len(v) for v in outputs.values()),
        "host_cpu_ms": per_step(host),
        "fill_cpu_ms": per_step(probe.fill_cpu),
        "device_cpu_ms": per_step(probe.device_cpu),
        "phases_cpu_ms": {k: per_step(v) for k, v in sorted(phases.items())},
        "gc_ms": per_step(probe.gc_s),
        "gc_per_step": {
            f"gen{g}": round(n / steps, 3) for g, n in sorted(probe.collections.items())
        },
        "outputs": outputs,
    }


def bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from espalier.constrained.backends import get_backend
    from espalier.constrained.spec import GrammarSpec
    from espalier.engine.engine import Engine
    from espalier.server.default_model import default_tokenizer
    from espalier.server.gc_freeze import freeze_startup_heap

    tokenizer = default_tokenizer()
    runner = spec_host.tiny_runner(tokenizer)
    get_backend("llguidance", tokenizer).tree_walk()  # as bench/gpu.py: the native C paths ready
    schemas = [
        s
        for s in spec_bench.sample_schemas(args.schemas, with_instances=False)
        if spec_bench.compile_schema(s[1], tokenizer) is not None
    ]
    service = spec_bench.shared_grammars(
        tokenizer, [GrammarSpec.json_schema(s) for _, s, _ in schemas]
    )
    freeze_startup_heap()
    gen = torch.Generator().manual_seed(0)
    batch = args.batch
    prompts = [torch.randint(0, 200_000, (128,), generator=gen).tolist() for _ in range(batch)]
    grammars = [GrammarSpec.json_schema(schemas[i % len(schemas)][1]) for i in range(batch)]
    setup = gpu_spec._Setup(runner, tokenizer, service, batch, 1)
    config = replace(setup.engine_config(), sparse_head=False)  # the full head, as on CUDA

    def factory() -> Any:
        return Engine(config, runner, tokenizer, grammar=service)

    full = [args.max_tokens] * batch
    first = gpu_spec._run(factory, [gpu_spec._requests(prompts, grammars, full, False, "c")])
    lengths = [max(1, len(first["outputs"][f"c{i}"])) for i in range(batch)]
    free: list[Any] = [None] * batch
    sides = {
        True: gpu_spec._requests(prompts, grammars, full, False, "c"),
        False: gpu_spec._requests(prompts, free, lengths, False, "u"),
    }
    probe = Probe()
    runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    digest = ""
    # one engine per side, as bench/gpu_spec.py's runs: its warm-up run meets every grammar
    # state once and leaves the grammars' start paths kept (BudgetCloser)
    engines = {constrained: factory() for constrained in (False, True)}
    with probe.installed(runner):
        for constrained in (False, True):
            measure(engines[constrained], sides[constrained], probe)
        for rep in range(args.reps):
            for constrained in (False, True) if rep % 2 == 0 else (True, False):
                result = measure(engines[constrained], sides[constrained], probe)
                outputs = result.pop("outputs")
                if constrained:
                    text = json.dumps([outputs[f"c{i}"] for i in range(batch)])
                    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
                runs[constrained].append(result)
                if not args.json_only:
                    emit({"part": "plain_host", "rep": rep, "constrained": constrained} | result)
        profile = None
        if args.profile:
            profiler = probe.profiler = cProfile.Profile(time.thread_time)  # CPU, not wall
            measure(engines[True], sides[True], probe)
            probe.profiler = None
            profile = spec_host._top(profiler)
    for engine in engines.values():
        engine.close()

    def median(constrained: bool, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[constrained]), 3)

    def phase(constrained: bool, key: str) -> float:
        values = [r["phases_cpu_ms"].get(key, 0.0) for r in runs[constrained]]
        return round(statistics.median(values), 3)

    summary: dict[str, Any] = {
        "batch": batch,
        "max_tokens": args.max_tokens,
        "reps": args.reps,
        "engine_steps": runs[True][0]["engine_steps"],
        "tokens": runs[True][0]["tokens"],
        "outputs_digest": digest,
    }
    for constrained, side in ((True, "c"), (False, "u")):
        summary[f"{side}_host_cpu_ms"] = median(constrained, "host_cpu_ms")
        summary[f"{side}_fill_cpu_ms"] = median(constrained, "fill_cpu_ms")
        summary[f"{side}_gc_ms"] = median(constrained, "gc_ms")
        summary[f"{side}_gc_per_step"] = runs[constrained][-1]["gc_per_step"]
        keys = sorted({k for r in runs[constrained] for k in r["phases_cpu_ms"]})
        summary[f"{side}_phases_cpu_ms"] = {k: phase(constrained, k) for k in keys}
    summary["extra_host_cpu_ms"] = round(summary["c_host_cpu_ms"] - summary["u_host_cpu_ms"], 3)
    summary["c_over_u_host_cpu"] = round(summary["c_host_cpu_ms"] / summary["u_host_cpu_ms"], 3)
    if profile is not None:
        summary["profile"] = profile
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--schemas", type=int, default=6)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--profile", action="store_true", help="cProfile a constrained run")
    parser.add_argument("--anchor", help="a checkout (with its .venv) to run first")
    parser.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    anchor = None
    if args.anchor:
        sizes = ["--batch", str(args.batch), "--max-tokens", str(args.max_tokens)]
        sizes += ["--schemas", str(args.schemas), "--reps", str(args.reps)]
        anchor = run_anchor(args.anchor, __file__, sizes)
        emit({"part": "plain_host_summary", "side": "anchor", "tree": args.anchor} | anchor)
    ours = bench(args)
    if args.json_only:
        print(json.dumps(ours))
        return 0
    emit({"part": "plain_host_summary", "side": "this tree"} | ours)
    if anchor is not None:
        emit(
            {
                "part": "plain_host_ratio",
                "outputs_equal": anchor["outputs_digest"] == ours["outputs_digest"],
                "extra_host_cpu_this_over_anchor": round(
                    ours["extra_host_cpu_ms"] / max(anchor["extra_host_cpu_ms"], 1e-9), 3
                ),
                "c_host_cpu_this_over_anchor": round(
                    ours["c_host_cpu_ms"] / anchor["c_host_cpu_ms"], 3
                ),
                "u_host_cpu_this_over_anchor": round(
                    ours["u_host_cpu_ms"] / anchor["u_host_cpu_ms"], 3
                ),
                "fill_cpu_this_over_anchor": round(
                    ours["c_fill_cpu_ms"] / max(anchor["c_fill_cpu_ms"], 1e-9), 3
                ),
            }
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
