"""The engine thread's closing work per speculative step with closing workers, as on the GPU
(the answers come while the forward runs), over whole requests, printing JSON lines.

``--requests`` requests stand at the first token of a valid JSONSchemaBench instance (the real
Gemma tokenizer, llguidance) with ``max_tokens`` = ``--max-tokens``; each step drafts the
instance's next ``--depth`` tokens as a chain, and all of them are accepted plus the next one
(the bonus token), as with an oracle drafter. Per step, as the engine does: the trees go to the
workers (``BudgetCloser.lookahead``, ``flush``), a sleep of ``--forward-ms`` stands for the
verify forward (H200, batch 32, 8B shape: the GPU is done about 10 ms after the forward's call,
``bench/gpu_timeline.py`` run 91), the bonus tokens are asked for (``prefetch``), then each
request's tokens are appended (``pass_through`` and its matcher's ``accept_tokens`` for all
but the last, ``instead`` for the last, as ``Engine._accept_run`` and ``Engine._append``).

The anchor in the same run (ABBA over ``--reps``): ``closing.BONUS_AHEAD`` off, where a tree
goes to a worker only when one of its nodes' checks is due, so the bonus token's check, when it
is the only one due, runs inline on the engine thread. Per mode: ``append_ms`` per step
(median, p90, max over all steps of all reps; and step by step, the median over reps),
``instead_ms_per_step`` (the engine thread's time in ``BudgetCloser.instead``: waiting for
answers or deciding inline), ``inline_decides``
(``BudgetCloser.decide`` calls on the engine thread, the quick ones without grammar work
included) and ``searches_inline``; the decisions (closing paths and memos) are checked equal
across modes.

    .venv/bin/python bench/closing_steady.py [--requests 32] [--workers 2] [--reps 4]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import spec as spec_bench  # bench/spec.py (this folder is on sys.path)

_RUNS = itertools.count()


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


class _Probe:
    """Engine-thread time in ``instead``, and the engine thread's decides and searches."""

    def __init__(self) -> None:
        self.instead_s = 0.0
        self.counts: Counter[str] = Counter()
        self.main = threading.main_thread()

    def install(self) -> None:
        from espalier.engine import closing

        probe = self
        instead, decide, search = (
            closing.BudgetCloser.instead,
            closing.BudgetCloser.decide,
            closing.ClosingPaths.search,
        )

        def timed_instead(self: Any, *args: Any) -> Any:
            start = time.perf_counter()
            try:
                return instead(self, *args)
            finally:
                probe.instead_s += time.perf_counter() - start

        def counted_decide(self: Any, *args: Any) -> Any:
            if threading.current_thread() is probe.main:
                probe.counts["inline_decides"] += 1
            return decide(self, *args)

        def counted_search(self: Any, *args: Any) -> Any:
            if threading.current_thread() is probe.main:
                probe.counts["searches_inline"] += 1
            return search(self, *args)

        closing.BudgetCloser.instead = timed_instead  # type: ignore[method-assign]
        closing.BudgetCloser.decide = counted_decide  # type: ignore[method-assign]
        closing.ClosingPaths.search = counted_search  # type: ignore[method-assign]


def _run(
    args: argparse.Namespace, tokenizer: Any, pool: list[tuple[Any, list[int]]], workers: Any
) -> tuple[list[float], list[Any]]:
    """One pass over whole requests; returns (append seconds per step, the decisions)."""
    from espalier.engine.api import SamplingParams
    from espalier.engine.closing import BudgetCloser
    from espalier.engine.request import Request

    closer = BudgetCloser(tokenizer)
    closer.workers = workers
    run_id = next(_RUNS)  # fresh request ids: each run opens its own mirrors
    live: list[tuple[Request, list[int], list[Any]]] = []  # and the request's decisions
    decisions: list[list[Any]] = []
    for i in range(args.requests):
        compiled, tokens = pool[i % len(pool)]
        rid = f"s{run_id}_{i}"
        request = Request(rid, [1], SamplingParams(max_tokens=args.max_tokens), 0)
        request.compiled, request.matcher = compiled, compiled.matcher()
        assert request.matcher.accept(tokens[0])
        request.output_ids.append(tokens[0])
        decisions.append([])
        live.append((request, tokens, decisions[-1]))
    appends: list[float] = []
    depth = args.depth
    while live:
        for request, tokens, _ in live:
            pos = len(request.output_ids)
            chain = tokens[pos - 1 : pos + depth]
            closer.lookahead(request, chain, list(range(-1, len(chain) - 1)), 1 << 20)
        closer.flush()
        time.sleep(args.forward_ms / 1e3)
        steps = {}
        for request, tokens, _ in live:
            pos = len(request.output_ids)
            steps[request.request_id] = tokens[pos : pos + depth + 1]
            closer.prefetch(request, steps[request.request_id])
        closer.flush()
        start = time.perf_counter()
        going = []
        for request, tokens, decided in live:
            step = steps[request.request_id]
            run = closer.pass_through(request, step[:-1], 1 << 20)
            if run:
                assert request.matcher is not None
                assert request.matcher.accept_tokens(step[:run]) == run
                request.output_ids.extend(step[:run])
            taken = spec_bench.append_deciding(closer, request, step[run:])
            decided.extend(taken)
            path = taken[-1] if taken else None
            done = len(request.output_ids) + depth + 2 > min(args.max_tokens, len(tokens))
            if path is None and not done:
                going.append((request, tokens, decided))
            else:
                decided.append(closer._memo.get(request.request_id))
                closer.forget(request.request_id)
        appends.append(time.perf_counter() - start)
        live = going
    return appends, decisions


def _streams(args: argparse.Namespace, tokenizer: Any) -> list[tuple[Any, list[int]]]:
    """``(compiled grammar, tokens)`` of the ``--batch`` lines of a ``bench/gpu.py
    --dump-streams`` file (a GPU run's constrained outputs, closings included); sets
    ``args.max_tokens`` to theirs."""
    pool = []
    with open(args.streams) as lines:
        for line in lines:
            record = json.loads(line)
            if record["batch"] != args.batch:
                continue
            compiled = spec_bench.compile_schema(record["schema"], tokenizer)
            if compiled is not None and len(record["tokens"]) > args.depth + 2:
                pool.append((compiled, record["tokens"]))
                args.max_tokens = record["max_tokens"]
    return pool


def run(args: argparse.Namespace) -> None:
    from espalier.engine import closing
    from espalier.engine.closing_remote import ClosingWorkers
    from espalier.server.default_model import default_tokenizer

    tokenizer = default_tokenizer()
    if args.streams:
        pool = _streams(args, tokenizer)
    else:
        pool = spec_bench.instance_pool(tokenizer, args.schemas, args.depth + 3)
    if not pool:
        raise SystemExit("no instance long enough")
    probe = _Probe()
    probe.install()
    workers = ClosingWorkers(tokenizer, args.workers)
    try:
        assert workers.wait_ready(120.0)
        modes = {"bonus_ahead": True, "anchor_nodes_only": False}
        stats: dict[str, dict[str, Any]] = {
            m: {"appends": [], "runs": [], "instead_s": 0.0, "counts": Counter(), "steps": 0}
            for m in modes
        }
        reference = None
        closing.BONUS_AHEAD = True
        _run(args, tokenizer, pool, workers)  # warm-up (mirrors' grammars, caches)
        for rep in range(args.reps):
            order = list(modes) if rep % 2 == 0 else list(modes)[::-1]
            for mode in order:
                closing.BONUS_AHEAD = modes[mode]
                probe.instead_s, probe.counts = 0.0, Counter()
                appends, decisions = _run(args, tokenizer, pool, workers)
                reference = decisions if reference is None else reference
                assert decisions == reference, f"{mode}: decisions differ"
                entry = stats[mode]
                entry["appends"].extend(appends)
                entry["runs"].append(appends)
                entry["instead_s"] += probe.instead_s
                entry["counts"].update(probe.counts)
                entry["steps"] += len(appends)
        closing.BONUS_AHEAD = True
        out: dict[str, Any] = {}
        for mode, entry in stats.items():
            ms = sorted(a * 1e3 for a in entry["appends"])
            out[mode] = {
                "append_ms_median_p90_max": [
                    round(statistics.median(ms), 3),
                    round(ms[int(0.9 * (len(ms) - 1))], 3),
                    round(ms[-1], 3),
                ],
                "instead_ms_per_step": round(entry["instead_s"] * 1e3 / entry["steps"], 3),
                "inline_decides_per_step": round(
                    entry["counts"]["inline_decides"] / entry["steps"], 2
                ),
                "searches_inline": entry["counts"]["searches_inline"],
                "steps": entry["steps"],
                "append_ms_by_step_median": [
                    round(statistics.median(run[i] for run in entry["runs"]) * 1e3, 2)
                    for i in range(min(len(run) for run in entry["runs"]))
                ],
            }
        emit(
            {
                "part": "closing_steady",
                "requests": args.requests,
                "workers": args.workers,
                "max_tokens": args.max_tokens,
                "streams": args.streams or "jsonschemabench instances",
                "depth": args.depth,
                "forward_ms": args.forward_ms,
                "reps": args.reps,
                **out,
                "instead_ratio": round(
                    out["bonus_ahead"]["instead_ms_per_step"]
                    / out["anchor_nodes_only"]["instead_ms_per_step"],
                    3,
                ),
                "decisions_equal": True,
            }
        )
    finally:
        workers.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--schemas", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--depth", type=int, default=7, help="tree tokens below the root")
    parser.add_argument("--forward-ms", type=float, default=12.0)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument(
        "--streams",
        default=None,
        help="replay a GPU run's constrained outputs (bench/gpu.py --dump-streams) instead of "
        "JSONSchemaBench instances",
    )
    parser.add_argument("--batch", type=int, default=32, help="which batch of --streams")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
