"""A speculative step's tree masks on the CPU: time to the masks, and what the fills leave of the
GIL to the engine thread. JSON lines.

``--batch`` requests (JSONSchemaBench schemas through ``--backend``, llguidance by default, the
duplicate-key tracker on where a schema has free keys; the Gemma tokenizer, 262,144 ids) each
follow a grammar-valid instance. Per step each request drafts the next ``--draft`` tokens of its
instance (a chain: oracle drafts), ``MaskBuilder.submit`` fills the step's trees on
``--mask-threads`` threads, the calling thread (the engine) waits in one of two ways, and each
request then accepts its chain:

- ``wait``: ``PendingMasks.result()`` at once: ``masks_ms`` is the fills' wall time,
  ``cpu_ms`` the process's CPU time meanwhile (every thread: the fills' work, far less
  sensitive than wall time to other processes on the cores);
- ``busy``: pure Python until the fill workers end (the engine launching the next forward, on
  the GPU), then ``result()``: ``masks_ms`` is the fills' wall time next to a thread that wants
  the GIL, ``engine_share`` the rate of Python the caller kept meanwhile over its rate alone
  (1.0: the fills never took the GIL from it).

Whatever ``espalier`` the interpreter imports is measured, so one run compares two trees by
running this file with each one's interpreter (``--label`` names it), one after the other:

    .venv/bin/python bench/tree_batch.py --label new
    (cd /work/main && .venv/bin/python /path/to/this/bench/tree_batch.py --label main)

``[--batch 32] [--draft 8] [--mask-threads 2] [--schemas 8] [--backend llguidance]
[--data .data/jsonschemabench]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import repo_root  # noqa: F401  (bench/repo_root.py: tests.fixtures importable)
from masks import sample_files  # bench/masks.py (this folder is on sys.path)

from espalier.constrained.compile import compile_grammar, prepare_schema
from espalier.constrained.keys import with_unique_keys
from espalier.constrained.spec import GrammarSpec
from espalier.engine.spec.masks import MaskBuilder
from espalier.engine.spec.tree_builder import Draft
from espalier.server.default_model import default_tokenizer
from tests.fixtures.tree_random import sample_instance


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def grammars(tokenizer: Any, files: list[Path], backend: str) -> list[Any]:
    """The compiled grammars of the schemas that compile with ``backend``."""
    out = []
    for path in files:
        try:
            schema = prepare_schema(json.loads(path.read_text())["schema"]).schema
            compiled, _ = compile_grammar(GrammarSpec.json_schema(schema), tokenizer, backend)
        except Exception:  # a schema the backend refuses: not this bench's concern
            continue
        out.append(compiled)
    slot = getattr(out[0], "native_slot", None) if out else None
    if slot is not None:
        slot.wait(120)  # the native walk's tokenizer, built once per process
    return out


def requests(tokenizer: Any, compiled: list[Any], batch: int, seed: int) -> list[Any]:
    """``(matcher, instance)`` per request, each instance grammar-valid from the start."""
    rng = np.random.default_rng(seed)
    out = []
    stops = set(tokenizer.stop_token_ids)
    for b in range(batch):
        grammar = compiled[b % len(compiled)]
        instance = sample_instance(grammar.matcher(), rng, max_tokens=64)
        instance = [t for t in instance if t not in stops]
        out.append((grammar, instance))
    return out


def spin(done: Any) -> int:
    """Chunks of pure Python run until ``done()`` (checked between chunks of ~5 µs)."""
    count = 0
    while not done():
        for _ in range(200):
            pass
        count += 1
    return count


def python_rate(seconds: float) -> float:
    """:func:`spin`'s chunks per second, alone."""
    end = time.perf_counter() + seconds
    return spin(lambda: time.perf_counter() > end) / seconds


def run(tokenizer: Any, plan: list[Any], args: argparse.Namespace, busy: bool) -> dict[str, Any]:
    matchers = [with_unique_keys(g.spec, g.matcher(), tokenizer) for g, _ in plan]
    builder = MaskBuilder(tokenizer.vocab_size, threads=args.mask_threads)
    at = [0] * len(plan)
    masks_ms: list[float] = []
    cpu_ms: list[float] = []
    shares: list[float] = []
    nodes = 0
    try:
        while True:
            live = [b for b, (_, inst) in enumerate(plan) if at[b] + args.draft <= len(inst)]
            if not live:
                break
            drafts = []
            for b in live:
                chain = plan[b][1][at[b] : at[b] + args.draft]
                drafts.append(Draft([0, *chain], list(range(-1, len(chain))), [0.0] * 9, [0] * 9))
                nodes += len(chain) + 1
            alone = python_rate(0.002) if busy else 0.0
            start, start_cpu = time.perf_counter(), time.process_time()
            pending = builder.submit([matchers[b] for b in live], drafts)
            if busy:
                workers = pending.workers
                count = spin(lambda: all(w.done() for w in workers))  # noqa: B023 (called here)
                spun = time.perf_counter() - start
                shares.append(count / spun / alone if spun > 0 else 1.0)
            result = pending.result()
            masks_ms.append(1e3 * (time.perf_counter() - start))
            cpu_ms.append(1e3 * (time.process_time() - start_cpu))
            assert bool(result.filled.all()), "an unbudgeted fill leaves no node unfilled"
            for b in live:
                chain = plan[b][1][at[b] : at[b] + args.draft]
                assert matchers[b].accept_tokens(chain) == len(chain)
                at[b] += len(chain)
    finally:
        builder.close()
    record: dict[str, Any] = {
        "mode": "busy" if busy else "wait",
        "steps": len(masks_ms),
        "nodes": nodes,
        "masks_ms_mean": round(statistics.fmean(masks_ms), 3),
        "masks_ms_p50": round(statistics.median(masks_ms), 3),
        "cpu_ms_mean": round(statistics.fmean(cpu_ms), 3),
    }
    if busy:
        record["engine_share_mean"] = round(statistics.fmean(shares), 3)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="this")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--draft", type=int, default=8)
    parser.add_argument("--mask-threads", type=int, default=2)
    parser.add_argument("--schemas", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="llguidance", help="whose trees (default llguidance)")
    parser.add_argument("--data", type=Path, default=Path(".data/jsonschemabench"))
    args = parser.parse_args()
    tokenizer = default_tokenizer()
    compiled = grammars(tokenizer, sample_files(args.data, args.schemas), args.backend)
    plan = requests(tokenizer, compiled, args.batch, args.seed)
    head = {"part": "tree_batch", "label": args.label, "backend": args.backend}
    head["grammars"] = len(compiled)
    run(tokenizer, plan, args, busy=False)  # warm-up: lexers, allocators, the twins' clones
    for busy in (False, True):
        emit(head | run(tokenizer, plan, args, busy))


if __name__ == "__main__":
    main()
