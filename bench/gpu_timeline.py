"""Where a speculative engine step's wall time goes, phase by phase, on the GPU machine:
``bench/gpu.py`` with timing probes, printing one JSON line per timed equal-work run.

It splits the engine step, on the engine thread, into its phases (ms per engine step, means
over the timed run; the warm-up run each ``gpu_spec._run`` makes first is not counted):

- ``schedule``, ``execute`` (the strategy, plain or speculative: with ``grammar_after_launch``
  its ``launch``, ``fill`` and ``finish`` apart, summed), and inside it ``draft``,
  ``forward`` (launching the verify forward: asynchronous on CUDA), ``mask_wait``
  (``PendingMasks.result``: helping with fills, then waiting), ``verify`` (masked verification:
  it waits for the GPU), ``logprobs``, ``copy_slots``;
- ``append`` (``EngineCore._begin_append``, ``_accept_firsts`` and ``_end_append``: all requests'
  appends, the batch accept of their tokens past the run included), ``accept_run``, ``closing``
  (``BudgetCloser.instead``) and ``take`` (a closing decision taken from its lookahead: waits
  for a running job, or runs it inline), ``decide`` and ``search`` (the closer's decisions and
  closing-path searches made on the engine thread itself), ``finish`` (``EngineCore._finish``: a
  finished request's last chunk);
- ``closing_batch`` (``BudgetCloser.prepare``: the step's first inline decisions), and inside it
  ``memo_of`` and ``answer_all`` (the decisions advanced: their ``stitch`` tries, and
  ``search_all``, each wave's native searches);
- ``text`` (``OutputProcessor.process``: detokenization and finished requests'
  post-validation; only with ``--in-process-text``: by default the engines are
  ``EngineCore``s, whose text the server process makes when served);
- ``other``: the step minus schedule, execute, append and text;

and, from every thread: ``fill_sum`` (the mask threads' fill jobs: one per tree filled alone,
one per tree batch, whose native threads fill its trees in parallel; ``fill_threads``: the
threads that filled), ``native_walk`` (the part of them inside llguidance's native tree batch
call, GIL re-acquisition on return included), ``plain_fill`` (plain decoding's one batch
grammar call per step, ``constrained.batch``), ``lookahead_sum`` (closing lookahead jobs;
``lookahead_inline``: those run by the engine thread), and per
step ``fill_span`` (from the end of ``MaskBuilder.submit`` to the end of the step's last fill)
and ``fill_max`` (its slowest fill job); per step, in ms after the verify forward's call starts:
``gpu_forward_end`` (CUDA events), ``masks_ready`` and ``verified`` (``_gpu_clock``);
``gc``: garbage collections (any thread, ``gc.callbacks``; ``calls["gc_genN"]``).
Per step also ``per_step_counts``: ``rows`` (sequences in the step's forwards: admission waves
show as steps with fewer), ``eager`` forwards (no CUDA graph fit) and ``compiles`` (new
variants in the Triton caches of ``espalier.kernels``: anything compiled at run time), and
``compiled`` per kernel over the run (issue 28: nothing should be).

Step by step, in order: ``per_step_ms`` (the :data:`PER_STEP` phases) and
``clock_per_step_ms`` (the clock above, and ``verify_cpu``: the engine thread's CPU time in
verification), to tell a uniformly slower step from a few slow ones. Per step also the engine
thread's context switches during verification (``getrusage(RUSAGE_THREAD)``):
``verify_preempted`` (involuntary: the thread was runnable and a core was taken from it) and
``verify_blocked`` (voluntary: it waited, for the GPU, the GIL or a lock), to tell a
verification that waits for cores from one that waits for the interpreter lock; likewise
``accept_run_blocked``, ``closing_batch_blocked`` and ``append_blocked``, with those phases'
engine-thread CPU time in ``per_step_ms`` (``accept_run_cpu``, ...: :data:`WAIT_PHASES`). Per step,
``per_step_cpu_ms``: CPU time of each :data:`THREAD_GROUPS` group of threads (the engine thread,
the mask threads, the grammar service's spare and request matcher threads, other Python threads,
native threads), to tell which background work runs alongside a step; and among the phases
``poll`` (requests' matchers handed over), ``lookahead_make`` (the closing lookahead's jobs made
on the engine thread) and ``submit`` (``MaskBuilder.submit``).

    python3 bench/gpu_timeline.py --tokenizer .data/gpu/gemma_tok --skip-decode \\
        --spec-reps 3 --spec-batches 32 --profile-batch 0
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import gpu  # bench/gpu.py (this folder is on sys.path)
import gpu_spec  # bench/gpu_spec.py
import spec as spec_bench  # bench/spec.py

import espalier.constrained.backends.llguidance.native.capi as native_llguidance
import espalier.engine.closing as closing
import espalier.engine.closing.ahead as closing_ahead
import espalier.engine.closing.batch as closing_batch
import espalier.engine.engine as engine_mod
import espalier.engine.model.runner as runner_mod
import espalier.engine.output as output_mod
import espalier.engine.scheduler as scheduler_mod
import espalier.engine.spec.decoder as decoder_mod
import espalier.engine.spec.masks as masks
import espalier.engine.spec.strategy as strategy_mod
import espalier.engine.step as step_mod

MAIN_PHASES: tuple[tuple[str, Any, str], ...] = (  # (phase, owner, attribute)
    ("step", engine_mod.Engine, "step"),  # with --in-process-text: the core's and the text
    ("step", engine_mod.EngineCore, "step"),
    ("poll", engine_mod.EngineCore, "_poll_grammars"),
    ("schedule", scheduler_mod.Scheduler, "schedule"),
    *(  # execute, or apart (``grammar_after_launch``) launch, fill and finish
        ("execute", owner, attribute)
        for owner in (strategy_mod.SpeculativeDecoding, step_mod.PlainDecoding)
        for attribute in ("execute", "launch", "fill", "finish")
    ),
    ("draft", decoder_mod.SpeculativeDecoder, "_propose"),
    ("lookahead_make", closing.BudgetCloser, "lookaheads"),
    ("submit", masks.MaskBuilder, "submit"),
    ("forward", runner_mod.ModelRunner, "forward"),
    ("mask_wait", masks.PendingMasks, "result"),
    ("verify", decoder_mod.SpeculativeDecoder, "_verify"),
    ("logprobs", decoder_mod.SpeculativeDecoder, "_logprobs"),
    ("copy_slots", runner_mod.ModelRunner, "copy_slots"),
    ("append", engine_mod.EngineCore, "_begin_append"),
    ("append", engine_mod.EngineCore, "_accept_firsts"),
    ("append", engine_mod.EngineCore, "_end_append"),
    ("accept_run", engine_mod.EngineCore, "_accept_runs"),
    ("closing", closing.BudgetCloser, "instead"),
    ("closing_batch", closing.BudgetCloser, "prepare"),
    ("memo_of", closing.BudgetCloser, "_memo_of"),
    ("answer_all", closing, "answer_all"),
    ("stitch", closing.ClosingPaths, "stitch"),
    ("search_all", closing_batch, "_search_all"),
    ("take", closing_ahead.Lookahead, "take"),
    ("decide", closing.BudgetCloser, "decide"),
    ("search", closing.ClosingPaths, "search_after"),
    ("finish", engine_mod.EngineCore, "_finish"),
    ("text", output_mod.OutputProcessor, "process"),
)

PER_STEP = (
    "step",
    "poll",
    "schedule",
    "execute",
    "draft",
    "lookahead_make",
    "submit",
    "forward",
    "mask_wait",
    "verify",
    "append",
    "accept_run",
    "closing",
    "closing_batch",
    "take",
    "lookahead_inline",
    "finish",
    "text",
    "gc",
    "decide",
    "search",
    "plain_fill",
    "memo_of",
    "answer_all",
    "stitch",
    "search_all",
    "accept_run_cpu",
    "closing_batch_cpu",
    "append_cpu",
)
"""Phases also reported step by step (``per_step_ms``: ms per engine step, in order)."""

WAIT_PHASES = ("accept_run", "closing_batch", "append")
"""Engine-thread phases also timed in thread CPU (``{phase}_cpu``) and counted in voluntary
context switches (``per_step_counts["{phase}_blocked"]``): wall time over CPU time with switches
is the thread waiting (for the GIL, or for native threads it handed work to)."""


class Timeline:
    """Phase sums (engine thread), fill and lookahead sums (any thread), per-step fill spans."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.main = threading.main_thread()
        self.on = False
        self._open: set[str] = set()  # phases the main thread is inside (nested calls: once)
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.steps = 0
        self.spans: list[float] = []
        self.maxes: list[float] = []
        self.fill_threads: set[str] = set()
        self.clock: dict[str, list[float]] = defaultdict(list)  # _gpu_clock, seconds
        self._submitted = 0.0
        self._fill_end = 0.0
        self._fill_max = 0.0
        self.per_step: dict[str, list[float]] = defaultdict(list)  # PER_STEP phases, ms
        self._step_base: dict[str, float] = {}
        self._gc_start = 0.0
        self.step_counts: dict[str, int] = defaultdict(int)  # this step's eager forwards
        self.per_step_counts: dict[str, list[int]] = defaultdict(list)
        self.per_step_cpu: dict[str, list[float]] = defaultdict(list)  # THREAD_GROUPS, ms
        self._cpu_base: dict[str, int] = _thread_cpu()
        self.compiled: dict[str, int] = defaultdict(int)  # kernel -> variants built in the run
        self._variants = _variants()

    def _close_step(self) -> None:
        """Record this step's share of the PER_STEP phases (sums since the last step), its
        eager forwards and the Triton variants built during it."""
        for key in PER_STEP:
            total = self.sums.get(key, 0.0)
            self.per_step[key].append(round((total - self._step_base.get(key, 0.0)) * 1e3, 2))
            self._step_base[key] = total
        variants = _variants()
        new = {k: n - self._variants.get(k, 0) for k, n in variants.items()}
        for kernel, n in new.items():
            if n:
                self.compiled[kernel] += n
        self._variants = variants
        self.per_step_counts["compiles"].append(sum(new.values()))
        self.per_step_counts["eager"].append(self.step_counts.pop("eager", 0))
        self.per_step_counts["rows"].append(self.step_counts.pop("rows", 0))
        for key in ("verify_preempted", "verify_blocked", *(f"{p}_blocked" for p in WAIT_PHASES)):
            self.per_step_counts[key].append(self.step_counts.pop(key, 0))
        cpu = _thread_cpu()
        for group in THREAD_GROUPS:
            used = cpu.get(group, 0) - self._cpu_base.get(group, 0)
            self.per_step_cpu[group].append(round(used / 1e6, 2))
        self._cpu_base = cpu

    def gc_callback(self, phase: str, info: dict[str, int]) -> None:
        """``gc.callbacks``: collection time, any thread (``gc`` in the sums)."""
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self.on and self._gc_start:
            self.sums["gc"] += time.perf_counter() - self._gc_start
            self.calls[f"gc_gen{info.get('generation', -1)}"] += 1

    def phase(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.on or threading.current_thread() is not self.main or name in self._open:
                return function(*args, **kwargs)
            start = time.perf_counter()
            usage = resource.getrusage(resource.RUSAGE_THREAD) if name in WAIT_PHASES else None
            self._open.add(name)
            try:
                return function(*args, **kwargs)
            finally:
                self._open.discard(name)
                self.sums[name] += time.perf_counter() - start
                self.calls[name] += 1
                if usage is not None:
                    after = resource.getrusage(resource.RUSAGE_THREAD)
                    cpu = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
                    self.sums[f"{name}_cpu"] += cpu
                    self.step_counts[f"{name}_blocked"] += after.ru_nvcsw - usage.ru_nvcsw
                if name == "step":
                    self.steps += 1
                    self._close_step()

        return wrapper

    def submit(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.on and self._submitted:  # close the previous step's span
                self._close_span()
            out = function(*args, **kwargs)
            self._submitted = time.perf_counter()
            self._fill_end = self._submitted
            self._fill_max = 0.0
            return out

        return wrapper

    def _close_span(self) -> None:
        self.spans.append(self._fill_end - self._submitted)
        self.maxes.append(self._fill_max)
        self._submitted = 0.0

    def worker(self, key: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                end = time.perf_counter()
                if self.on:
                    with self.lock:
                        self.sums[key] += end - start
                        thread = threading.current_thread()
                        if key == "fill_sum":
                            self._fill_end = max(self._fill_end, end)
                            self._fill_max = max(self._fill_max, end - start)
                            self.fill_threads.add(thread.name)
                        elif key == "lookahead_sum" and thread is self.main:
                            self.sums["lookahead_inline"] += end - start

        return wrapper

    def record(self) -> dict[str, Any]:
        if self._submitted:
            self._close_span()
        steps = max(self.steps, 1)
        ms = {k: round(v * 1e3 / steps, 3) for k, v in sorted(self.sums.items())}
        ms["other"] = round(
            ms.get("step", 0.0)
            - ms.get("schedule", 0.0)
            - ms.get("execute", 0.0)
            - ms.get("append", 0.0)
            - ms.get("text", 0.0),
            3,
        )
        spans = sorted(self.spans)
        maxes = sorted(self.maxes)

        def pct(values: list[float], q: float) -> float:
            return round(values[int(q * (len(values) - 1))] * 1e3, 3) if values else 0.0

        return {
            "engine_steps": self.steps,
            "ms_per_step": ms,
            "calls": dict(sorted(self.calls.items())),
            "fill_threads": sorted(self.fill_threads),
            "fill_span_ms_p50_p90_max": [pct(spans, 0.5), pct(spans, 0.9), pct(spans, 1.0)],
            "fill_max_ms_p50_p90_max": [pct(maxes, 0.5), pct(maxes, 0.9), pct(maxes, 1.0)],
            **{
                f"{key}_ms_p50_p90_max": [pct(v, 0.5), pct(v, 0.9), pct(v, 1.0)]
                for key, v in ((k, sorted(vs)) for k, vs in sorted(self.clock.items()))
            },
            "per_step_ms": dict(self.per_step),
            "per_step_counts": dict(self.per_step_counts),
            "per_step_cpu_ms": dict(self.per_step_cpu),
            "compiled": dict(self.compiled),
            "clock_per_step_ms": {
                k: [round(v * 1e3, 2) for v in vs] for k, vs in sorted(self.clock.items())
            },
        }


THREAD_GROUPS = ("engine", "tree-mask", "espalier-spare", "espalier-matcher", "python", "native")
"""``per_step_cpu_ms``: CPU time per step of the engine thread, the mask threads (fills and the
closing lookahead), the spare-matcher and matcher threads, other Python threads, and threads
Python did not start (torch's, llguidance's, the native walks' and searches')."""


def _thread_cpu() -> dict[str, int]:
    """CPU nanoseconds so far of this process's threads, by :data:`THREAD_GROUPS` group
    (``/proc/self/task/*/schedstat``; threads that ended are no longer counted)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out: dict[str, int] = defaultdict(int)
    for entry in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{entry}/schedstat") as f:
                used = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        tid = int(entry)
        name = names.get(tid)
        if tid == main:
            group = "engine"
        elif name is None:
            group = "native"
        else:
            group = next((g for g in THREAD_GROUPS[1:4] if name.startswith(g)), "python")
        out[group] += used
    return dict(out)


def _triton_kernels() -> dict[str, Any]:
    """Every Triton kernel of ``espalier.kernels``, by ``module.name``."""
    import importlib
    import pkgutil

    import triton

    import espalier.kernels as package

    kernels = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"espalier.kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.jit.JITFunction):
                kernels[f"{info.name}.{name}"] = value
    return kernels


_KERNELS: dict[str, Any] = {}


def _variants() -> dict[str, int]:
    """Compiled variants per kernel in this process (Triton's per-device caches)."""
    if not _KERNELS:
        _KERNELS.update(_triton_kernels())
    return {
        name: sum(len(cache[0]) for cache in getattr(fn, "device_caches", {}).values())
        for name, fn in _KERNELS.items()
    }


def _count_replays(line: Timeline) -> None:
    """Count verify forwards by outcome: a graph replay, or eager (no graph fits the step:
    a prefill, or a tree larger than every captured tree size), with the
    number of distinct tree sizes in the step."""
    import espalier.engine.model.cuda_graphs as graphs

    forward = graphs.StepGraphs.forward

    def wrapper(self: Any, batch: Any, hidden_layers: Any) -> Any:
        out = forward(self, batch, hidden_layers)
        if line.on:
            sizes = {len(s.token_ids) for s in batch}
            key = "replayed" if out is not None else "eager"
            line.step_counts["rows"] += len(batch)
            line.calls[f"forward_{key}"] += 1
            line.calls[f"forward_{key}_tree_sizes_{len(sizes)}"] += 1
            if out is None:
                line.step_counts["eager"] += 1
        return out

    graphs.StepGraphs.forward = wrapper  # type: ignore[method-assign]


def _gpu_clock(line: Timeline) -> None:
    """Per speculative step, on the engine thread, ms after the verify forward's call starts:
    when its GPU work ends (CUDA events around the call; the stream is idle when it starts,
    after the last step's host sync), when the masks are ready (``PendingMasks.result``
    returns) and when verification returns. GPU end before masks ready: the masks were late;
    the other way round: the forward was."""
    import torch

    forward = runner_mod.ModelRunner.forward
    result = masks.PendingMasks.result
    verify = decoder_mod.SpeculativeDecoder._verify
    state: dict[str, Any] = {}

    def timed_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not line.on or self.device.type != "cuda":
            return forward(self, *args, **kwargs)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        state["t0"] = time.perf_counter()
        begin.record()
        out = forward(self, *args, **kwargs)
        end.record()
        state["events"] = (begin, end)
        state.pop("masks", None)
        return out

    def timed_result(self: Any) -> Any:
        out = result(self)
        if line.on and "t0" in state and "masks" not in state:
            state["masks"] = time.perf_counter() - state["t0"]
        return out

    def timed_verify(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = resource.getrusage(resource.RUSAGE_THREAD)
        out = verify(self, *args, **kwargs)
        after = resource.getrusage(resource.RUSAGE_THREAD)
        events = state.pop("events", None)
        if line.on and events is not None:
            begin, end = events
            end.synchronize()
            line.clock["gpu_forward_end"].append(begin.elapsed_time(end) / 1e3)
            line.clock["masks_ready"].append(state.get("masks", 0.0))
            line.clock["verified"].append(time.perf_counter() - state["t0"])
            cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            line.clock["verify_cpu"].append(cpu)
            line.step_counts["verify_preempted"] += after.ru_nivcsw - before.ru_nivcsw
            line.step_counts["verify_blocked"] += after.ru_nvcsw - before.ru_nvcsw
        return out

    runner_mod.ModelRunner.forward = timed_forward  # type: ignore[method-assign]
    masks.PendingMasks.result = timed_result  # type: ignore[method-assign]
    decoder_mod.SpeculativeDecoder._verify = timed_verify  # type: ignore[method-assign]


def install() -> Timeline:
    """Wrap the phases (class attributes, looked up at call time), ``spec.run_engine`` (the
    warm-up run: not counted) and ``gpu_spec._run`` (one line per run)."""
    line = Timeline()
    gc.callbacks.append(line.gc_callback)
    _count_replays(line)
    _gpu_clock(line)  # inside the phase timers: its own work is not in the phases' times
    for name, owner, attr in MAIN_PHASES:
        setattr(owner, attr, line.phase(name, getattr(owner, attr)))
    masks.MaskBuilder.submit = line.submit(masks.MaskBuilder.submit)  # type: ignore[method-assign]
    masks.MaskBuilder._fill_one = line.worker("fill_sum", masks.MaskBuilder._fill_one)  # type: ignore[method-assign]
    masks.MaskBuilder._fill_batch = line.worker("fill_sum", masks.MaskBuilder._fill_batch)  # type: ignore[method-assign]
    closing_ahead.Lookahead.run = line.worker("lookahead_sum", closing_ahead.Lookahead.run)  # type: ignore[method-assign]
    closing_ahead.Lookahead.together = line.worker(
        "lookahead_sum", closing_ahead.Lookahead.together
    )  # type: ignore[method-assign]
    native_llguidance.walk_batch = line.worker("native_walk", native_llguidance.walk_batch)
    step_mod.PlainDecoding._fill_masks = line.worker(
        "plain_fill", step_mod.PlainDecoding._fill_masks
    )  # type: ignore[method-assign]
    warm_up = spec_bench.run_engine

    def warm_up_off(*args: Any, **kwargs: Any) -> Any:
        line.on = False
        try:
            return warm_up(*args, **kwargs)
        finally:
            line.reset()
            line.on = True

    spec_bench.run_engine = warm_up_off
    run = gpu_spec._run

    def run_and_print(factory: Any, groups: list[list[Any]], profile: bool = False) -> Any:
        out = run(factory, groups, profile)
        line.on = False
        constrained = any(r.grammar is not None for group in groups for r in group)
        speculative = any(r.speculative.enabled for group in groups for r in group)
        head = {"part": "timeline", "constrained": constrained, "speculative": speculative}
        head |= {"requests": sum(len(g) for g in groups), "tok_per_s": round(out["tok_per_s"], 1)}
        head |= {"tokens": out["tokens"], "seconds": round(out["seconds"], 4)}
        print(json.dumps(head | line.record()), flush=True)
        return out

    gpu_spec._run = run_and_print
    return line


if __name__ == "__main__":
    install()
    sys.exit(gpu.main(sys.argv[1:]))
