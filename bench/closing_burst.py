"""A step where many requests enter the closing window at once, decided in a closing worker:
the answer in parts (``closing_remote.CHUNK_S``) against one message per step, printing JSON.

On the H200 at batch 32 (``bench/gpu_timeline.py`` run 91) the requests of the benchmark reach
the budget closer's window together, and each one's first check searches for a closing path:
those steps' appends took 8.5-15.6 ms against 2-3 ms in the others, the engine waiting for the
workers' answers. Here, on this CPU, with the real Gemma tokenizer and JSONSchemaBench grammars
(llguidance), ``--requests`` requests each stand at a valid instance's ``--prefix``-th token,
their budget ending :data:`~espalier.engine.closing.CLOSING_WINDOW` tokens later (so every tree
node gets a check, the first one a search), with the instance's next ``--depth`` tokens as the
draft tree (a chain). One step: the trees go to one worker (``ClosingWorkers.submit`` and
``flush``); then the engine thread, request by request, takes the decision of each tree token
(``Lookahead`` as ``BudgetCloser.instead`` does) and does ``--append-us`` of other work (the
rest of an append: H200 run 91, about 2.5 ms per step for 32 requests, ~80 us each).

Per mode, ABBA over ``--reps``: ``step_ms`` (from the flush to the last request taken; median),
and the anchor in the same run: ``one_message`` (``chunk_s`` = infinity: the whole step's
decisions in one message, as before parts), ``parts`` (the default ``CHUNK_S``), and ``inline``
(no worker: every decision made on the engine thread). The decisions are checked equal across
modes. One worker, so that the engine and the worker each have a core of this 2-core machine.

    .venv/bin/python bench/closing_burst.py [--requests 16] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import spec as spec_bench  # bench/spec.py (this folder is on sys.path)


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _requests(args: argparse.Namespace, tokenizer: Any) -> list[tuple[Any, list[int], int]]:
    """``(compiled, instance tokens, prefix)`` per request: the valid instances with more than
    prefix + depth tokens, round-robin."""
    pool = spec_bench.instance_pool(tokenizer, args.schemas, args.prefix + args.depth + 1)
    if not pool:
        raise SystemExit("no instance long enough: lower --prefix")
    return [(*pool[i % len(pool)], args.prefix) for i in range(args.requests)]


def _step(
    args: argparse.Namespace,
    tokenizer: Any,
    items: list[tuple[Any, list[int], int]],
    workers: Any,
    rep: int,
) -> tuple[float, list[Any]]:
    """One burst step; returns (seconds from the flush to the last take, the decisions)."""
    from espalier.engine.api import SamplingParams
    from espalier.engine.closing import CLOSING_WINDOW, BudgetCloser
    from espalier.engine.request import Request

    closer = BudgetCloser(tokenizer)
    closer.workers = workers
    requests = []
    for i, (compiled, tokens, prefix) in enumerate(items):
        request = Request(f"b{rep}_{i}", [1], SamplingParams(max_tokens=prefix + CLOSING_WINDOW), 0)
        request.compiled, request.matcher = compiled, compiled.matcher()
        assert request.matcher.accept_tokens(tokens[:prefix]) == prefix
        request.output_ids.extend(tokens[:prefix])
        if workers is not None:
            workers.open(request)
        requests.append(request)
    if workers is not None:  # the mirrors, built and synced before the timed step
        workers.flush()
        workers.receive_all()
    chains = []
    for request, (_, tokens, prefix) in zip(requests, items):
        chain = tokens[prefix - 1 : prefix + args.depth]
        parents = list(range(-1, len(chain) - 1))
        chains.append(chain)
        closer.lookahead(request, chain, parents, 1 << 20)
    start = time.perf_counter()
    closer.flush()
    decisions = []
    for request, chain in zip(requests, chains):
        taken = spec_bench.append_deciding(closer, request, chain[1:])
        decisions.append((taken, closer._memo.get(request.request_id)))
        _busy(args.append_us * 1e-6)
    elapsed = time.perf_counter() - start
    for request in requests:
        closer.forget(request.request_id)
    return elapsed, decisions


def run(args: argparse.Namespace) -> None:
    from espalier.engine.closing_remote import ClosingWorkers
    from espalier.server.default_model import default_tokenizer

    tokenizer = default_tokenizer()
    items = _requests(args, tokenizer)
    pools = {
        "one_message": ClosingWorkers(tokenizer, 1, chunk_s=float("inf")),
        "parts": ClosingWorkers(tokenizer, 1),
    }
    try:
        for pool in pools.values():
            assert pool.wait_ready(120.0)
        modes = ["inline", "one_message", "parts"]
        times: dict[str, list[float]] = {m: [] for m in modes}
        reference = None
        _step(args, tokenizer, items, None, -1)  # warm-up (caches, first searches' imports)
        for rep in range(args.reps):
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                elapsed, decisions = _step(args, tokenizer, items, pools.get(mode), rep)
                reference = decisions if reference is None else reference
                assert decisions == reference, f"{mode}: decisions differ"
                times[mode].append(elapsed)
        median = {m: statistics.median(t) * 1e3 for m, t in times.items()}
        emit(
            {
                "part": "closing_burst",
                "requests": args.requests,
                "prefix": args.prefix,
                "depth": args.depth,
                "append_us": args.append_us,
                "reps": args.reps,
                "step_ms_median": {m: round(v, 3) for m, v in median.items()},
                "step_ms_reps": {m: [round(t * 1e3, 3) for t in ts] for m, ts in times.items()},
                "parts_over_one_message": round(median["parts"] / median["one_message"], 3),
                "decisions_equal": True,
            }
        )
    finally:
        for pool in pools.values():
            pool.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--schemas", type=int, default=12)
    parser.add_argument("--prefix", type=int, default=24, help="output tokens before the step")
    parser.add_argument("--depth", type=int, default=8, help="tree tokens after the root")
    parser.add_argument("--append-us", type=float, default=80.0)
    parser.add_argument("--reps", type=int, default=5)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
