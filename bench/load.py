"""Load test of the gRPC server on loopback: N concurrent streaming requests (tiny random model,
mixed constraints, fixed seeds), checked against the unary result of the same request, then the
same with a fraction of clients cancelling at random points; with ``--abusive-fraction`` a third
phase mixes abusive requests (every kind of ``tests/fixtures/abuse_cases.py``, at random moments)
into the streams and counts victims: normal streams that failed or changed (0 expected).

    .venv/bin/python bench/load.py [--requests 256] [--cancel-fraction 0.2] [--address HOST:PORT]
    .venv/bin/python bench/load.py --requests 64 --abusive-fraction 0.01

Without --address it starts ``espalier serve --model tiny-random`` itself and stops it after.
Prints JSON lines: one per phase (p50/p99 time to first token and total latency, lost /
duplicated / mismatched / failed counts) and a final verdict with the server's KV state.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from espalier_client import AsyncClient, EspalierError

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repository root: shared test helpers as tests.fixtures.*
from tests.fixtures.abuse_cases import SERVICE, AbuseCase, Bait, cases  # noqa: E402

# The limits tests/fixtures/abuse_cases.py assumes (the shared test server's).
ABUSE_SERVER_FLAGS = [
    "--max-grammar-bytes",
    "4096",
    "--max-prompt-bytes",
    "65536",
    "--max-message-mb",
    "1",
    "--speculative",
    "ngram,forced",
    "--speculate-by-default",
    "off",
]
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
    abusive: tuple[AbuseCase, ...] = (),
    address: str = "",
) -> dict[str, Any]:
    # A cancelling client stops after a random number of chunks short of its full length (known
    # from the unary reference), so that it really cancels mid-stream.
    cancel_at = {
        i: rng.randint(1, max(1, len(reference[i].token_ids) - 1) if i in reference else 1)
        for i in range(n)
        if rng.random() < cancel_fraction
    }
    start = time.perf_counter()
    streams = [
        one_stream(clients[i % len(clients)], i, max_tokens, cancel_at.get(i)) for i in range(n)
    ]
    async with grpc.aio.insecure_channel(address or "unused") as channel:
        delays = [rng.uniform(0.0, 1.0) for _ in abusive]
        answers, *outcomes = await asyncio.gather(
            asyncio.gather(*(one_abusive(channel, c, d) for c, d in zip(abusive, delays))),
            *streams,
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
        **(_abuse_summary(answers, failed, mismatched) if abusive else {}),
    }


async def one_abusive(channel: grpc.aio.Channel, case: AbuseCase, delay_s: float) -> dict[str, Any]:
    """Send one abusive case (raw bytes) after ``delay_s``; its status against the expected one."""
    await asyncio.sleep(delay_s)
    path = SERVICE + case.method
    code, message = grpc.StatusCode.OK, ""
    try:
        if case.method == "Generate":
            async for _ in channel.unary_stream(path)(case.payload, timeout=600):
                pass
        else:
            await channel.unary_unary(path)(case.payload, timeout=600)
    except grpc.aio.AioRpcError as exc:
        code, message = exc.code(), exc.details() or ""
    return {"case": case.name, "code": code.name, "ok": code == case.code, "message": message}


def _abuse_summary(
    answers: list[dict[str, Any]], failed: list[Outcome], mismatched: list[Outcome]
) -> dict[str, Any]:
    wrong = [a for a in answers if not a["ok"]]
    return {
        "abusive": len(answers),
        "abusive_kinds": len({a["case"] for a in answers}),
        "abusive_wrong_status": len(wrong),
        "first_wrong_status": [(a["case"], a["code"]) for a in wrong[:5]],
        "leaked_bait": sum("TOP-SECRET" in a["message"] for a in answers),
        "victims": len(failed) + len(mismatched),
    }


class BaitListener:
    """A bait file and a loopback port no request may make the server read or connect to."""

    def __init__(self) -> None:
        self.folder = tempfile.TemporaryDirectory(prefix="espalier-trap-")
        secret = Path(self.folder.name) / "secret.json"
        secret.write_text(json.dumps({"type": "string", "description": "TOP-SECRET"}))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.setblocking(False)
        port = self.sock.getsockname()[1]
        self.bait = Bait(secret.as_uri(), f"http://127.0.0.1:{port}/schema.json")

    def connections(self) -> int:
        """Connections made to the bait port so far (each accepted and closed)."""
        count = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return count
            conn.close()
            count += 1

    def close(self) -> None:
        self.sock.close()
        self.folder.cleanup()


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


def abusive_count(n: int, fraction: float) -> int:
    """How many abusive requests :func:`abusive_mix` makes: ``fraction`` of ``n``, at least one
    of each kind (0 when ``fraction`` is 0)."""
    kinds = len(cases(Bait("file:///x", "http://127.0.0.1:9/x")))
    return max(kinds, round(fraction * n)) if fraction > 0 else 0


def abusive_mix(n: int, fraction: float, bait: Bait, rng: random.Random) -> tuple[AbuseCase, ...]:
    """``fraction`` of ``n`` requests, at least one of each kind, in random order."""
    kinds = cases(bait)
    count = abusive_count(n, fraction)
    mix = [kinds[i % len(kinds)] for i in range(count)]
    rng.shuffle(mix)
    return tuple(mix)


async def main_async(args: argparse.Namespace, address: str, metrics_port: int) -> int:
    rng = random.Random(args.seed)
    bait = BaitListener()
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
        plan = [("stream", 0.0, 0.0), ("stream_with_cancels", args.cancel_fraction, 0.0)]
        if args.abusive_fraction > 0:
            plan.append(("stream_with_abuse", 0.0, args.abusive_fraction))
        for name, fraction, abusive_fraction in plan:
            abusive = abusive_mix(args.requests, abusive_fraction, bait.bait, rng)
            result = await run_phase(
                name,
                clients,
                reference,
                args.requests,
                args.max_tokens,
                fraction,
                rng,
                abusive,
                address,
            )
            if abusive:
                result["bait_connections"] = bait.connections()
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
                and p.get("victims", 0) == 0
                and p.get("abusive_wrong_status", 0) == 0
                and p.get("leaked_bait", 0) == 0
                and p.get("bait_connections", 0) == 0
                for p in phases
            )
            and len(reference) == args.requests
        )
        print(json.dumps({"verdict": "ok" if ok else "FAILED"}), flush=True)
        return 0 if ok else 1
    finally:
        bait.close()
        for c in clients:
            await c.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--channels", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--abusive-fraction",
        type=float,
        default=0.0,
        help="add a phase with this fraction of abusive requests (at least one of each kind)",
    )
    p.add_argument("--address", default=None, help="an already running server")
    p.add_argument("--metrics-port", type=int, default=None, help="with --address")
    args = p.parse_args()
    proc = None
    if args.address is None:
        flags = ["--max-num-seqs", "64"]
        if args.abusive_fraction > 0:
            flags += ABUSE_SERVER_FLAGS
            # room for the abusive mix next to the streams: a stream refused QUEUE_FULL because
            # abusive requests took its slots is the concurrency limit at work, not a victim
            extra = abusive_count(args.requests, args.abusive_fraction)
            flags += ["--max-concurrent", str(max(256, args.requests + extra))]
        proc, address, metrics_port = start_server(flags)
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
