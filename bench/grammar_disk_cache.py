"""The on-disk compile cache: xgrammar compile vs load from disk, and llguidance's compile.

For each JSON schema (a few hand-written object schemas of growing size) on the default Gemma
tokenizer: xgrammar compile seconds (the anchor), the seconds to load the same grammar from a
``GrammarDiskCache`` (what a restarted server pays), and llguidance's compile seconds (to judge
whether llguidance needs a disk cache at all; it builds lazily, so its first mask is timed too).
Each grammar goes through ``compile_grammar`` directly, so no in-memory cache is involved.

Then a restart: a new process on the same directory makes a ``GrammarDiskCache`` (as the server
does at start), waits for its start-up work (xgrammar's vocabulary view; the preload of recent
files), and times the first load of each grammar: with the preload (the default) and without.

Prints one JSON line per schema, one per restart, and a ``"summary"`` with the medians and the
load/compile ratios.

    .venv/bin/python bench/grammar_disk_cache.py [--schemas 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any


def schema(n: int) -> dict[str, Any]:
    """An object schema with ``n`` typed properties (strings, integers, enums, arrays)."""
    kinds: list[dict[str, Any]] = [
        {"type": "string", "maxLength": 20},
        {"type": "integer", "minimum": 0},
        {"enum": ["red", "green", "blue", "cyan"]},
        {"type": "array", "items": {"type": "number"}, "maxItems": 4},
        {"type": "boolean"},
    ]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)[: n // 2]}


def restart(directory: str, schemas: int, preload: bool) -> dict[str, Any]:
    """In a new process: the first load of each grammar after the cache's start-up work."""
    import subprocess

    code = (
        "import json, sys, time\n"
        "sys.path.insert(0, 'bench')\n"
        "from grammar_disk_cache import schema\n"
        "from espalier.constrained.cache import CacheKey\n"
        "from espalier.constrained.disk_cache import DiskCacheConfig, GrammarDiskCache\n"
        "from espalier.constrained.spec import GrammarSpec\n"
        "from espalier.server.default_model import default_tokenizer\n"
        "tok = default_tokenizer()\n"
        f"config = DiskCacheConfig({directory!r}, preload_bytes={(64 << 20) if preload else 0})\n"
        "start = time.perf_counter()\n"
        "disk = GrammarDiskCache(config, tok)\n"
        "disk.flush()\n"
        "startup = time.perf_counter() - start\n"
        "loads = []\n"
        f"for i in range({schemas}):\n"
        "    spec = GrammarSpec.json_schema(schema(4 * (i + 1)))\n"
        "    key = CacheKey(spec.cache_key, 'xgrammar', tok.fingerprint, (False,))\n"
        "    start = time.perf_counter()\n"
        "    assert disk.load(key) is not None\n"
        "    loads.append(round(time.perf_counter() - start, 4))\n"
        "print(json.dumps({'startup_s': round(startup, 3), 'first_load_s': loads}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=1200
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return {"restart": "preload" if preload else "no_preload", **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=4)
    args = parser.parse_args(argv)

    from espalier.constrained import bitmask
    from espalier.constrained.cache import CacheKey
    from espalier.constrained.compile import compile_grammar
    from espalier.constrained.disk_cache import DiskCacheConfig, GrammarDiskCache
    from espalier.constrained.spec import GrammarSpec
    from espalier.server.default_model import default_tokenizer

    tokenizer = default_tokenizer()
    # first compiles build each backend's vocabulary view: not part of any grammar's time
    compile_grammar(GrammarSpec.json_schema(schema(1)), tokenizer, "xgrammar")
    compile_grammar(GrammarSpec.json_schema(schema(1)), tokenizer, "llguidance")
    rows = []
    rows_mask = bitmask.allocate(1, tokenizer.vocab_size)
    with tempfile.TemporaryDirectory() as directory:
        disk = GrammarDiskCache(DiskCacheConfig(directory, preload_bytes=0), tokenizer)
        for i in range(args.schemas):
            spec = GrammarSpec.json_schema(schema(4 * (i + 1)))
            key = CacheKey(spec.cache_key, "xgrammar", tokenizer.fingerprint, (False,))
            start = time.perf_counter()
            result = compile_grammar(spec, tokenizer, "xgrammar")
            xgr_s = time.perf_counter() - start
            disk.store(key, result)
            disk.flush()  # stores run on the writer thread
            # a new cache reading the file (the restart lines below add a new process)
            fresh = GrammarDiskCache(DiskCacheConfig(directory, preload_bytes=0), tokenizer)
            start = time.perf_counter()
            loaded = fresh.load(key)
            load_s = time.perf_counter() - start
            assert loaded is not None and loaded[1].cache_hit
            start = time.perf_counter()
            llg, _ = compile_grammar(spec, tokenizer, "llguidance")
            llg_s = time.perf_counter() - start
            start = time.perf_counter()  # llguidance builds lazily: the first mask pays the rest
            llg.matcher().fill_bitmask(rows_mask, 0)
            llg_mask_s = time.perf_counter() - start
            row = {
                "properties": 4 * (i + 1),
                "xgrammar_compile_s": round(xgr_s, 4),
                "disk_load_s": round(load_s, 4),
                "load_over_compile": round(load_s / xgr_s, 4),
                "llguidance_compile_s": round(llg_s, 4),
                "llguidance_first_mask_s": round(llg_mask_s, 4),
                "file_bytes": fresh.path(key).stat().st_size,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        restarts = [restart(directory, args.schemas, preload) for preload in (True, False)]
        for line in restarts:
            print(json.dumps(line), flush=True)
    summary = {
        "summary": "grammar_disk_cache",
        "xgrammar_compile_s_p50": statistics.median(r["xgrammar_compile_s"] for r in rows),
        "disk_load_s_p50": statistics.median(r["disk_load_s"] for r in rows),
        "load_over_compile_p50": statistics.median(r["load_over_compile"] for r in rows),
        "llguidance_compile_s_p50": statistics.median(r["llguidance_compile_s"] for r in rows),
    }
    for line in restarts:
        first = statistics.median(line["first_load_s"])
        summary[f"restart_{line['restart']}_first_load_s_p50"] = first
        summary[f"restart_{line['restart']}_over_compile_p50"] = round(
            first / summary["xgrammar_compile_s_p50"], 4
        )
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
