"""Per backend: compile time and single-step mask time (p50/p99) on JSONSchemaBench schemas, and
the overhead of our matcher wrapper's ``fill_bitmask`` over calling the library directly.

Both fills run in the same process on the same matcher states, interleaved (wrapper, direct,
wrapper, ...) so load changes hit both alike. States: the start state and every prefix of the
first valid test instance (up to ``--steps`` tokens). Prints one JSON line per backend:

    python bench/masks.py [--data .data/jsonschemabench] [--schemas 60] [--repeat 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from espalier.constrained import bitmask as bm
from espalier.constrained.backends import BACKENDS, get_backend
from espalier.constrained.compile import prepare_schema
from espalier.constrained.errors import GrammarError
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.tokenizer import TokenizerInfo
from espalier.server.default_model import default_tokenizer


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def direct_fill(matcher: Any, backend: str) -> Any:
    """A closure calling the library's own mask function on ``matcher``'s native state."""
    native = matcher.native
    if backend == "llguidance":
        return lambda mask: native.mask_at(mask.data_ptr(), mask.shape[1] * 4)
    if backend == "xgrammar":
        return lambda mask: native.fill_next_token_bitmask(mask, 0)
    words = matcher._words  # outlines-core: same call the adapter makes, without the fix-ups
    return lambda mask: native.write_mask_into(mask.data_ptr(), words, 4)


def timed_pair(
    matcher: Any, fill: Any, mask: torch.Tensor, wrapper_first: bool
) -> tuple[float, float]:
    """Seconds of (our ``fill_bitmask``, the library's own call) on the same state."""
    calls = [lambda: matcher.fill_bitmask(mask, 0), lambda: fill(mask)]
    if not wrapper_first:
        calls.reverse()
    t0 = time.perf_counter()
    calls[0]()
    t1 = time.perf_counter()
    calls[1]()
    t2 = time.perf_counter()
    first, second = t1 - t0, t2 - t1
    return (first, second) if wrapper_first else (second, first)


def sample_files(data: Path, count: int) -> list[Path]:
    files = sorted(p for p in data.rglob("*.json") if p.name != "manifest.json")
    step = max(1, len(files) // count)
    return files[::step][:count]


def bench_backend(
    name: str, files: list[Path], tokenizer: TokenizerInfo, args: Any
) -> dict[str, Any]:
    engine = get_backend(name, tokenizer)
    mask = bm.allocate(1, tokenizer.vocab_size)
    compile_ms: list[float] = []
    wrapper_us: list[float] = []
    direct_us: list[float] = []
    wrapper_total = direct_total = 0.0
    compiled_count = 0
    for path in files:
        case = json.loads(path.read_text())
        try:
            prepared = prepare_schema(case["schema"]).schema
            spec = GrammarSpec.json_schema(prepared, max_bytes=1 << 30)
            start = time.perf_counter()
            compiled = engine.compile(spec)
            compile_ms.append((time.perf_counter() - start) * 1e3)
        except (GrammarError, ValueError, RecursionError):
            continue
        compiled_count += 1
        valid = [t["data"] for t in case.get("tests", []) if t.get("valid")]
        tokens = tokenizer.encode(json.dumps(valid[0], ensure_ascii=False)) if valid else []
        matcher = compiled.matcher()
        fill = direct_fill(matcher, name)
        for step in range(min(len(tokens), args.steps) + 1):
            for rep in range(args.repeat):
                # alternate who goes first: a library may cache the mask of a state it just saw
                wrapper_s, direct_s = timed_pair(matcher, fill, mask, wrapper_first=rep % 2 == 0)
                wrapper_us.append(wrapper_s * 1e6)
                direct_us.append(direct_s * 1e6)
                wrapper_total += wrapper_s
                direct_total += direct_s
            if step < len(tokens) and not matcher.accept(tokens[step]):
                break
    return {
        "backend": name,
        "schemas": len(files),
        "compiled": compiled_count,
        "compile_ms_p50": round(percentile(compile_ms, 0.5), 3),
        "compile_ms_p99": round(percentile(compile_ms, 0.99), 3),
        "mask_us_p50": round(percentile(wrapper_us, 0.5), 2),
        "mask_us_p99": round(percentile(wrapper_us, 0.99), 2),
        "direct_mask_us_p50": round(percentile(direct_us, 0.5), 2),
        "direct_mask_us_p99": round(percentile(direct_us, 0.99), 2),
        "wrapper_overhead_pct_p50": round(
            100 * (statistics.median(wrapper_us) / statistics.median(direct_us) - 1), 2
        )
        if direct_us
        else None,
        "wrapper_overhead_pct_total": round(100 * (wrapper_total / direct_total - 1), 2)
        if direct_total
        else None,
        "mask_samples": len(wrapper_us),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=".data/jsonschemabench")
    parser.add_argument("--schemas", type=int, default=60)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer folder (default: Gemma)")
    args = parser.parse_args()
    tokenizer = (
        TokenizerInfo.from_pretrained(args.tokenizer) if args.tokenizer else default_tokenizer()
    )
    files = sample_files(Path(args.data), args.schemas)
    torch.set_num_threads(1)
    for name in args.backends.split(","):
        engine = get_backend(name, tokenizer)  # vocabulary views: built once, not timed
        engine.compile(GrammarSpec.json_schema({"type": "string"}))
        print(json.dumps(bench_backend(name, files, tokenizer, args)), flush=True)


if __name__ == "__main__":
    main()
