"""Load test of the gRPC server on loopback: N concurrent streaming requests (tiny random model,
mixed constraints, fixed seeds), checked against the unary result of the same request, then the
same with a fraction of clients cancelling at random points.

    .venv/bin/python bench/load.py [--requests 256] [--cancel-fraction 0.2] [--address HOST:PORT]

Without --address it starts ``espalier serve --model tiny-random`` itself and stops it after.
Prints JSON lines: one per phase (p50/p99 time to first token and total latency, lost /
duplicated / mismatched / failed counts) and a final verdict with the server's KV state.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from espalier_client import AsyncClient, EspalierError

REPO = Path(__file__).resolve().parents[1]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
CONSTRAINTS: list[dict[str, Any]] = [
    {},
    {"schema": SCHEMA, "backend": "llguidance"},
    {"regex": "[a-z]{2,6}", "backend": "llguidance"},
    {"lark": 'start: "id-" /[0-9]{1,3}/', "backend": "llguidance"},
    {"ebnf": 'root ::= "v" [0-9] [0-9]?', "backend": "llguidance"},
    {"choice": ["alpha", "beta", "gamma"], "backend": "llguidance"},
]


@dataclass
class Outcome:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: int = 0  # number of chunks marked finished (exactly 1 when nothing is lost)
    ttft_s: float = 0.0
    total_s: float = 0.0
    error: str = ""
    cancelled: bool = False


def request_kwargs(i: int, max_tokens: int) -> dict[str, Any]:
    return dict(
        CONSTRAINTS[i % len(CONSTRAINTS)],
        request_id=f"load-{i}",
        max_tokens=max_tokens,
        temperature=0.8,
        seed=1000 + i,
    )


async def one_unary(client: AsyncClient, i: int, max_tokens: int) -> Outcome:
    start = time.perf_counter()
    kwargs = request_kwargs(i, max_tokens)
    kwargs["request_id"] = f"unary-{i}"
    try:
        result = await client.generate(f"Item {i}: ", **kwargs)
    except EspalierError as exc:
        return Outcome(i, error=str(exc))
    total = time.perf_counter() - start
    return Outcome(i, result.text, list(result.token_ids), 1, total, total)


async def one_stream(
    client: AsyncClient, i: int, max_tokens: int, cancel_after: int | None
) -> Outcome:
    out = Outcome(i)
    start = time.perf_counter()
    chunks = 0
    try:
        async for chunk in client.stream(f"Item {i}: ", **request_kwargs(i, max_tokens)):
            if chunks == 0:
                out.ttft_s = time.perf_counter() - start
            chunks += 1
            out.text += chunk.text
            out.token_ids.extend(chunk.token_ids)
            out.finished += int(chunk.finished)
            if cancel_after is not None and chunks >= cancel_after and not chunk.finished:
                out.cancelled = True
                break  # leaving the loop cancels the RPC
    except EspalierError as exc:
        out.error = str(exc)
    out.total_s = time.perf_counter() - start
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def scrape(metrics_port: int) -> dict[str, float]:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as reply:
        lines = reply.read().decode().splitlines()
    return {
        key: float(value)
        for key, _, value in (ln.rpartition(" ") for ln in lines if ln.startswith("espalier_"))
    }


async def wait_idle(metrics_port: int) -> dict[str, float]:
    for _ in range(1200):  # bounded: 2 minutes
        m = scrape(metrics_port)
        if m["espalier_active_requests"] == 0 and m["espalier_engine_kv_blocks_used"] == 0:
            return m
        await asyncio.sleep(0.1)
    return scrape(metrics_port)


async def run_phase(
    name: str,
    clients: list[AsyncClient],
    reference: dict[int, Outcome],
    n: int,
    max_tokens: int,
    cancel_fraction: float,
    rng: random.Random,
) -> dict[str, Any]:
    # A cancelling client stops after a random number of chunks short of its full length (known
    # from the unary reference), so that it really cancels mid-stream.
    cancel_at = {
        i: rng.randint(1, max(1, len(reference[i].token_ids) - 1) if i in reference else 1)
        for i in range(n)
        if rng.random() < cancel_fraction
    }
    start = time.perf_counter()
    outcomes = await asyncio.gather(
        *(one_stream(clients[i % len(clients)], i, max_tokens, cancel_at.get(i)) for i in range(n))
    )
    wall = time.perf_counter() - start
    failed = [o for o in outcomes if o.error]
    complete = [o for o in outcomes if not o.error and not o.cancelled]
    lost = [o for o in complete if o.finished != 1]
    mismatched = [
        o
        for o in complete
        if o.index in reference
        and (o.text, o.token_ids) != (reference[o.index].text, reference[o.index].token_ids)
    ]
    prefix_broken = [
        o
        for o in outcomes
        if o.cancelled
        and o.index in reference
        and reference[o.index].token_ids[: len(o.token_ids)] != o.token_ids
    ]
    return {
        "phase": name,
        "requests": n,
        "cancel_attempts": len(cancel_at),
        "cancelled": sum(o.cancelled for o in outcomes),
        "completed": len(complete),
        "failed": len(failed),
        "lost_or_duplicated": len(lost),
        "mismatched_vs_unary": len(mismatched),
        "cancelled_prefix_mismatch": len(prefix_broken),
        "ttft_p50_s": round(percentile([o.ttft_s for o in complete], 0.5), 4),
        "ttft_p99_s": round(percentile([o.ttft_s for o in complete], 0.99), 4),
        "latency_p50_s": round(percentile([o.total_s for o in complete], 0.5), 4),
        "latency_p99_s": round(percentile([o.total_s for o in complete], 0.99), 4),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(sum(len(o.token_ids) for o in outcomes) / wall, 1),
        "first_errors": sorted({o.error for o in failed})[:3],
        "first_mismatch": [o.index for o in mismatched[:5]],
    }


def start_server(extra: list[str]) -> tuple[subprocess.Popen[str], str, int]:
    cmd = [sys.executable, "-m", "espalier.server.main", "serve", "--model", "tiny-random"]
    cmd += ["--port", "0", "--metrics-port", "0", "--compile-timeout", "600", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=str(REPO))
    assert proc.stdout is not None
    port = metrics = 0
    for line in proc.stdout:
        event = json.loads(line)
        if event["event"] == "listening":
            port, metrics = event["port"], event["metrics_port"]
        if event["event"] == "serving":
            return proc, f"127.0.0.1:{port}", metrics
        if event["event"] == "load_failed":
            raise RuntimeError(event["error"])
    raise RuntimeError("the server exited before serving")


async def main_async(args: argparse.Namespace, address: str, metrics_port: int) -> int:
    rng = random.Random(args.seed)
    clients = [AsyncClient(address, timeout_s=1800.0) for _ in range(args.channels)]
    try:
        # Warm every grammar once so the phases measure serving, not first compiles.
        await asyncio.gather(*(one_unary(clients[0], i, 4) for i in range(len(CONSTRAINTS))))
        t0 = time.perf_counter()
        unary = await asyncio.gather(
            *(
                one_unary(clients[i % len(clients)], i, args.max_tokens)
                for i in range(args.requests)
            )
        )
        reference = {o.index: o for o in unary if not o.error}
        print(
            json.dumps(
                {
                    "phase": "unary_reference",
                    "requests": args.requests,
                    "failed": args.requests - len(reference),
                    "wall_s": round(time.perf_counter() - t0, 3),
                    "latency_p50_s": round(
                        percentile([o.total_s for o in reference.values()], 0.5), 4
                    ),
                    "latency_p99_s": round(
                        percentile([o.total_s for o in reference.values()], 0.99), 4
                    ),
                    "first_errors": sorted({o.error for o in unary if o.error})[:3],
                }
            ),
            flush=True,
        )
        phases = []
        for name, fraction in (("stream", 0.0), ("stream_with_cancels", args.cancel_fraction)):
            result = await run_phase(
                name, clients, reference, args.requests, args.max_tokens, fraction, rng
            )
            idle = await wait_idle(metrics_port)
            result["kv_blocks_used_after"] = idle["espalier_engine_kv_blocks_used"]
            result["active_after"] = idle["espalier_active_requests"]
            health = await clients[0].health()
            result["health_after"] = health
            print(json.dumps(result), flush=True)
            phases.append(result)
        ok = (
            all(
                p["failed"] == 0
                and p["lost_or_duplicated"] == 0
                and p["mismatched_vs_unary"] == 0
                and p["cancelled_prefix_mismatch"] == 0
                and p["kv_blocks_used_after"] == 0
                and p["health_after"] == "SERVING"
                for p in phases
            )
            and len(reference) == args.requests
        )
        print(json.dumps({"verdict": "ok" if ok else "FAILED"}), flush=True)
        return 0 if ok else 1
    finally:
        for c in clients:
            await c.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--channels", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--address", default=None, help="an already running server")
    p.add_argument("--metrics-port", type=int, default=None, help="with --address")
    args = p.parse_args()
    proc = None
    if args.address is None:
        proc, address, metrics_port = start_server(["--max-num-seqs", "64"])
    else:
        address, metrics_port = args.address, args.metrics_port
    try:
        return asyncio.run(main_async(args, address, metrics_port))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=300)


if __name__ == "__main__":
    raise SystemExit(main())
