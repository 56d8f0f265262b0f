"""Replicas behind SMG: grammar cache hit rate and throughput, with and without grammar-aware
placement, against one replica, in one run.

    .venv/bin/python bench/replicas.py [--replicas 2] [--requests 48] [--schemas 8]
        [--concurrency 8] [--max-tokens 48] [--model tiny-random]

Starts ``scripts/gateway.sh --replicas N`` and, as the anchor, ``scripts/gateway.sh --replicas 1``
(the same SMG flags in front of one replica). Each phase sends ``--requests`` constrained chat
requests (greedy, ``--concurrency`` at a time, each its own prompt) over ``--schemas`` JSON
schemas new to every replica (request i uses schema i mod K), through the official openai client:

- ``one_replica``: the anchor gateway; every schema compiles once.
- ``smg_default``: the N-replica gateway, no routing key: SMG's cache_aware policy places each
  request by its prompt, which says nothing of its constraint.
- ``grammar_key``: the N-replica gateway, ``X-SMG-Routing-Key`` = a hash of the response_format:
  SMG pins each key to one replica (sticky sessions over cache_aware).

Phases run anchor, default, keyed, keyed, default, anchor so drift on a shared machine hits all.
The hit rate is read from each replica's Prometheus counters (``espalier_grammar_cache_lookups``:
hits and joins of an in-flight compile over all lookups); the ideal is 1 - K/M. Prints one JSON
line per phase and a summary with the hit rates and the throughput ratios to the anchor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import repo_root  # noqa: F401  (the repository root on sys.path, for tests.fixtures)

from tests.fixtures.gateway_script import (
    ROUTING_KEY_HEADER,
    GatewayScript,
    ReplicaCounters,
    grammar_key,
    scrape,
)


def schema(tag: str) -> dict[str, Any]:
    """A record schema whose property names carry ``tag``: a grammar no replica has compiled."""
    return {
        "type": "object",
        "properties": {
            f"id_{tag}": {"type": "integer", "minimum": 0, "maximum": 99999},
            f"code_{tag}": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            f"level_{tag}": {"enum": ["low", "mid", "high", tag]},
            f"tags_{tag}": {"type": "array", "items": {"type": "string", "maxLength": 6}},
            f"ok_{tag}": {"type": "boolean"},
            f"mail_{tag}": {
                "type": "string",
                "pattern": "^[a-z]{3,12}@[a-z]{2,8}\\.(com|org|net)$",
            },
            f"at_{tag}": {
                "type": "object",
                "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["lat", "lon"],
            },
        },
        "required": [f"id_{tag}", f"code_{tag}", f"level_{tag}"],
        "additionalProperties": False,
    }


def response_format(s: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "record", "schema": s}}


def open_client(gateway: GatewayScript) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=gateway.base_url, api_key="-", max_retries=0, timeout=1800)


def totals(gateway: GatewayScript) -> list[ReplicaCounters]:
    return [scrape(r) for r in gateway.replicas]


def hit_rate(before: list[ReplicaCounters], after: list[ReplicaCounters]) -> dict[str, Any]:
    def gained(read: Any) -> int:
        return int(sum(read(a) - read(b) for a, b in zip(after, before)))

    hits = gained(lambda c: c.cache_hits + c.cache_joined)
    misses = gained(lambda c: c.cache_misses)
    return {
        "hit_rate": round(hits / (hits + misses), 3) if hits + misses else None,
        "hits": hits,
        "compiles": misses,
        "compile_s": round(
            sum(a.compile_seconds - b.compile_seconds for a, b in zip(after, before)), 3
        ),
        "served_per_replica": [int(a.generations - b.generations) for a, b in zip(after, before)],
    }


async def run_phase(
    name: str, gateway: GatewayScript, tag: str, keyed: bool, args: argparse.Namespace
) -> dict[str, Any]:
    import jsonschema

    client = open_client(gateway)
    schemas = [schema(f"{tag}{k}") for k in range(args.schemas)]
    gate = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> tuple[float, int, bool]:
        s = schemas[i % len(schemas)]
        fmt = response_format(s)
        headers = {ROUTING_KEY_HEADER: grammar_key(fmt)} if keyed else {}
        async with gate:
            start = time.perf_counter()
            reply = await client.chat.completions.create(
                model=args.model,
                messages=[{"role": "user", "content": f"Record {i} of batch {tag}, as JSON."}],
                max_tokens=args.max_tokens,
                temperature=0,
                response_format=fmt,
                extra_headers=headers,
            )
            latency = time.perf_counter() - start
        text = reply.choices[0].message.content or ""
        try:
            jsonschema.validate(json.loads(text), s)
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False  # e.g. cut at max_tokens
        return latency, reply.usage.completion_tokens, valid

    before = totals(gateway)
    start = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(args.requests)))
    wall = time.perf_counter() - start
    await client.close()
    row = {
        "phase": name,
        "replicas": len(gateway.replicas),
        "requests": args.requests,
        "schemas": args.schemas,
        "concurrency": args.concurrency,
        "wall_s": round(wall, 3),
        "requests_per_s": round(args.requests / wall, 3),
        "tokens_per_s": round(sum(r[1] for r in results) / wall, 2),
        "p50_latency_s": round(statistics.median(r[0] for r in results), 3),
        "valid": sum(r[2] for r in results),
        **hit_rate(before, totals(gateway)),
    }
    print(json.dumps(row), flush=True)
    return row


async def warm(gateway: GatewayScript, args: argparse.Namespace) -> None:
    """One constrained request per replica (each builds its tokenizer's grammar tables once):
    distinct routing keys until every replica has compiled something."""
    client = open_client(gateway)
    for i in range(20 * len(gateway.replicas)):
        if all(c.cache_misses > 0 for c in totals(gateway)):
            break
        fmt = response_format(schema(f"warm{i}"))
        await client.chat.completions.create(
            model=args.model,
            messages=[{"role": "user", "content": f"Warm-up {i}."}],
            max_tokens=4,
            temperature=0,
            response_format=fmt,
            extra_headers={ROUTING_KEY_HEADER: f"warm-{i}"},
        )
    await client.close()


async def main_async(args: argparse.Namespace, fleet: GatewayScript, one: GatewayScript) -> None:
    await warm(fleet, args)
    await warm(one, args)
    plan = [
        ("one_replica", one, False),
        ("smg_default", fleet, False),
        ("grammar_key", fleet, True),
    ]
    rows = []
    for round_, phases in enumerate((plan, plan[::-1])):
        for name, gateway, keyed in phases:
            rows.append(await run_phase(name, gateway, f"r{round_}{name[:3]}", keyed, args))

    def total(name: str, key: str) -> float:
        return sum(r[key] for r in rows if r["phase"] == name)

    def pooled_hit_rate(name: str) -> float:
        hits, compiles = total(name, "hits"), total(name, "compiles")
        return round(hits / (hits + compiles), 3)

    anchor_wall = total("one_replica", "wall_s")
    summary = {
        "summary": f"{args.replicas} replicas behind SMG vs one replica",
        "model": args.model,
        "ideal_hit_rate": round(1 - args.schemas / args.requests, 3),
        "hit_rate": {name: pooled_hit_rate(name) for name, _, _ in plan},
        "throughput_vs_one_replica": {
            name: round(anchor_wall / total(name, "wall_s"), 3) for name, _, _ in plan
        },
        "valid": {name: int(total(name, "valid")) for name, _, _ in plan},
    }
    print(json.dumps(summary), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--schemas", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--model", default="tiny-random")
    args = parser.parse_args()
    serve = ["--model", args.model, "--compile-timeout", "900"]
    with (
        GatewayScript("--replicas", str(args.replicas), *serve) as fleet,
        GatewayScript("--replicas", "1", *serve) as one,
    ):
        asyncio.run(main_async(args, fleet, one))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
