"""xgrammar JSON-schema compile time through espalier against xgrammar alone, in one run.

On JSONSchemaBench schemas the xgrammar profile accepts (after ``prepare_schema``), each schema
is compiled, interleaved, by:

- ``xgrammar_same_semantics`` (the anchor): a plain ``xgrammar.GrammarCompiler`` in this process
  on the same ``TokenizerInfo``, with espalier's semantics: ``strict_mode=False`` (unnamed
  properties allowed, as JSON Schema says), the same whitespace bound and number bounds;
- ``espalier``: ``compile_grammar(spec, tokenizer, "xgrammar")`` with the default options (the
  compile runs in a warm child process and comes back serialized);
- ``espalier_in_process``: the same with ``xgrammar_memory_limit=0`` (compiled in this process:
  the cost of the child round trip is ``espalier`` over this);
- ``xgrammar_defaults``: xgrammar's own defaults (``strict_mode=True``, no number bounds), for
  context: what the JSON-Schema semantics cost.

A schema whose anchor compile takes longer than ``--max-seconds`` is counted and skipped. Prints
one JSON line per variant (p50 / p90 seconds, the p50 ratio to the anchor's p50 and the median
of the per-schema ratios), then a summary:

    python bench/compile.py [--data .data/jsonschemabench] [--schemas 20] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xgrammar

from espalier.constrained.backends import get_backend
from espalier.constrained.backends.common import BackendOptions
from espalier.constrained.compile import compile_grammar, prepare_schema
from espalier.constrained.errors import GrammarError
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.tokenizer import TokenizerInfo

ANCHOR = "xgrammar_same_semantics"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def xgrammar_schemas(data: Path, count: int, seed: int) -> list[GrammarSpec]:
    """``count`` random schemas that the xgrammar profile enforces exactly, prepared."""
    files = sorted(p for p in data.rglob("*.json") if p.name != "manifest.json")
    random.Random(seed).shuffle(files)
    specs = []
    for path in files:
        try:
            prepared = prepare_schema(json.loads(path.read_text())["schema"], None, ("xgrammar",))
        except (GrammarError, ValueError, RecursionError, KeyError):
            continue
        if not prepared.issues["xgrammar"]:
            specs.append(GrammarSpec.json_schema(prepared.schema, max_bytes=1 << 30))
        if len(specs) == count:
            break
    return specs


def variants(tokenizer: TokenizerInfo) -> dict[str, Callable[[GrammarSpec], Any]]:
    child = BackendOptions()
    in_process = BackendOptions(xgrammar_memory_limit=0)
    backend = get_backend("xgrammar", tokenizer, in_process)
    plain = xgrammar.GrammarCompiler(
        backend.tokenizer_info, max_threads=child.max_threads, cache_enabled=False
    )
    # the child pool warms up here, not inside the first timed compile (a start is seconds)
    compile_grammar(
        GrammarSpec.json_schema({"type": "integer"}), tokenizer, "xgrammar", options=child
    )

    def same_semantics(spec: GrammarSpec) -> Any:
        _, kwargs = backend.request(spec)
        return plain.compile_json_schema(**kwargs)

    return {
        ANCHOR: same_semantics,
        "espalier": lambda spec: compile_grammar(spec, tokenizer, "xgrammar", options=child),
        "espalier_in_process": lambda spec: compile_grammar(
            spec, tokenizer, "xgrammar", options=in_process
        ),
        "xgrammar_defaults": lambda spec: plain.compile_json_schema(spec.source),
    }


def timed(fn: Callable[[GrammarSpec], Any], spec: GrammarSpec) -> float | None:
    start = time.perf_counter()
    try:
        fn(spec)
    except GrammarError:
        return None
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=".data/jsonschemabench")
    parser.add_argument("--schemas", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=30.0)
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer folder (default: Gemma)")
    args = parser.parse_args()
    tokenizer = (
        TokenizerInfo.from_pretrained(args.tokenizer) if args.tokenizer else TokenizerInfo.default()
    )
    runs = variants(tokenizer)
    times: dict[str, list[float]] = {name: [] for name in runs}
    skipped = 0
    for n, spec in enumerate(xgrammar_schemas(Path(args.data), args.schemas, args.seed)):
        anchor = timed(runs[ANCHOR], spec)
        if anchor is None or anchor > args.max_seconds:
            skipped += 1
            continue
        row = {ANCHOR: anchor}
        order = [name for name in runs if name != ANCHOR]
        for name in order if n % 2 == 0 else reversed(order):  # alternate who goes first
            row[name] = timed(runs[name], spec)
        if any(seconds is None for seconds in row.values()):
            skipped += 1
            continue
        for name, seconds in row.items():
            assert seconds is not None
            times[name].append(seconds)
    anchor_p50 = percentile(times[ANCHOR], 0.5)
    for name, values in times.items():
        p50 = percentile(values, 0.5)
        ratios = [mine / anchor for mine, anchor in zip(values, times[ANCHOR], strict=True)]
        print(
            json.dumps(
                {
                    "variant": name,
                    "schemas": len(values),
                    "p50_s": round(p50, 4),
                    "p90_s": round(percentile(values, 0.9), 4),
                    "p50_ratio_to_anchor": round(p50 / anchor_p50, 3),
                    "median_per_schema_ratio": round(percentile(ratios, 0.5), 3),
                }
            )
        )
    print(json.dumps({"summary": True, "anchor": ANCHOR, "skipped": skipped}))


if __name__ == "__main__":
    main()
