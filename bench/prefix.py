"""Prefix caching on vs off, in one run: requests sharing a long system prompt.

``--requests`` requests (default 64) arrive at once; each is the same ``--system-tokens``-token
system prompt (default 1,000) followed by its own user turn, constrained by one of a few JSON
schemas (compiled before timing), greedy, ``--max-tokens`` each. The same requests run on one
model runner through two engines that differ only in ``SchedulerConfig.prefix_caching``; the
anchor is the engine without the cache. Time to first token (from ``add_request``) and total
throughput (generated tokens over wall time) are reported per side, then their ratios, and
whether the greedy outputs are identical.

Prints JSON lines: one per side, then a ``"summary"`` with the ratios and the issue's targets
(TTFT p50 >= 5x lower, throughput >= 2x higher).

    .venv/bin/python bench/prefix.py [--requests 64] [--system-tokens 1000] [--max-tokens 16]
        [--model default|PATH|8b-random] [--device cpu|cuda] [--threads N] [--tokenizer DIR]

``--model 8b-random``: the Llama-3-8B shape with random bf16 weights on CUDA (``bench/gpu.py``'s
config, ``bench/spec.py``'s weights: zero output projections, so every GEMM, attention call and
K/V write runs at full size while the logits depend on the current token alone; identical outputs
there do not check the cached K/V, the engine's ``gpu`` tests do), over the default Gemma
tokenizer; flashinfer and the default CUDA graphs; a KV cache sized for the requests (block 16).
On the GPU machine (about a minute: weights, graph captures, then seconds per side)::

    python bench/prefix.py --model 8b-random --requests 64 --system-tokens 1000 --max-tokens 8 \
        --tokenizer .data/gemma_tok
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import torch

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no", "maybe"]},
            "confidence": {"type": "integer"},
        },
        "required": ["answer", "confidence"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "population": {"type": "integer"},
        },
        "required": ["city", "population"],
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}
        },
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 20}},
        "required": ["ok", "reason"],
    },
]

POLICY = (
    "You are the support assistant of a hardware store. Answer every question with one JSON "
    "object that follows the schema given with the question, and nothing else. Be brief, be "
    "accurate, never invent stock levels or prices, and say 'maybe' when unsure. Our opening "
    "hours are nine to six on weekdays and ten to four on Saturdays; we are closed on Sundays. "
)


def system_prompt(tokenizer: Any, n: int) -> list[int]:
    """Exactly ``n`` token ids: the policy text repeated (special tokens included), cut."""
    ids: list[int] = []
    text = POLICY
    while len(ids) < n:
        ids = tokenizer.hf.encode(text, add_special_tokens=True)
        text += POLICY
    return ids[:n]


def make_requests(tokenizer: Any, args: argparse.Namespace) -> list[Any]:
    from espalier.constrained.spec import GrammarSpec
    from espalier.engine.api import GenerationRequest, SamplingParams

    system = system_prompt(tokenizer, args.system_tokens)
    requests = []
    for i in range(args.requests):
        turn = f"\nCustomer {i}: do you have {i * 3 + 2} boxes of size-{i % 7} screws?\nAnswer: "
        ids = system + tokenizer.hf.encode(turn, add_special_tokens=False)
        requests.append(
            GenerationRequest(
                f"q{i}",
                prompt_token_ids=ids,
                sampling=SamplingParams(max_tokens=args.max_tokens),
                grammar=GrammarSpec.json_schema(SCHEMAS[i % len(SCHEMAS)]),
            )
        )
    return requests


def warm_up(engine: Any, request: Any) -> None:
    """One request as long as the others through the whole path (thread pools, first-call costs
    of each kernel shape, flashinfer plans), untimed. Its prompt is the first request's reversed,
    so it shares no block with the timed requests and leaves the cache side nothing to hit."""
    from espalier.engine.api import GenerationRequest, SamplingParams

    warm = GenerationRequest(
        "warmup",
        prompt_token_ids=list(reversed(request.prompt_token_ids)),
        sampling=SamplingParams(max_tokens=2),
        grammar=request.grammar,
    )
    engine.add_request(warm)
    while engine.has_unfinished():
        engine.step()


def run_side(engine: Any, requests: list[Any]) -> dict[str, Any]:
    """All requests at once; returns TTFTs, tokens and wall time."""
    for request in requests:  # compile before timing: this measures the KV path, not compiles
        compiled = engine.grammar.submit(request.grammar, request.constraint)
        compiled.result(timeout=600)
    warm_up(engine, requests[0])
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    ttft: dict[str, float] = {}
    cached: dict[str, int] = {}
    start = time.perf_counter()
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                ttft[out.request_id] = out.timings.first_token_s
                cached[out.request_id] = out.usage.cached_prompt_tokens
    wall = time.perf_counter() - start
    generated = sum(len(t) for t in tokens.values())
    values = sorted(ttft.values())
    return {
        "wall_s": round(wall, 3),
        "generated_tokens": generated,
        "tokens_per_s": round(generated / wall, 2),
        "ttft_p50_s": round(statistics.median(values), 3),
        "ttft_p90_s": round(values[int(0.9 * (len(values) - 1))], 3),
        "cached_prompt_tokens": sum(cached.values()),
        "stats": {k: v for k, v in engine.stats().items() if k.startswith("prefix_")},
        "_tokens": tokens,
    }


def build_engine(args: argparse.Namespace) -> Any:
    from espalier.engine.config import RunnerConfig
    from espalier.engine.engine import Engine, EngineConfig
    from espalier.server.default_model import default_tokenizer, resolve_model

    if args.model != "8b-random":
        model = resolve_model(args.model)
        return Engine.from_model(model, runner_config=RunnerConfig(device=args.device))
    from gpu import llama_8b_config  # bench/gpu.py (this script's folder is on sys.path)
    from spec import _random_state

    from espalier.engine.config import CacheConfig
    from espalier.engine.kv_cache import blocks_needed
    from espalier.engine.model.runner import ModelRunner

    if args.tokenizer:
        from espalier.constrained.tokenizer import TokenizerInfo

        tokenizer = TokenizerInfo.from_pretrained(args.tokenizer)
    else:
        tokenizer = default_tokenizer()
    config = llama_8b_config(tokenizer.vocab_size)
    # every request's blocks at once without the cache (user turns < 64 tokens), and spare
    per_request = blocks_needed(args.system_tokens + 64 + args.max_tokens, 16)
    cache = CacheConfig(block_size=16, num_blocks=args.requests * per_request + 256)
    runner_config = RunnerConfig(device="cuda", cache=cache)
    runner = ModelRunner(config, _random_state(config, "cuda"), runner_config)
    return Engine(EngineConfig(), runner, tokenizer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default="default", help="default | PATH | 8b-random")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--tokenizer", default="", help="8b-random: a saved Hugging Face tokenizer folder"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from espalier.engine.engine import Engine, EngineConfig
    from espalier.engine.head_screen import HeadScreen

    if args.model == "8b-random":
        args.device = "cuda"
    base = build_engine(args)
    if base.runner.device.type == "cpu":  # CPU only: built once, shared, in neither side
        HeadScreen.for_model(base.runner.model).wait(600)
    requests = make_requests(base.tokenizer, args)
    sides: dict[str, dict[str, Any]] = {}
    for name, caching in (("no_cache", False), ("prefix_cache", True)):
        sched = replace(base.config.scheduler, prefix_caching=caching)
        config: EngineConfig = replace(base.config, scheduler=sched)
        engine = Engine(config, base.runner, base.tokenizer, grammar=base.grammar)
        sides[name] = run_side(engine, requests)
        engine.strategy.close()  # not engine.close(): the grammar service is shared
        shown = {k: v for k, v in sides[name].items() if not k.startswith("_")}
        print(json.dumps({"side": name, **vars(args), **shown}), flush=True)
    off, on = sides["no_cache"], sides["prefix_cache"]
    ttft_ratio = off["ttft_p50_s"] / max(on["ttft_p50_s"], 1e-9)
    tput_ratio = on["tokens_per_s"] / max(off["tokens_per_s"], 1e-9)
    summary = {
        "summary": "prefix_cache_vs_no_cache",
        "requests": args.requests,
        "system_tokens": args.system_tokens,
        "ttft_p50_ratio": round(ttft_ratio, 2),
        "throughput_ratio": round(tput_ratio, 2),
        "ttft_target": 5.0,
        "throughput_target": 2.0,
        "identical_outputs": off["_tokens"] == on["_tokens"],
        "threads": torch.get_num_threads(),
        "device": str(base.runner.device),
        "attention": base.runner.attention.name,
    }
    print(json.dumps(summary), flush=True)
    base.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
