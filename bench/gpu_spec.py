"""Constrained vs unconstrained on the GPU with equal work: the same tokens per request.

``bench/spec.py``'s GPU part lets each run stop where it stops: a constrained request that the
grammar ends after 22 tokens is compared with an unconstrained one that runs 96, so prefill and
start-up weigh four times more on the constrained side. Here (same 8B-shaped target, oracle
drafter, machinery from ``bench/spec.py``):

1. plain constrained greedy run -> each request's output length ``L_i`` (and the oracle's
   continuation for the constrained speculative run);
2. plain unconstrained run with ``max_tokens = L_i`` per request (its continuation for the
   unconstrained speculative run);
3. both speculative runs (each after a warm-up run of the same requests; the constrained one
   with the plain run's ``max_tokens``, which it ends at or before exactly as the plain run did,
   the unconstrained one with ``max_tokens = L_i``); tokens/s, the ratio,
   accept lengths, and the speculative step's time split (draft / waiting for masks / verify).
   With ``reps`` > 1 the pair runs that many times, interleaved ABBA (a batch-32 run lasts
   ~0.3-0.5 s on the H200, and single runs of the same code gave ratios 0.68 and 0.88: runs
   39a/b); the ratio is then the median of the run-by-run ratios.

``tight_budget`` gives the constrained speculative run ``max_tokens = L_i`` too (the setting
of runs 40-46): every request then ends exactly at its budget, so the closing policy
(``engine/closing/``) checks its tokens from the budget's last 64 on, which the user's budget
only asks for where the output runs into it (``at_budget`` requests).

Batch 1 runs the schemas one after another (each request alone; tokens and seconds summed);
batch B runs B requests at once.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import spec as spec_bench  # bench/spec.py (this folder is on sys.path)


def read_anchor_lengths(path: str) -> dict[int, list[int]]:
    """Per batch size, the output lengths in a ``--dump-streams`` file (JSON lines with
    ``batch`` and ``tokens``, in request order): another tree's constrained outputs, e.g.
    ``bench/inputs/h200_b32_streams.jsonl``, b2525ec's at b32. Given to ``equal_work``, this
    tree's unconstrained requests take those lengths, so its unconstrained runs do the anchor
    tree's unconstrained work (same prompts, same lengths) and their tok/s compare across
    trees; that run's constrained / unconstrained ratios are then not equal work."""
    import json

    lengths: dict[int, list[int]] = {}
    with open(path) as lines:
        for line in lines:
            if line.strip():
                record = json.loads(line)
                lengths.setdefault(int(record["batch"]), []).append(max(1, len(record["tokens"])))
    return lengths


def add_forced_flag(parser: Any) -> None:
    """``--forced`` on an argparse parser: the speculative runs draft grammar-forced chains too
    (``SpecConfig.methods`` = oracle + forced), so their host work includes the server's
    default forced drafting (root chains, leaf probes, the catch-up fork of
    ``grammar_after_launch``), which the oracle alone never runs."""
    parser.add_argument(
        "--forced",
        action="store_true",
        help="the oracle's trees also get grammar-forced chains (the server's default drafting)",
    )


def add_text_flag(parser: Any) -> None:
    """``--in-process-text`` on an argparse parser: every engine of the run is an ``Engine``
    (the core, then each chunk's detokenization and each constrained output's post-validation
    on the same thread: ``espalier generate --local``'s shape) instead of an ``EngineCore``
    (what ``espalier serve``'s engine process steps; its server process makes the text)."""
    parser.add_argument(
        "--in-process-text",
        action="store_true",
        help="run Engine (text and post-validation on the engine thread, as --local) instead of "
        "EngineCore (the served engine process)",
    )


def add_after_launch_flag(parser: Any) -> None:
    """``--grammar-after-launch [N]`` on an argparse parser: ``EngineConfig.grammar_after_launch``
    for every engine of the run (alone: the engine's ``AFTER_LAUNCH_MIN``; 0: off; absent:
    the engine's default, on for CUDA)."""
    from espalier.engine.engine import AFTER_LAUNCH_MIN

    parser.add_argument(
        "--grammar-after-launch",
        type=int,
        nargs="?",
        const=AFTER_LAUNCH_MIN,
        default=None,
        metavar="N",
        help="plain and speculative steps launch the next forward before their appends when N "
        "or more requests' appends can wait (alone: the engine's AFTER_LAUNCH_MIN; 0: off; "
        "absent: the engine's default, on for CUDA)",
    )


def _requests(
    prompts: Sequence[list[int]],
    grammars: Sequence[Any],
    lengths: Sequence[int],
    speculative: bool,
    prefix: str,
    backend: str = spec_bench.BACKEND,
) -> list[Any]:
    from espalier.engine.api import (
        ConstraintOptions,
        GenerationRequest,
        SamplingParams,
        SpeculativeOptions,
    )

    return [
        GenerationRequest(
            f"{prefix}{i}",
            prompt_token_ids=tuple(p),
            sampling=SamplingParams(max_tokens=n),
            grammar=g,
            constraint=ConstraintOptions(backend=backend, allow_weakening=True),
            speculative=SpeculativeOptions(enabled=speculative),
        )
        for i, (p, g, n) in enumerate(zip(prompts, grammars, lengths))
    ]


def _run(engine_factory: Any, groups: list[list[Any]], profile: bool = False) -> dict[str, Any]:
    """Run each group of requests to completion, one group after another on a fresh engine
    made for this run (each group after a warm-up of the same group); sums of tokens, seconds
    and speculative stats; outputs by request id. ``profile``: also the top host functions
    (cProfile, by own time) of the timed part."""
    import cProfile
    import pstats

    profiler = cProfile.Profile() if profile else None
    total: dict[str, Any] = {"tokens": 0, "seconds": 0.0, "outputs": {}}
    stats = {"steps": 0, "accepted": 0, "draft_s": 0.0, "mask_s": 0.0, "verify_s": 0.0}
    engine = engine_factory()
    for group in groups:
        spec_bench.run_engine(engine, group)  # warm-up: kernels, graphs, allocator
        # the collector's debt from setup and warm-up is not the timed run's: a full collection
        # of this heap took 100-230 ms on the CPU machine, inside timed plain runs
        # (bench/spec_host.py, a gc.callbacks probe)
        gc.collect()
        outputs: dict[str, list[int]] = {r.request_id: [] for r in group}
        steps, dropped = engine.num_steps, engine.num_dropped_rows
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        for request in group:
            engine.add_request(request)
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.request_id].extend(out.token_ids)
                if out.finished and out.speculative is not None:
                    s = out.speculative
                    stats["steps"] += s.steps
                    stats["accepted"] += s.accepted_tokens
                    stats["draft_s"] += s.draft_s
                    stats["mask_s"] += s.mask_s
                    stats["verify_s"] += s.verify_s
        if profiler is not None:
            profiler.disable()
        total["seconds"] += time.perf_counter() - start
        total["engine_steps"] = total.get("engine_steps", 0) + engine.num_steps - steps
        # rows a launch ran for requests the grammar ended behind it (grammar_after_launch)
        total["dropped_rows"] = total.get("dropped_rows", 0) + engine.num_dropped_rows - dropped
        total["tokens"] += sum(len(v) for v in outputs.values())
        total["outputs"].update(outputs)
    engine.close()
    total["tok_per_s"] = total["tokens"] / total["seconds"]
    total["mean_accept_length"] = stats["accepted"] / stats["steps"] if stats["steps"] else 0.0
    total["spec_time_split_s"] = {k: round(v, 4) for k, v in stats.items() if k.endswith("_s")}
    if profiler is not None:
        rows = pstats.Stats(profiler).stats.items()  # type: ignore[attr-defined]
        top = sorted(rows, key=lambda kv: -kv[1][2])[:15]
        total["host_top_tottime_s"] = [
            [f"{path.split('/')[-1]}:{line}:{name}", round(tt, 4), calls]
            for (path, line, name), (_, calls, tt, _, _) in top
        ]
        inclusive = sorted(rows, key=lambda kv: -kv[1][3])[:40]
        total["host_top_cumtime_s"] = [
            [f"{path.split('/')[-1]}:{line}:{name}", round(ct, 4), calls]
            for (path, line, name), (_, calls, _, ct, _) in inclusive
        ]
    return total


@dataclass(frozen=True)
class _Setup:
    runner: Any
    tokenizer: Any
    service: Any
    batch: int
    mask_threads: int
    closing: bool = True  # EngineConfig.close_within_budget (per-token checks near max_tokens)
    launch_first: bool | None = None  # SpecConfig.launch_first (None: forward first on CUDA)
    close_ahead: bool | None = None  # SpecConfig.close_ahead (None: its default)
    tight_budget: bool = False  # constrained speculative max_tokens = L_i (else the user's)
    backend: str = spec_bench.BACKEND  # the constrained requests' ConstraintOptions.backend
    grammar_after_launch: int | None = None  # EngineConfig.grammar_after_launch (None: default)
    forced: bool = False  # the oracle's trees also get grammar-forced chains (the server default)
    text: bool = False  # Engine (text and post-validation in the step) instead of EngineCore

    def requests(
        self,
        prompts: Sequence[list[int]],
        grammars: Sequence[Any],
        lengths: Sequence[int],
        speculative: bool,
        prefix: str,
    ) -> list[Any]:
        return _requests(prompts, grammars, lengths, speculative, prefix, self.backend)

    def groups(self, requests: list[Any]) -> list[list[Any]]:
        """Batch 1: each request alone, one after another; else all at once."""
        return [[r] for r in requests] if self.batch == 1 else [requests]

    def plain(self) -> Any:
        """A new engine: an ``EngineCore``, what the served engine process steps (its text and
        post-validation are the server process's), or with ``text`` an ``Engine``."""
        from espalier.engine.engine import Engine, EngineCore

        kind = Engine if self.text else EngineCore
        return kind(self.engine_config(), self.runner, self.tokenizer, grammar=self.service)

    def oracle(self, continuations: dict[str, tuple[int, list[int]]]) -> Any:
        """A factory of speculative engines proposing ``continuations`` (the oracle drafter)."""
        from espalier.engine.spec.combine import FORCED
        from espalier.engine.spec.strategy import SpecConfig, install

        ahead = SpecConfig.close_ahead if self.close_ahead is None else self.close_ahead

        def make() -> Any:
            engine = self.plain()
            config = SpecConfig(
                methods=("oracle", FORCED) if self.forced else ("oracle",),
                num_draft_tokens=8,
                mask_budget_s=None,
                mask_threads=self.mask_threads,
                launch_first=self.launch_first,
                close_ahead=ahead,
            )
            install(engine, config, {"oracle": spec_bench.OracleDrafter(continuations)})
            return engine

        return make

    def engine_config(self) -> Any:
        from espalier.engine.engine import EngineConfig
        from espalier.engine.scheduler import SchedulerConfig

        config = EngineConfig(
            compile_timeout_s=600,
            scheduler=SchedulerConfig(
                max_num_seqs=self.batch, max_num_batched_tokens=max(4096, 160 * self.batch)
            ),
        )
        if not self.closing and hasattr(config, "close_within_budget"):
            config = replace(config, close_within_budget=False)
        config = replace(config, grammar_after_launch=self.grammar_after_launch)
        return config


def _one_batch(
    setup: _Setup,
    prompts: list[list[int]],
    grammars: list[Any],
    max_tokens: int,
    profile: bool,
    reps: int = 1,
    anchor_lengths: Sequence[int] | None = None,
) -> dict[tuple[bool, bool], dict[str, Any]]:
    """The four runs of one batch size, keyed by (constrained, speculative). The speculative
    pair runs ``reps`` times after an uncounted pair, interleaved (ABBA); each side reports its
    median run, with every run's tok/s (``tok_per_s_reps``), and the constrained side the
    run-by-run ratios (``ratio_reps``, pairs run back to back) and the host profile of its
    first counted run when ``profile``. ``anchor_lengths``: the unconstrained requests'
    lengths instead of the constrained outputs' (``read_anchor_lengths``)."""
    count = len(prompts)
    results: dict[tuple[bool, bool], dict[str, Any]] = {}
    full = [max_tokens] * count
    c_plain = _run(
        setup.plain, setup.groups(setup.requests(prompts, grammars, full, False, "c")), profile
    )
    lengths = [max(1, len(c_plain["outputs"][f"c{i}"])) for i in range(count)]
    c_plain["at_budget"] = sum(n >= max_tokens for n in lengths)
    if anchor_lengths is not None:
        if len(anchor_lengths) != count:
            raise SystemExit(f"{len(anchor_lengths)} anchor lengths for {count} requests")
        lengths = list(anchor_lengths)
    free = [None] * count
    u_plain = _run(setup.plain, setup.groups(setup.requests(prompts, free, lengths, False, "u")))
    plain_jobs = {
        True: setup.groups(setup.requests(prompts, grammars, full, False, "c")),
        False: setup.groups(setup.requests(prompts, free, lengths, False, "u")),
    }
    plain_runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for rep in range(reps if reps > 1 else 0):  # the pair above was the uncounted one
        for constrained in (True, False) if rep % 4 in (0, 3) else (False, True):
            plain_runs[constrained].append(_run(setup.plain, plain_jobs[constrained]))
    if reps > 1:
        pairs = [
            c["tok_per_s"] / u["tok_per_s"] for c, u in zip(plain_runs[True], plain_runs[False])
        ]
        medians = {}
        for constrained, done in plain_runs.items():
            median = dict(sorted(done, key=lambda r: r["tok_per_s"])[(len(done) - 1) // 2])
            median["tok_per_s_reps"] = [round(r["tok_per_s"], 1) for r in done]
            medians[constrained] = median
        medians[True]["at_budget"] = c_plain["at_budget"]
        medians[True]["ratio_reps"] = [round(r, 3) for r in pairs]
        c_plain, u_plain = medians[True], medians[False]
    results[(True, False)], results[(False, False)] = c_plain, u_plain
    jobs = {}
    for constrained, base, prefix in ((True, c_plain, "c"), (False, u_plain, "u")):
        continuations = {
            f"{prefix}{i}": (len(p), base["outputs"][f"{prefix}{i}"]) for i, p in enumerate(prompts)
        }
        budgets = full if constrained and not setup.tight_budget else lengths
        reqs = setup.requests(prompts, grammars if constrained else free, budgets, True, prefix)
        jobs[constrained] = (setup.oracle(continuations), setup.groups(reqs))
    runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    if reps > 1:  # a pair not counted: the first runs of a process meet cold caches (grammar
        for constrained in (True, False):  # compiles, the native walk's tables, allocators)
            _run(*jobs[constrained])
    for rep in range(max(1, reps)):  # ABBA: neither side always runs first
        for constrained in (True, False) if rep % 4 in (0, 3) else (False, True):
            factory, groups = jobs[constrained]
            runs[constrained].append(_run(factory, groups, profile and constrained and not rep))
    for constrained, done in runs.items():
        rates = [r["tok_per_s"] for r in done]
        median = sorted(done, key=lambda r: r["tok_per_s"])[(len(done) - 1) // 2]
        profiled = {k: v for k, v in done[0].items() if k.startswith("host_top")}
        results[(constrained, True)] = {
            **median,
            **profiled,  # the profiled run need not be the median one
            "tok_per_s_reps": [round(t, 1) for t in rates],
        }
    for constrained, base in ((True, c_plain), (False, u_plain)):  # lossless: the same tokens
        same = all(r["outputs"] == base["outputs"] for r in runs[constrained])
        results[(constrained, True)]["outputs_match_plain"] = same
    pairs = [c["tok_per_s"] / u["tok_per_s"] for c, u in zip(runs[True], runs[False])]
    results[(True, True)]["ratio_reps"] = [round(r, 3) for r in pairs]
    return results


DUMP_STREAMS: str | None = None
"""A JSON-lines file that gets each batch's constrained outputs (``bench/gpu.py
--dump-streams``): the run's outputs, to replay on a CPU (``bench/postvalidate.py --streams``)."""


def _dump_streams(
    path: str, batch: int, schemas: list[Any], plain: dict[str, Any], max_tokens: int
) -> None:
    """Append one line per constrained request: its schema, output tokens and max_tokens."""
    import json

    with open(path, "a") as out:
        for i in range(len(plain["outputs"])):
            line = {
                "batch": batch,
                "schema": schemas[i % len(schemas)][1],
                "tokens": plain["outputs"][f"c{i}"],
                "max_tokens": max_tokens,
            }
            out.write(json.dumps(line) + "\n")


def equal_work(
    runner: Any,
    tokenizer: Any,
    batches: Sequence[int],
    max_tokens: int,
    n_schemas: int,
    mask_threads: int,
    emit: Any,
    profile_batch: int = 0,
    closing: bool = True,
    launch_first: bool | None = None,
    close_ahead: bool | None = None,
    reps: int = 1,
    tight_budget: bool = False,
    matcher_spares: int = 16,
    backend: str = spec_bench.BACKEND,
    grammar_after_launch: int | None = None,
    forced: bool = False,
    anchor_lengths: dict[int, list[int]] | None = None,
    text: bool = False,
) -> dict[str, float]:
    """JSON lines per batch size; returns ``{"b{B}_constrained_over_unconstrained_spec": r}``:
    with ``reps`` > 1, the median of the run-by-run ratios. ``matcher_spares``: the grammar
    service's spare matchers per grammar; ``backend``: the constrained requests' grammar backend;
    ``grammar_after_launch``: ``EngineConfig.grammar_after_launch`` (plain and speculative
    runs); ``forced``: grammar-forced chains in the oracle's trees (``add_forced_flag``);
    ``anchor_lengths``: per batch size, the unconstrained requests' lengths
    (``read_anchor_lengths``); ``text``: ``Engine`` instead of ``EngineCore``
    (``add_text_flag``)."""
    import torch

    from espalier.constrained.spec import GrammarSpec

    schemas = [
        s
        for s in spec_bench.sample_schemas(n_schemas, with_instances=False)
        if spec_bench.compile_schema(s[1], tokenizer, backend) is not None
    ]
    service = spec_bench.shared_grammars(
        tokenizer, [GrammarSpec.json_schema(s) for _, s, _ in schemas], matcher_spares, backend
    )
    from espalier.server.gc_freeze import freeze_startup_heap

    freeze_startup_heap()  # as the server does once loaded: no full collections of all this
    gen = torch.Generator().manual_seed(0)
    summary: dict[str, float] = {}
    for batch in batches:
        count = len(schemas) if batch == 1 else batch
        prompts = [torch.randint(0, 200_000, (128,), generator=gen).tolist() for _ in range(count)]
        grammars = [GrammarSpec.json_schema(schemas[i % len(schemas)][1]) for i in range(count)]
        setup = _Setup(
            runner,
            tokenizer,
            service,
            batch,
            mask_threads,
            closing,
            launch_first,
            close_ahead,
            tight_budget,
            backend,
            grammar_after_launch,
            forced,
            text,
        )
        anchor = None if anchor_lengths is None else anchor_lengths.get(batch)
        results = _one_batch(
            setup, prompts, grammars, max_tokens, batch == profile_batch, reps, anchor
        )
        if DUMP_STREAMS:
            _dump_streams(DUMP_STREAMS, batch, schemas, results[(True, False)], max_tokens)
        for (constrained, speculative), r in results.items():
            emit(
                {
                    "part": "spec_equal_work",
                    "batch": batch,
                    "requests": count,
                    "constrained": constrained,
                    "speculative": "oracle" if speculative else "off",
                    "mask_threads": mask_threads,
                    "closing": closing,
                    "launch_first": launch_first,
                    "close_ahead": close_ahead,
                    "tight_budget": tight_budget,
                    "backend": backend,
                    "grammar_after_launch": grammar_after_launch,
                    "forced": forced,
                    "engine": "Engine" if text else "EngineCore",
                    "anchor_lengths": anchor_lengths is not None and batch in anchor_lengths,
                    "torch_threads": torch.get_num_threads(),
                    "switch_interval_ms": sys.getswitchinterval() * 1e3,
                    **{k: v for k, v in r.items() if k != "outputs"},
                }
            )

        def tps(constrained: bool, speculative: bool, results: Any = results) -> float:
            return float(results[(constrained, speculative)]["tok_per_s"])

        ratio = statistics.median(results[(True, True)]["ratio_reps"])
        plain_reps = results[(True, False)].get("ratio_reps")
        plain_ratio = (
            statistics.median(plain_reps) if plain_reps else tps(True, False) / tps(False, False)
        )
        emit(
            {
                "part": "spec_equal_work",
                "batch": batch,
                "mask_threads": mask_threads,
                "closing": closing,
                "close_ahead": close_ahead,
                "tight_budget": tight_budget,
                "backend": backend,
                "torch_threads": torch.get_num_threads(),
                "switch_interval_ms": sys.getswitchinterval() * 1e3,
                "constrained_over_unconstrained_speculative": round(ratio, 3),
                "constrained_over_unconstrained_plain": round(plain_ratio, 3),
                "speedup_unconstrained": round(tps(False, True) / tps(False, False), 3),
                "speedup_constrained": round(tps(True, True) / tps(True, False), 3),
            }
        )
        summary[f"b{batch}_constrained_over_unconstrained_spec"] = round(ratio, 3)
        summary[f"b{batch}_constrained_over_unconstrained_plain"] = round(plain_ratio, 3)
    return summary
