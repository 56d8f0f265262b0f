"""SMG + the official openai client vs direct gRPC: the same constrained chat requests, one run.

    .venv/bin/python bench/gateway.py [--model tiny-random] [--requests 32] [--concurrency 16]

Starts ``espalier serve --smg-port 0`` and ``smg launch`` in front of it (both on loopback).
The direct path sends the prompt the chat template renders (transformers, the same template
SMG renders) as token ids through ``espalier_client``; the gateway path sends the messages.
Both stream, greedy, with the same JSON schema. Phases alternate (direct, gateway, direct,
gateway) so drift on a shared machine hits both. Prints one JSON line per phase and a summary
with the gateway/direct ratios of wall time and p50 latency (target: <= 1.05).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repository root: shared test helpers as tests.fixtures.*

from tests.fixtures.gateway_process import SmgGateway  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Person number {i}, as JSON."}]


def start_worker(model: str) -> tuple[subprocess.Popen[str], int, int]:
    cmd = [sys.executable, "-m", "espalier.server.main", "serve", "--model", model]
    cmd += ["--port", "0", "--smg-port", "0", "--compile-timeout", "600"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=str(REPO))
    assert proc.stdout is not None
    port = smg_port = 0
    for line in proc.stdout:
        event = json.loads(line)
        if event["event"] == "listening":
            port, smg_port = event["port"], event["smg_port"]
        if event["event"] == "serving":
            return proc, port, smg_port
        if event["event"] == "load_failed":
            raise RuntimeError(event["error"])
    raise RuntimeError("the server exited before serving")


async def timed(start: float, stream: Any, text_of: Any) -> dict[str, Any]:
    first, pieces = None, []
    async for chunk in stream:
        text = text_of(chunk)
        if text:
            first = first or time.perf_counter()
            pieces.append(text)
    end = time.perf_counter()
    return {"text": "".join(pieces), "ttft": (first or end) - start, "latency": end - start}


async def direct_one(client: Any, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    stream = client.stream(prompt_ids, max_tokens=max_tokens, temperature=0.0, schema=SCHEMA)
    return await timed(start, stream, lambda c: c.text)


async def gateway_one(client: Any, model: str, i: int, max_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model,
        messages=messages(i),
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    )
    return await timed(start, stream, lambda c: c.choices[0].delta.content if c.choices else "")


async def phase(name: str, run_one: Any, args: argparse.Namespace) -> dict[str, Any]:
    gate = asyncio.Semaphore(args.concurrency)

    async def bounded(i: int) -> dict[str, Any]:
        async with gate:
            return dict(await run_one(i), index=i)

    start = time.perf_counter()
    results = await asyncio.gather(*(bounded(i) for i in range(args.requests)))
    wall = time.perf_counter() - start
    latencies = sorted(r["latency"] for r in results)
    valid = sum(_valid(r["text"]) for r in results)
    row = {
        "phase": name,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "wall_s": round(wall, 3),
        "p50_latency_s": round(statistics.median(latencies), 3),
        "p90_latency_s": round(latencies[int(0.9 * (len(latencies) - 1))], 3),
        "p50_ttft_s": round(statistics.median(r["ttft"] for r in results), 3),
        "valid": valid,
        "chars": sum(len(r["text"]) for r in results),
    }
    print(json.dumps(row), flush=True)
    row["texts"] = [r["text"] for r in sorted(results, key=lambda r: r["index"])]
    return row


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def main_async(args: argparse.Namespace, port: int, base_url: str) -> None:
    import openai
    from espalier_client import AsyncClient

    from espalier.server.loading import ModelOptions, load_tokenizer

    hf = load_tokenizer(ModelOptions(model=args.model)).hf  # the worker's own tokenizer
    rendered = [
        hf.apply_chat_template(messages(i), add_generation_prompt=True, tokenize=False)
        for i in range(args.requests)
    ]
    # The template writes <bos> itself: encode without adding special tokens again.
    prompts = [list(hf.encode(text, add_special_tokens=False)) for text in rendered]
    direct = AsyncClient(f"127.0.0.1:{port}", timeout_s=1800.0)
    gateway = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=1800)
    model = args.model

    async def run_direct(i: int) -> dict[str, Any]:
        return await direct_one(direct, prompts[i], args.max_tokens)

    async def run_gateway(i: int) -> dict[str, Any]:
        return await gateway_one(gateway, model, i, args.max_tokens)

    await run_direct(0)  # compile the schema once, warm both paths
    await run_gateway(0)
    rows = []
    for _ in range(args.rounds):
        rows.append(await phase("direct_grpc", run_direct, args))
        rows.append(await phase("smg_openai", run_gateway, args))
    direct_rows = [r for r in rows if r["phase"] == "direct_grpc"]
    gateway_rows = [r for r in rows if r["phase"] == "smg_openai"]
    same = sum(
        a == b for d, g in zip(direct_rows, gateway_rows) for a, b in zip(d["texts"], g["texts"])
    )

    def ratio(key: str) -> float:
        total_g = sum(r[key] for r in gateway_rows)
        total_d = sum(r[key] for r in direct_rows)
        return round(total_g / total_d, 3)

    summary = {
        "summary": "smg_openai / direct_grpc",
        "model": args.model,
        "wall_ratio": ratio("wall_s"),
        "p50_latency_ratio": ratio("p50_latency_s"),
        "p50_ttft_ratio": ratio("p50_ttft_s"),
        "identical_outputs": f"{same}/{args.requests * args.rounds}",
        "target_ratio": 1.05,
    }
    print(json.dumps(summary), flush=True)
    await direct.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    worker, port, smg_port = start_worker(args.model)
    try:
        with SmgGateway(smg_port) as gateway:
            asyncio.run(main_async(args, port, gateway.base_url))
    finally:
        worker.terminate()
        worker.wait(timeout=300)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
