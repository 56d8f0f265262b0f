"""Batch decode on CPU with the embedded model: tokens/s and where a step's time goes, per
variant of the CPU runtime settings, against an anchor variant in the same run (issue 36).

Each variant runs in a child process of its own (the OpenMP runtime reads its settings once, when
torch loads it), in ABAB order over ``--rounds``. A child loads the embedded Gemma 3 270M (fp32),
starts ``--batch`` greedy requests at once on the first ``--batch`` schemas of
``bench/engine.py`` (constrained: each request under its schema; unconstrained: the same prompts,
``ignore_eos``), and times ``--steps`` decode steps after prefill. Per step it reports the forward,
the LM head + sampling, and the rest of the step (grammar, appends, detokenizing: Python).

Variants (``--variants``, the first is the anchor):

- ``default``: torch's defaults (GNU OpenMP threads spin a while between parallel regions);
- ``passive``: ``OMP_WAIT_POLICY=PASSIVE``, what ``espalier serve`` sets
  (``server/cpu_runtime.py``);
- ``one``: one torch thread.

Prints JSON lines: one per (round, variant, mode), then one ``"ratio"`` line per (variant, mode):
tokens/s over the anchor's (median over rounds).

    .venv/bin/python bench/cpu_batch.py [--batch 24] [--steps 12] [--rounds 2] \\
        [--variants default,passive,one] [--modes unconstrained,constrained]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

VARIANTS: dict[str, tuple[dict[str, str], int]] = {
    "default": ({}, 0),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, 0),
    "one": ({}, 1),
}
"""name -> (OpenMP variables of the child, torch threads: 0 = torch's default). The child's
environment is this process's without ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT``, plus these."""


OPENMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def emit(record: dict[str, Any]) -> None:
    print(json.dumps({"bench": "cpu_batch", **record}), flush=True)


def child(args: argparse.Namespace) -> None:
    """Load, run each mode's batch, print one JSON line per mode (stdout)."""
    import torch

    from espalier.constrained.spec import GrammarSpec
    from espalier.engine.api import GenerationRequest, SamplingParams
    from espalier.engine.engine import Engine, EngineConfig
    from espalier.engine.scheduler import SchedulerConfig
    from espalier.server.default_model import default_gguf

    if args.threads:
        torch.set_num_threads(args.threads)
    schemas = json.loads(Path(args.schemas_file).read_text())[: args.batch]
    sys.path.insert(0, str(Path(__file__).parent))
    from engine import prompt_for  # bench/engine.py

    engine = Engine.from_model(
        default_gguf(),
        EngineConfig(
            scheduler=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=4096),
            compile_timeout_s=600.0,
        ),
    )
    screen = getattr(engine.strategy, "screen", None)
    if screen is not None:
        screen.wait()
    strategy = engine.strategy
    execute = strategy.execute
    phases: list[tuple[float, float]] = []  # (forward, whole execute) per timed step

    def timed(plan: Any) -> Any:
        t0 = time.perf_counter()
        result = execute(plan)
        phases.append((result.forward_s, time.perf_counter() - t0))
        return result

    strategy.execute = timed  # type: ignore[method-assign]
    for mode in args.modes.split(","):
        for tag, max_tokens in (("warm", 2), ("run", args.steps + 8)):
            for i, schema in enumerate(schemas):
                grammar = GrammarSpec.json_schema(schema) if mode == "constrained" else None
                sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=grammar is None)
                request = GenerationRequest(
                    f"{tag}{i}", prompt=prompt_for(schema), sampling=sampling, grammar=grammar
                )
                engine.add_request(request)
            if tag == "warm":
                while engine.has_unfinished():
                    engine.step()
        while engine.scheduler.num_running < len(schemas) or any(
            r.num_computed_tokens < len(r.prompt_ids) for r in engine.scheduler.running
        ):
            engine.step()  # compiles and prefill
        phases.clear()
        tokens, t0 = 0, time.perf_counter()
        for _ in range(args.steps):
            tokens += sum(len(out.token_ids) for out in engine.step())
        seconds = time.perf_counter() - t0
        forward = statistics.median(f for f, _ in phases)
        execute_s = statistics.median(e for _, e in phases)
        record = {
            "mode": mode,
            "tok_per_s": tokens / seconds,
            "step_ms": 1000 * seconds / args.steps,
            "forward_ms": 1000 * forward,
            "head_and_sampling_ms": 1000 * (execute_s - forward),
            "threads": torch.get_num_threads(),
        }
        print(json.dumps(record), flush=True)
        while engine.has_unfinished():
            engine.step()
    engine.close()


def parent(args: argparse.Namespace) -> None:
    import xgrammar

    sys.path.insert(0, str(Path(__file__).parent))
    from engine import select_schemas  # bench/engine.py
    from espalier.server.default_model import default_tokenizer

    tokenizer = default_tokenizer()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=tokenizer.vocab_size)
    chosen = select_schemas(args.batch, tokenizer, xgrammar.GrammarCompiler(info))
    schemas_file = ROOT / ".data" / "cpu_batch_schemas.json"
    schemas_file.write_text(json.dumps([schema for _, schema in chosen]))
    variants = args.variants.split(",")
    emit({"event": "start", "batch": args.batch, "steps": args.steps, "variants": variants})
    rates: dict[tuple[str, str], list[float]] = {}
    for rnd in range(args.rounds):
        for name in variants if rnd % 2 == 0 else variants[::-1]:
            env_extra, threads = VARIANTS[name]
            cmd = [sys.executable, __file__, "--child", "--schemas-file", str(schemas_file)]
            cmd += ["--batch", str(args.batch), "--steps", str(args.steps)]
            cmd += ["--modes", args.modes, "--threads", str(threads)]
            env = {k: v for k, v in os.environ.items() if k not in OPENMP_WAIT_VARIABLES}
            env.update(env_extra)
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            for line in out.stdout.splitlines():
                record = json.loads(line)
                rates.setdefault((name, record["mode"]), []).append(record["tok_per_s"])
                emit({"round": rnd, "variant": name, "load": os.getloadavg()[0], **record})
    anchor = variants[0]
    for name in variants[1:]:
        for mode in args.modes.split(","):
            ours = statistics.median(rates[(name, mode)])
            base = statistics.median(rates[(anchor, mode)])
            emit({"event": "ratio", "variant": name, "anchor": anchor, "mode": mode,
                  "tok_per_s_ratio": round(ours / base, 3)})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default="default,passive,one")
    parser.add_argument("--modes", default="unconstrained,constrained")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schemas-file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
