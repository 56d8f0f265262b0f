"""Post-validation of finished JSON outputs, per batch of outputs, printing one JSON line.

The engine post-validates every finished constrained output on its thread
(``constrained/postvalidate.py``). Measured: ``postvalidate(spec, text)`` over a batch of
outputs, whose validators are cached by the spec's text, against the anchor in the same run
(``validate_instance(spec.schema, parsed)``: the spec's schema parsed, and serialized again
with sorted keys for the cache key, per output). Rounds alternate ABBA; both paths warm their
caches first, and their verdicts are checked equal.

Outputs: the valid JSONSchemaBench instances of ``--schemas`` schemas (default), or a GPU
run's constrained outputs (``--streams``: ``bench/gpu.py --dump-streams``; H200 run 96's are in
``bench/inputs/h200_b32_streams.jsonl``).

    .venv/bin/python bench/postvalidate.py [--streams FILE] [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import spec as spec_bench  # bench/spec.py (this folder is on sys.path)


def _outputs(args: argparse.Namespace) -> list[tuple[Any, str]]:
    """``(GrammarSpec, output text)`` pairs."""
    from espalier.constrained.spec import GrammarSpec
    from espalier.server.default_model import default_tokenizer

    if not args.streams:
        return [
            (GrammarSpec.json_schema(schema), json.dumps(instance))
            for _, schema, instances in spec_bench.sample_schemas(args.schemas, True)
            for instance in instances
        ]
    tokenizer = default_tokenizer()
    stops = set(tokenizer.stop_token_ids)
    pairs = []
    with open(args.streams) as lines:
        for line in lines:
            record = json.loads(line)
            text = tokenizer.decode([t for t in record["tokens"] if t not in stops])
            pairs.append((GrammarSpec.json_schema(record["schema"]), text))
    return pairs


def run(args: argparse.Namespace) -> dict[str, Any]:
    from espalier.constrained import postvalidate as pv

    pairs = _outputs(args)

    def by_text() -> list[Any]:
        return [pv.postvalidate(spec, text) for spec, text in pairs]

    def anchor() -> list[Any]:  # the spec's schema parsed and re-serialized per output
        out = []
        for spec, text in pairs:
            try:
                instance = pv.parse_strict_json(text)
            except ValueError as exc:
                out.append(pv.PostValidation(True, False, (f"/: not valid JSON: {exc}",)))
                continue
            out.append(pv.validate_instance(spec.schema, instance))
        return out

    paths: dict[str, Callable[[], list[Any]]] = {"by_spec_text": by_text, "anchor": anchor}
    verdicts = {name: path() for name, path in paths.items()}  # warm both caches
    assert verdicts["by_spec_text"] == verdicts["anchor"], "verdicts differ"
    times: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(args.rounds):
        order = list(paths) if i % 4 in (0, 3) else list(paths)[::-1]
        for name in order:
            start = time.perf_counter()
            paths[name]()
            times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {
        "part": "postvalidate",
        "outputs": len(pairs),
        "source": args.streams or f"jsonschemabench, {args.schemas} schemas",
        "valid": sum(r.valid for r in verdicts["by_spec_text"]),
        "rounds": args.rounds,
        "ms_per_batch_median": {k: round(v, 3) for k, v in ms.items()},
        "us_per_output": {k: round(v * 1e3 / max(len(pairs), 1), 1) for k, v in ms.items()},
        "by_spec_text_over_anchor": round(ms["by_spec_text"] / ms["anchor"], 3),
        "verdicts_equal": True,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemas", type=int, default=40)
    parser.add_argument("--streams", default=None, help="a bench/gpu.py --dump-streams file")
    parser.add_argument("--rounds", type=int, default=20)
    print(json.dumps(run(parser.parse_args(argv))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
