"""Served against offline throughput: ``espalier serve`` driven by N concurrent streaming gRPC
clients, and the same requests stepped through an engine in this process, built the same way
(``server.loading.load_engine``), printing JSON lines.

Per mode (unconstrained, and every request under one JSON schema on ``--backend``): greedy
requests with ``ignore_eos``-free max_tokens, the same prompts on both sides; after one warm-up
round on each side (compiles, allocators), ``--reps`` rounds alternating ABBA. ``tok_per_s``:
tokens received over the wall time from the first request sent to the last one finished;
``served_over_offline``: the median of the round-by-round ratios; ``offline_steps`` /
``served_steps``: the engine steps each round took (equal tokens in more steps: emptier batches);
``served_cpu_share``: CPU seconds per wall second of the client processes (summed), the server
and its child processes (the engine's first) in each served round. ``tokens_equal``: both sides
produced the same tokens (the comparison is of equal work); ``texts_equal``: and the same text
(the server process makes it from the engine process's token ids, the offline engine in its own
process). The offline engine steps on a thread of its own, as the server's engine loop does:
stepped on the main thread, torch's CPU kernels ran 7-30x slower on the loaded 2-core
development machine (16 ms against 0.6 s steps of the tiny model), which compared the server
with a handicapped anchor.

    .venv/bin/python bench/serve.py [--model tiny-random] [--streams 8] [--max-tokens 32] \\
        [--reps 2] [--speculative ngram,forced] [--kv-blocks N] [--tokenizer DIR]

``--kv-blocks`` gives both sides the same KV cache; on CUDA set it (the default sizes the cache
from free device memory, and the side loaded first would take most of it).

``--requests-per-stream K``: each stream sends K requests one after another (a closed loop, as a
client that keeps its connection busy); the offline engine likewise keeps ``--streams`` requests
in flight, adding a stream's next request when its last one finishes. With K = 1 a round is one
burst, and its start (the first step holds only the requests that arrived) and its end (the last
stragglers) weigh as much as the decoding in between: a constrained round of the one-schema
requests ends after ~16 tokens, a quarter of an unconstrained one, so those fixed costs weigh four
times more there. ``K`` > 1 measures throughput with the streams kept busy.

The offline side runs under the process conditions ``espalier serve`` gives its engine
(``server/cpu_runtime.py``: passive OpenMP waiting, set before torch loads): on a CPU, torch's
default spinning would make the anchor several times slower than the server's engine.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from espalier.server.cpu_runtime import apply_runtime_env

apply_runtime_env(os.environ)  # before torch loads, as ``espalier serve`` does for its engine

from espalier_client import AsyncClient  # noqa: E402
from load import SCHEMA, scrape, start_server  # noqa: E402  # bench/load.py (on sys.path)

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def prompts(count: int) -> list[str]:
    return [f"Item {i}: describe item number {i} as JSON." for i in range(count)]


def stream_requests(args: argparse.Namespace) -> list[list[int]]:
    """Per stream, the indices of its requests in the order it sends them (request ``i + j *
    streams`` is stream ``i``'s ``j``-th)."""
    n, k = args.streams, args.requests_per_stream
    return [[i + j * n for j in range(k)] for i in range(n)]


def offline_engine(args: argparse.Namespace) -> Any:
    from espalier.engine.constraints import GrammarService
    from espalier.server.loading import ModelOptions, load_engine, load_tokenizer

    options = ModelOptions(
        model=args.model,
        speculative=tuple(m for m in args.speculative.split(",") if m),
        compile_timeout_s=600.0,
        kv_blocks=args.kv_blocks,
        tokenizer=args.tokenizer,
    )
    tokenizer = load_tokenizer(options)
    engine, _ = load_engine(options, tokenizer, GrammarService(tokenizer, compile_timeout_s=600))
    return engine


def run_offline(engine: Any, args: argparse.Namespace, constrained: bool) -> dict[str, Any]:
    from espalier.constrained.spec import GrammarSpec
    from espalier.engine.api import ConstraintOptions, GenerationRequest, SamplingParams

    streams = stream_requests(args)
    texts_in = prompts(args.streams * args.requests_per_stream)
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    next_of: dict[int, int] = {}  # request index -> the next one of its stream
    for order in streams:
        next_of.update(itertools.pairwise(order))
    start = time.perf_counter()

    def add(i: int) -> None:
        engine.add_request(
            GenerationRequest(
                f"offline-{i}-{start}",
                prompt=texts_in[i],
                sampling=SamplingParams(max_tokens=args.max_tokens),
                grammar=GrammarSpec.json_schema(SCHEMA) if constrained else None,
                constraint=ConstraintOptions(backend=args.backend if constrained else None),
            )
        )
        tokens[i], texts[i] = [], ""

    steps = engine.stats()["steps"]
    for order in streams:
        add(order[0])
    while engine.has_unfinished():
        for out in engine.step():
            i = int(out.request_id.split("-")[1])
            tokens[i].extend(out.token_ids)
            texts[i] += out.text_delta
            if out.finished and i in next_of:
                add(next_of[i])
    seconds = time.perf_counter() - start
    return _rate(tokens, texts, seconds) | {"steps": engine.stats()["steps"] - steps}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def served_round(
    clients: ProcessPoolExecutor,
    address: str,
    metrics_port: int,
    server_pid: int,
    args: argparse.Namespace,
    constrained: bool,
) -> dict[str, Any]:
    """One served round: the streams split over the ``--client-processes`` client processes
    (stream ``i`` on process ``i % P``), which start together; the wall time runs from the
    first request sent to the last one finished. With it, the engine steps the round took and
    the CPU each process spent in it as a share of the wall time: the clients (summed), the
    server, and the server's child processes, largest first (the engine's, then any compile
    helpers)."""
    extra: dict[str, Any] = {"schema": SCHEMA, "backend": args.backend} if constrained else {}
    texts_in = prompts(args.streams * args.requests_per_stream)
    orders = stream_requests(args)
    count = args.client_processes
    pids = [server_pid, *children(server_pid)]
    steps = scrape(metrics_port)["espalier_engine_steps_total"]
    cpu = [cpu_seconds(pid) for pid in pids]
    jobs = [
        Streams(address, orders[p::count], texts_in, args.max_tokens, extra) for p in range(count)
    ]
    parts = [clients.submit(drive_streams, job) for job in jobs]
    results = [part.result() for part in parts]
    seconds = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = {i: ids for r in results for i, ids in r["tokens"].items()}
    texts = {i: text for r in results for i, text in r["texts"].items()}
    shares = [round((cpu_seconds(p) - c) / seconds, 3) for p, c in zip(pids, cpu)]
    return _rate(tokens, texts, seconds) | {
        "steps": scrape(metrics_port)["espalier_engine_steps_total"] - steps,
        "cpu_share": {
            "clients": round(sum(r["cpu"] for r in results) / seconds, 3),
            "server": shares[0],
            "children": sorted(shares[1:], reverse=True),
        },
    }


_start_together: Any = None  # a client process's barrier (set by its pool's initializer)


def _client_process(barrier: Any) -> None:
    global _start_together
    _start_together = barrier


@dataclass(frozen=True)
class Streams:
    """A client process's share of a round: its streams' request indices (each stream sends
    its requests one after another), every request's prompt, and the request settings."""

    address: str
    orders: list[list[int]]
    texts_in: list[str]
    max_tokens: int
    extra: dict[str, Any]


def drive_streams(job: Streams) -> dict[str, Any]:
    """In a client process: ``job``'s streams, started when every client process is ready;
    token ids and text per request, the start and end (``perf_counter``, one clock for every
    process) and this process's CPU seconds."""
    cpu = time.process_time()
    out = asyncio.run(_drive(job))
    return out | {"cpu": time.process_time() - cpu}


async def _drive(job: Streams) -> dict[str, Any]:
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}

    async def one(client: AsyncClient, order: list[int]) -> None:
        for i in order:
            got: list[int] = []
            text = ""
            async for chunk in client.stream(
                job.texts_in[i], max_tokens=job.max_tokens, **job.extra
            ):
                got.extend(chunk.token_ids)
                text += chunk.text
            tokens[i], texts[i] = got, text

    async with AsyncClient(job.address) as client:
        _start_together.wait()
        start = time.perf_counter()
        await asyncio.gather(*(one(client, order) for order in job.orders))
        end = time.perf_counter()
    return {"tokens": tokens, "texts": texts, "start": start, "end": end}


def _rate(tokens: dict[int, list[int]], texts: dict[int, str], seconds: float) -> dict[str, Any]:
    total = sum(len(t) for t in tokens.values())
    return {
        "tokens": total,
        "seconds": seconds,
        "tok_per_s": total / seconds,
        "ids": tokens,
        "texts": texts,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--requests-per-stream",
        type=int,
        default=1,
        help="requests each stream sends one after another (offline: kept in flight alike)",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="processes the streams are split over (one Python process of asyncio streams "
        "can be the bottleneck at tens of thousands of chunks a second)",
    )
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--backend", default="llguidance")
    parser.add_argument("--speculative", default="", help="drafters, as espalier serve's")
    parser.add_argument("--kv-blocks", type=int, default=0, help="as espalier serve's")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder, as espalier serve's (a machine without the embedded model's "
        "package: --model tiny-random --tokenizer DIR)",
    )
    args = parser.parse_args()
    # The last --model given wins (load.py's is first).
    server_flags = ["--model", args.model, "--kv-blocks", str(args.kv_blocks)]
    if args.speculative:
        server_flags += ["--speculative", args.speculative]
    if args.tokenizer:
        server_flags += ["--tokenizer", args.tokenizer]
    stepper = ThreadPoolExecutor(1, thread_name_prefix="offline-engine")
    spawn = multiprocessing.get_context("spawn")
    clients = ProcessPoolExecutor(
        args.client_processes,
        mp_context=spawn,
        initializer=_client_process,
        initargs=(spawn.Barrier(args.client_processes),),
    )
    engine = offline_engine(args)
    proc, address, metrics_port = start_server(server_flags)
    try:
        for constrained in (False, True):
            served = functools.partial(
                served_round, clients, address, metrics_port, proc.pid, args, constrained
            )
            compare(engine, stepper, served, args, constrained)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        engine.close()
        stepper.shutdown()
        clients.shutdown()
    return 0


def compare(
    engine: Any,
    stepper: ThreadPoolExecutor,
    served_round: Callable[[], dict[str, Any]],
    args: argparse.Namespace,
    constrained: bool,
) -> None:
    """One warm-up round per side, then ``--reps`` rounds, the side order reversed every other
    round (ABBA); one JSON line."""
    sides = ["offline", "served"]
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}

    def run(side: str) -> dict[str, Any]:
        if side == "offline":
            return stepper.submit(run_offline, engine, args, constrained).result()
        return served_round()

    for side in sides:
        run(side)  # warm-up
    for rep in range(args.reps):
        for side in sides if rep % 4 in (0, 3) else sides[::-1]:
            runs[side].append(run(side))
    offline, served = runs["offline"], runs["served"]
    ratios = [s["tok_per_s"] / o["tok_per_s"] for s, o in zip(served, offline)]
    emit(
        {
            "part": "serve",
            "model": args.model,
            "constrained": constrained,
            "backend": args.backend if constrained else None,
            "streams": args.streams,
            "requests_per_stream": args.requests_per_stream,
            "max_tokens": args.max_tokens,
            "speculative": args.speculative or None,
            "kv_blocks": args.kv_blocks,
            "offline_tok_per_s": [round(o["tok_per_s"], 1) for o in offline],
            "served_tok_per_s": [round(s["tok_per_s"], 1) for s in served],
            "ratios": [round(r, 3) for r in ratios],
            "offline_steps": [o["steps"] for o in offline],
            "served_steps": [s["steps"] for s in served],
            "client_processes": args.client_processes,
            "served_cpu_share": [s["cpu_share"] for s in served],
            "served_over_offline": round(statistics.median(ratios), 3),
            "tokens_equal": all(s["ids"] == o["ids"] for s, o in zip(served, offline)),
            "texts_equal": all(s["texts"] == o["texts"] for s, o in zip(served, offline)),
        }
    )


if __name__ == "__main__":
    raise SystemExit(main())
