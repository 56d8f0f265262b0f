"""How long a burst of constrained requests waits for its matchers, printing JSON lines.

A request decodes only once its own matcher exists (``GrammarService.submit_request``); an
llguidance matcher compiles the grammar again (0.7-19 ms each on JSONSchemaBench schemas with
the Gemma vocabulary), so a burst of requests on cached grammars waits on the matcher threads.
Each configuration gets its own service over the same compiled grammars: a warm-up burst, a
pause for spares to be made, then the timed burst (``--burst`` requests round-robin over
``--schemas`` JSONSchemaBench schemas, llguidance): milliseconds from the first submit until
each request's matcher is ready (p50, max, mean), and each figure over the anchor's (the first
configuration: 2 matcher threads, no spares) in the same run.

    .venv/bin/python bench/matcher_burst.py [--burst 32] [--schemas 6] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from typing import Any

import spec as spec_bench  # bench/spec.py (this folder is on sys.path)

CONFIGS = (
    {"matcher_threads": 2, "spares_per_grammar": 0},  # the anchor: main's settings before spares
    {"matcher_threads": None, "spares_per_grammar": 0},
    {"matcher_threads": None, "spares_per_grammar": 16},
)


def _stamp(stamps: list[float], start: float, _future: Any) -> None:
    stamps.append(time.perf_counter() - start)


def main() -> None:
    from concurrent.futures import Future

    from espalier.constrained.cache import CompileCache
    from espalier.constrained.spec import GrammarSpec
    from espalier.engine.api import ConstraintOptions
    from espalier.engine.constraints import GrammarService
    from espalier.server.default_model import default_tokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--burst", type=int, default=32)
    parser.add_argument("--schemas", type=int, default=6)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    tokenizer = default_tokenizer()
    options = ConstraintOptions(backend=spec_bench.BACKEND, allow_weakening=True)
    schemas = [s for _, s, _ in spec_bench.sample_schemas(args.schemas, with_instances=False)]
    specs = [GrammarSpec.json_schema(schemas[i % len(schemas)]) for i in range(args.burst)]
    cache = CompileCache(timeout_s=600.0)
    anchor: dict[str, float] = {}
    for config in CONFIGS:
        service = GrammarService(tokenizer, cache=cache, **config)  # type: ignore[arg-type]
        times: dict[str, list[float]] = {"p50_ms": [], "max_ms": [], "mean_ms": []}
        for _ in range(args.reps):
            stamps: list[float] = []
            futures: list[Future[Any]] = []
            service.submit_request(specs[0], options).result()  # compiles (cached after)
            for _ in range(2):  # warm-up bursts: grammars marked, spares made
                for f in [service.submit_request(s, options) for s in specs]:
                    f.result()
                time.sleep(0.5 + 0.02 * args.burst)
            start = time.perf_counter()
            for spec in specs:
                future = service.submit_request(spec, options)
                future.add_done_callback(partial(_stamp, stamps, start))
                futures.append(future)
            for future in futures:
                future.result()
            ms = sorted(1e3 * t for t in stamps)
            times["p50_ms"].append(statistics.median(ms))
            times["max_ms"].append(ms[-1])
            times["mean_ms"].append(statistics.fmean(ms))
        service.close()
        row = {k: round(statistics.median(v), 3) for k, v in times.items()}
        if not anchor:
            anchor = row
        record: dict[str, Any] = {"part": "matcher_burst", "burst": args.burst, **config, **row}
        record |= {f"{k}_over_anchor": round(v / anchor[k], 3) for k, v in row.items()}
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
