"""Host overhead of speculative decoding at batch 32, measured on the CPU, printing JSON lines.

The GPU machine's speculative step at batch 32 is host-bound (issues 7/8): what limits it is
Python and grammar work on the main thread, not the target. That work is CPU work, so it is
measured here on the same engine flow as ``bench/gpu_spec.py`` (equal work: the constrained
requests' plain output lengths bound the unconstrained ones, ``--tight-budget`` the constrained
ones too; oracle drafter, 8 draft tokens per tree, JSONSchemaBench schemas, the real Gemma
tokenizer, 262,144-token vocabulary) with a tiny random-weight target on the CPU. The target's
own work (``runner.forward`` and the verification kernel: on a GPU, device time) is timed and
subtracted; what remains is host time.

Per side (constrained / unconstrained), one JSON line:

- ``host_ms_per_step``: (step wall time - forward - verify kernel) / speculative steps;
  ``dropped_rows``: rows a launch ran for requests the grammar ended behind it
  (``--grammar-after-launch``);
- ``host_cpu_ms_per_step``: the engine thread's CPU time (``time.thread_time``) per step, less
  its CPU time inside the target's work: the host work itself, far less sensitive than wall
  time to other processes sharing the cores; ``host_cpu_ms_steps`` the same step by step (a
  burst's first steps apart from the rest);
- ``mask_fill_ms_per_step``: tree-fill time summed over the trees (each tree's own fill: on a
  mask thread, or on a native thread of a tree batch; on the GPU these run while the forward
  does: they are hidden when this / mask threads < the forward's time);
  ``mask_jobs_ms_per_step``: wall time of the mask threads' fill jobs, summed over the jobs (one
  per tree filled alone, one per tree batch);
- ``accepts_per_token``: ``GrammarMatcher.accept`` calls (every matcher, forks included, every
  thread) per emitted token, ``main_accepts_per_token`` those on the main thread (the rest run
  on the mask threads: tree fills, closing decisions made ahead); ``forks_per_token``,
  ``forced_calls_per_token`` likewise; ``tree_nodes_per_token``: nodes walked by tree fills
  (each one native consume + one mask);
- ``lookahead_ms_per_step`` / ``lookahead_cpu_ms_per_step``: the closing lookahead jobs
  (``Lookahead.together`` / ``Lookahead.run``, on whichever thread runs them: the decisions for
  every draft-tree node) wall and thread CPU time, summed over jobs; ``lookahead_nodes_per_step``
  the tree nodes they were given; ``lookahead_wait_ms_per_step``: the engine thread's wall time
  in ``Lookahead._find`` (taking a decision: waiting for the job that makes it, or running it);
- ``closing_batch_ms_per_step`` / ``closing_batch_cpu_ms_per_step``: the engine thread's wall and
  CPU time in ``BudgetCloser.prepare`` (the step's first inline decisions: a speculative step's
  bonus tokens), ``accept_run_ms_per_step`` / ``accept_run_cpu_ms_per_step`` in
  ``EngineCore._accept_runs`` (the batch accept of the accepted runs, and the lookahead decisions
  they take): ``bench/gpu_timeline.py``'s ``closing_batch`` and ``accept_run``;
  ``append_ms_per_step`` / ``append_cpu_ms_per_step`` in ``EngineCore._begin_append``,
  ``_accept_firsts`` and ``_end_append`` (every request's append, the batch accept of the
  tokens past the runs, inline closing decisions, waits for ``prepare``'s searches included);

then the ratio line (``constrained_over_unconstrained_host``) and, with ``--profile``, the top
host functions of the constrained run (cProfile of the main thread, paused during device work;
``lookahead_profile``: of the lookahead jobs, on whichever thread runs them).

    .venv/bin/python bench/spec_host.py [--batch 32] [--max-tokens 96] [--schemas 6]
        [--mask-threads 2] [--no-closing] [--close-ahead default|on|off] [--close-workers N]
        [--profile] [--warmup]
        [--tight-budget] [--grammar-after-launch [N]] [--forced] [--in-process-text]
        [--backend llguidance|xgrammar|outlines_core]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import gpu_spec  # bench/gpu_spec.py (this folder is on sys.path)
import spec as spec_bench  # bench/spec.py


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


class Probe:
    """Counts and times what the bench reports, by wrapping a few functions in place."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.device_s = 0.0  # target forward + verification kernel (GPU work on the GPU)
        self.device_cpu_s = 0.0  # the engine thread's CPU time inside them
        self.mask_fill_s = 0.0  # tree fills, summed over trees
        self.mask_jobs_s = 0.0  # fill jobs' wall time, summed over jobs
        self.tree_nodes = 0
        self.lookahead_s = self.lookahead_cpu_s = 0.0  # closing lookahead jobs, any thread
        self.lookahead_nodes = 0
        self.lookahead_wait_s = 0.0  # the engine thread taking lookahead decisions
        # the engine thread in BudgetCloser.prepare / Engine._accept_runs (gpu_timeline's
        # closing_batch / accept_run): wall and thread CPU
        self.closing_batch_s = self.closing_batch_cpu_s = 0.0
        self.accept_run_s = self.accept_run_cpu_s = 0.0
        self.append_s = self.append_cpu_s = 0.0  # Engine._append: every request's append
        self.profiler: cProfile.Profile | None = None  # paused during device work
        self.ahead_profiler: cProfile.Profile | None = None  # the lookahead jobs (--profile)

    @contextmanager
    def installed(self, runner: Any) -> Iterator[Probe]:
        """Wrap the runner's forward, the verify kernel, the tree fill and the matcher calls."""
        from espalier.constrained.backends import common
        from espalier.constrained.backends import llguidance as llg
        from espalier.engine import engine as engine_mod
        from espalier.engine.closing import BudgetCloser, ahead
        from espalier.engine.spec import masks
        from espalier.kernels import verify

        patches: list[tuple[Any, str, Any]] = []

        def patch(owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
            original = getattr(owner, name)
            # restore the class's own attribute (a staticmethod stays one)
            patches.append((owner, name, vars(owner).get(name, original)))
            setattr(owner, name, wrap(original))

        patch(runner, "forward", self._timed_device)
        patch(verify, "verify_greedy", self._timed_device)
        patch(masks.MaskBuilder, "_fill_one", self._timed_job)
        patch(masks.MaskBuilder, "_fill_batch", self._timed_job)
        patch(masks.PendingMasks, "result", self._counted_fills)
        patch(ahead.Lookahead, "together", lambda f: staticmethod(self._timed_ahead(f)))
        patch(ahead.Lookahead, "run", self._timed_ahead)
        patch(ahead.Lookahead, "_find", self._timed_wait)
        patch(BudgetCloser, "prepare", lambda f: self._timed_part("closing_batch", f))
        patch(engine_mod.EngineCore, "_accept_runs", lambda f: self._timed_part("accept_run", f))
        for appending in ("_begin_append", "_accept_firsts", "_end_append"):
            patch(engine_mod.EngineCore, appending, lambda f: self._timed_part("append", f))
        patch(common.MatcherBase, "accept", lambda f: self._counted("accept", f))
        patch(llg.Matcher, "fork", lambda f: self._counted("fork", f))
        patch(llg.Matcher, "forced_tokens", lambda f: self._counted("forced_tokens", f))
        try:
            yield self
        finally:
            for owner, name, original in reversed(patches):
                if owner is runner:
                    delattr(owner, name)  # back to the class's method
                else:
                    setattr(owner, name, original)

    def reset(self) -> None:
        self.calls.clear()
        self.device_s = self.device_cpu_s = self.mask_fill_s = self.mask_jobs_s = 0.0
        self.tree_nodes = 0
        self.lookahead_s = self.lookahead_cpu_s = 0.0
        self.lookahead_nodes = 0
        self.lookahead_wait_s = 0.0
        self.closing_batch_s = self.closing_batch_cpu_s = 0.0
        self.accept_run_s = self.accept_run_cpu_s = 0.0
        self.append_s = self.append_cpu_s = 0.0

    def _timed_part(self, part: str, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                setattr(self, f"{part}_s", getattr(self, f"{part}_s") + time.perf_counter() - start)
                cpu = getattr(self, f"{part}_cpu_s") + time.thread_time() - start_cpu
                setattr(self, f"{part}_cpu_s", cpu)

        return wrapper

    def _timed_wait(self, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            profiler = self.profiler  # the job it may run is timed as a job, not profiled here
            if profiler is not None:
                profiler.disable()
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.lookahead_wait_s += time.perf_counter() - start
                if profiler is not None:
                    profiler.enable()

        return wrapper

    def _timed_ahead(self, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            together = isinstance(args[0], list)  # Lookahead.together's aheads, else one's run
            nodes = sum(len(a._tokens) for a in args[0]) if together else 0
            profiler = self.ahead_profiler
            start, start_cpu = time.perf_counter(), time.thread_time()
            if profiler is not None:
                profiler.enable()
            try:
                return function(*args, **kwargs)
            finally:
                if profiler is not None:
                    profiler.disable()
                self.lookahead_s += time.perf_counter() - start
                self.lookahead_cpu_s += time.thread_time() - start_cpu
                self.lookahead_nodes += nodes

        return wrapper

    def _timed_device(self, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            profiler = self.profiler
            if profiler is not None:
                profiler.disable()
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.device_s += time.perf_counter() - start
                self.device_cpu_s += time.thread_time() - start_cpu
                if profiler is not None:
                    profiler.enable()

        return wrapper

    def _timed_job(self, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.mask_jobs_s += time.perf_counter() - start  # += on a float: GIL-atomic enough

        return wrapper

    def _counted_fills(self, function: Any) -> Any:
        def wrapper(pending: Any) -> Any:
            counted = pending.ready is not None
            out = function(pending)
            if not counted:  # once per step: the fills' own times and the nodes they walked
                self.mask_fill_s += pending.fills.seconds
                self.tree_nodes += sum(n for _, _, n in pending.trees.values())
            return out

        return wrapper

    def _counted(self, name: str, function: Any) -> Any:
        main = threading.main_thread()

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            if threading.current_thread() is main:
                self.calls[f"{name}_main"] += 1
            return function(*args, **kwargs)

        return wrapper


def measure(
    factory: Callable[[], Any], requests: list[Any], probe: Probe, profile: bool, warmup: bool
) -> dict[str, Any]:
    """Time one run of ``requests`` step by step on a fresh engine (after a warm-up run when
    ``warmup``: the plain runs before already met every grammar state, so it is optional)."""
    if warmup:
        engine = factory()
        spec_bench.run_engine(engine, requests)
        engine.close()
    engine = factory()
    probe.reset()
    profiler = probe.profiler = cProfile.Profile() if profile else None
    probe.ahead_profiler = cProfile.Profile() if profile else None
    tokens = steps = 0
    wall = 0.0
    step_cpu: list[float] = []  # the engine thread's host CPU per step (the start of a burst)
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        start, start_cpu = time.perf_counter(), time.thread_time()
        device_cpu = probe.device_cpu_s
        if profiler is not None:
            profiler.enable()
        outputs = engine.step()
        if profiler is not None:
            profiler.disable()
        wall += time.perf_counter() - start
        step_cpu.append(time.thread_time() - start_cpu - (probe.device_cpu_s - device_cpu))
        for out in outputs:
            tokens += len(out.token_ids)
            if out.finished and out.speculative is not None:
                steps = max(steps, out.speculative.steps)
    probe.profiler = None
    engine_steps, dropped_rows = engine.num_steps, engine.num_dropped_rows
    engine.close()
    host = wall - probe.device_s
    result: dict[str, Any] = {
        "tokens": tokens,
        "engine_steps": engine_steps,
        "dropped_rows": dropped_rows,
        "wall_s": round(wall, 4),
        "device_s": round(probe.device_s, 4),
        "host_ms_per_step": round(1e3 * host / engine_steps, 3),
        "host_cpu_ms_per_step": round(1e3 * sum(step_cpu) / engine_steps, 3),
        "host_cpu_ms_steps": [round(1e3 * v, 2) for v in step_cpu],
        "mask_fill_ms_per_step": round(1e3 * probe.mask_fill_s / engine_steps, 3),
        "mask_jobs_ms_per_step": round(1e3 * probe.mask_jobs_s / engine_steps, 3),
        "accepts_per_token": round(probe.calls["accept"] / tokens, 3),
        "main_accepts_per_token": round(probe.calls["accept_main"] / tokens, 3),
        "forks_per_token": round(probe.calls["fork"] / tokens, 3),
        "forced_calls_per_token": round(probe.calls["forced_tokens"] / tokens, 3),
        "tree_nodes_per_token": round(probe.tree_nodes / tokens, 3),
        "lookahead_ms_per_step": round(1e3 * probe.lookahead_s / engine_steps, 3),
        "lookahead_cpu_ms_per_step": round(1e3 * probe.lookahead_cpu_s / engine_steps, 3),
        "lookahead_nodes_per_step": round(probe.lookahead_nodes / engine_steps, 3),
        "lookahead_wait_ms_per_step": round(1e3 * probe.lookahead_wait_s / engine_steps, 3),
        "closing_batch_ms_per_step": round(1e3 * probe.closing_batch_s / engine_steps, 3),
        "closing_batch_cpu_ms_per_step": round(1e3 * probe.closing_batch_cpu_s / engine_steps, 3),
        "accept_run_ms_per_step": round(1e3 * probe.accept_run_s / engine_steps, 3),
        "accept_run_cpu_ms_per_step": round(1e3 * probe.accept_run_cpu_s / engine_steps, 3),
        "append_ms_per_step": round(1e3 * probe.append_s / engine_steps, 3),
        "append_cpu_ms_per_step": round(1e3 * probe.append_cpu_s / engine_steps, 3),
    }
    if profiler is not None:
        result["profile"] = _top(profiler)
    if probe.ahead_profiler is not None:
        result["lookahead_profile"] = _top(probe.ahead_profiler)
        probe.ahead_profiler = None
    return result


def _top(profiler: cProfile.Profile, n: int = 25) -> dict[str, list[Any]]:
    rows = pstats.Stats(profiler).stats.items()  # type: ignore[attr-defined]

    def name(key: tuple[str, int, str]) -> str:
        path, line, function = key
        return f"{path.split('/')[-1]}:{line}:{function}"

    by_own = sorted(rows, key=lambda kv: -kv[1][2])[:n]
    by_cum = sorted(rows, key=lambda kv: -kv[1][3])[:n]
    return {
        "tottime_s": [[name(k), round(v[2], 4), v[1]] for k, v in by_own],
        "cumtime_s": [[name(k), round(v[3], 4), v[1]] for k, v in by_cum],
    }


def tiny_runner(tokenizer: Any) -> Any:
    """A 2-layer, hidden-64 Llama with the tokenizer's vocabulary on the CPU (``bench/spec.py``'s
    random weights: zero output projections, so greedy choices are a bigram's)."""
    from espalier.engine.config import CacheConfig, ModelConfig, RunnerConfig
    from espalier.engine.model.runner import ModelRunner

    config = ModelConfig(
        model_type="llama",
        vocab_size=tokenizer.vocab_size,
        rms_norm_eps=1e-5,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    return ModelRunner(
        config,
        spec_bench._random_state(config, "cpu"),
        RunnerConfig(device="cpu", cache=CacheConfig(block_size=16, num_blocks=2048)),
    )


def run(args: argparse.Namespace) -> None:
    import torch

    from espalier.constrained.backends import get_backend
    from espalier.constrained.spec import GrammarSpec
    from espalier.server.default_model import default_tokenizer

    tokenizer = default_tokenizer()
    runner = tiny_runner(tokenizer)
    # llguidance's C-API tokenizer built before the timing (its first compile waits for it)
    walk = get_backend("llguidance", tokenizer).tree_walk()  # type: ignore[attr-defined]
    emit({"part": "spec_host", "llguidance_walk": walk})
    schemas = [
        s
        for s in spec_bench.sample_schemas(args.schemas, with_instances=False)
        if spec_bench.compile_schema(s[1], tokenizer, args.backend) is not None
    ]
    service = spec_bench.shared_grammars(
        tokenizer, [GrammarSpec.json_schema(s) for _, s, _ in schemas], backend=args.backend
    )
    from espalier.server.gc_freeze import freeze_startup_heap

    freeze_startup_heap()  # as the server does once loaded (and bench/gpu_spec.py)
    gen = torch.Generator().manual_seed(0)
    batch = args.batch
    prompts = [torch.randint(0, 200_000, (128,), generator=gen).tolist() for _ in range(batch)]
    grammars = [GrammarSpec.json_schema(schemas[i % len(schemas)][1]) for i in range(batch)]
    ahead = {"default": None, "on": True, "off": False}[args.close_ahead]
    setup = gpu_spec._Setup(
        runner,
        tokenizer,
        service,
        batch,
        args.mask_threads,
        closing=not args.no_closing,
        close_ahead=ahead,
        grammar_after_launch=args.grammar_after_launch,
        forced=args.forced,
        text=args.in_process_text,
    )
    # plain runs: each request's length and the oracle's continuations (as bench/gpu_spec.py)
    full = [args.max_tokens] * batch
    c_plain = gpu_spec._run(
        setup.plain, [gpu_spec._requests(prompts, grammars, full, False, "c", args.backend)]
    )
    lengths = [max(1, len(c_plain["outputs"][f"c{i}"])) for i in range(batch)]
    free: list[Any] = [None] * batch
    u_plain = gpu_spec._run(setup.plain, [gpu_spec._requests(prompts, free, lengths, False, "u")])
    probe = Probe()
    results: dict[bool, dict[str, Any]] = {}
    with probe.installed(runner):
        for constrained, base, prefix in ((False, u_plain, "u"), (True, c_plain, "c")):
            continuations = {
                f"{prefix}{i}": (len(p), base["outputs"][f"{prefix}{i}"])
                for i, p in enumerate(prompts)
            }
            budgets = full if constrained and not args.tight_budget else lengths
            reqs = gpu_spec._requests(
                prompts, grammars if constrained else free, budgets, True, prefix, args.backend
            )
            factory = setup.oracle(continuations)
            results[constrained] = measure(factory, reqs, probe, False, args.warmup)
            if args.profile and constrained:
                profiled = measure(factory, reqs, probe, True, args.warmup)
                results[constrained]["profile"] = profiled["profile"]
                results[constrained]["lookahead_profile"] = profiled["lookahead_profile"]
            emit(
                {
                    "part": "spec_host",
                    "batch": batch,
                    "backend": args.backend,
                    "constrained": constrained,
                    "mask_threads": args.mask_threads,
                    "closing": not args.no_closing,
                    "close_ahead": args.close_ahead,
                    "tight_budget": args.tight_budget,
                    "grammar_after_launch": args.grammar_after_launch,
                    "forced": args.forced,
                    "engine": "Engine" if args.in_process_text else "EngineCore",
                    **results[constrained],
                }
            )
    emit(
        {
            "part": "spec_host",
            "batch": batch,
            "backend": args.backend,
            "closing": not args.no_closing,
            "constrained_over_unconstrained_host": round(
                results[True]["host_ms_per_step"] / results[False]["host_ms_per_step"], 3
            ),
            "constrained_over_unconstrained_host_cpu": round(
                results[True]["host_cpu_ms_per_step"] / results[False]["host_cpu_ms_per_step"], 3
            ),
        }
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--schemas", type=int, default=6)
    parser.add_argument(
        "--backend",
        default=spec_bench.BACKEND,
        help="the constrained requests' grammar backend (ConstraintOptions.backend)",
    )
    parser.add_argument("--mask-threads", type=int, default=2)
    parser.add_argument("--no-closing", action="store_true", help="close_within_budget=False")
    parser.add_argument("--profile", action="store_true", help="cProfile the constrained run")
    parser.add_argument(
        "--tight-budget",
        action="store_true",
        help="constrained max_tokens = plain output length (as bench/gpu.py --tight-budget)",
    )
    parser.add_argument(
        "--close-ahead",
        choices=("default", "on", "off"),
        default="default",
        help="SpecConfig.close_ahead (default: the engine's, on)",
    )
    parser.add_argument("--warmup", action="store_true", help="a warm-up run before each timing")
    gpu_spec.add_after_launch_flag(parser)
    gpu_spec.add_forced_flag(parser)
    gpu_spec.add_text_flag(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
