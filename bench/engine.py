"""Constrained generation throughput: espalier's engine vs transformers ``generate`` with
xgrammar's transformers logits processor (``xgrammar.contrib.hf.LogitsProcessor``).

Same default model (Gemma 3 270M, fp32 on CPU), same prompts (short completion prompts naming
the schema's title) and JSON schemas from JSONSchemaBench, greedy, the same ``--max-tokens`` on
both sides. The baseline's xgrammar grammar is compiled from the same narrowed schema and with the
same whitespace bound as espalier's grammars (``BackendOptions``: bounded whitespace and JSON
numbers), so both sides are asked for the same language and greedy outputs can match token for
token (``identical_outputs``). Batch 1 runs each of the first ``--batch1-prompts`` prompts alone;
batch 8 runs groups of 8 prompts together (transformers: one left-padded ``generate``, which
keeps computing finished rows until the longest one stops; espalier: 8 concurrent requests).
Tokens/s counts the tokens each request generated (up to and including its stop token), over
wall time including prefill; grammar compilation is done before timing on both sides.

Prints JSON lines: one per timed group (``"group"``), one per batch size and side, one speedup
line per batch size, and a final ``"summary"`` line with both ratios against their targets.

    .venv/bin/python bench/engine.py [--schemas 8] [--max-tokens 64] [--batch1-prompts 4]
        [--batches 1,8] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / ".data" / "jsonschemabench"
ARCHIVE = ROOT.parent / "shared" / "conformance" / "jsonschemabench.tar.xz"
SUBSETS = ("Github_trivial", "Github_easy", "Glaiveai2K", "Snowplow")
MAX_SCHEMA_CHARS = 1200


def select_schemas(n: int, tokenizer: Any, xgr_compiler: Any) -> list[tuple[str, dict[str, Any]]]:
    """The first small object schemas (name order, round-robin over subsets) that both espalier
    (strict mode) and xgrammar compile."""
    from espalier.constrained.compile import compile_grammar
    from espalier.constrained.spec import GrammarSpec

    if not DATA.exists():
        (ROOT / ".data").mkdir(exist_ok=True)
        subprocess.run(["tar", "-xJf", str(ARCHIVE), "-C", str(ROOT / ".data")], check=True)
    files = [sorted((DATA / s).glob("*.json")) for s in SUBSETS]
    chosen: list[tuple[str, dict[str, Any]]] = []
    index = 0
    while len(chosen) < n and any(index < len(f) for f in files):
        for subset_files in files:
            if index >= len(subset_files) or len(chosen) == n:
                continue
            path = subset_files[index]
            schema = json.loads(path.read_text())["schema"]
            text = json.dumps(schema, separators=(",", ":"))
            if len(text) > MAX_SCHEMA_CHARS or schema.get("type") != "object":
                continue
            try:
                compile_grammar(GrammarSpec.json_schema(schema), tokenizer)
                xgr_compiler.compile_json_schema(text)
            except Exception:
                continue
            chosen.append((f"{path.parent.name}/{path.stem}", schema))
        index += 1
    return chosen


def prompt_for(schema: dict[str, Any]) -> str:
    """A short completion prompt (a base model; the grammar carries the schema's structure)."""
    title = schema.get("title") or schema.get("description") or ""
    about = f" describing {str(title)[:80]}" if title else ""
    return f"Here is a JSON object{about}:\n"


def run_espalier(engine: Any, prompts: list[str], schemas: list[Any], max_tokens: int) -> Any:
    from espalier.constrained.spec import GrammarSpec
    from espalier.engine.api import GenerationRequest, SamplingParams

    for i, (prompt, schema) in enumerate(zip(prompts, schemas)):
        engine.add_request(
            GenerationRequest(
                f"b{i}",
                prompt=prompt,
                sampling=SamplingParams(max_tokens=max_tokens),
                grammar=GrammarSpec.json_schema(schema),
            )
        )
    tokens: dict[str, list[int]] = {}
    valid: dict[str, bool] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                valid[out.request_id] = bool(out.validation and out.validation.valid)
    seconds = time.perf_counter() - t0
    ordered = [tokens[f"b{i}"] for i in range(len(prompts))]
    return ordered, seconds, [valid[f"b{i}"] for i in range(len(prompts))]


def run_transformers(
    model: Any, hf_tok: Any, compiled: list[Any], prompts: list[str], stops: list[int], n: int
) -> Any:
    from xgrammar.contrib.hf import LogitsProcessor

    inputs = hf_tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    processor = LogitsProcessor(list(compiled) if len(compiled) > 1 else compiled[0])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            max_new_tokens=n,
            do_sample=False,
            logits_processor=[processor],
            eos_token_id=stops,
            pad_token_id=hf_tok.pad_token_id,
        )
    seconds = time.perf_counter() - t0
    new = out[:, inputs["input_ids"].shape[1] :].tolist()
    generated = []
    for row in new:
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        generated.append(row[:cut])
    return generated, seconds


TARGETS = {1: 1.5, 8: 3.0}  # issue 5: espalier / baseline tokens/s at batch 1 and 8


def baseline_grammar(xgr_compiler: Any, schema: dict[str, Any]) -> Any:
    """xgrammar's grammar for ``schema`` in the language espalier compiles: the schema with the
    number bounds of ``BackendOptions`` and the same whitespace bound."""
    from espalier.constrained.backends.common import BackendOptions
    from espalier.constrained.spec import GrammarSpec

    options = BackendOptions()
    source = options.json_source(GrammarSpec.json_schema(schema), "xgrammar")
    return xgr_compiler.compile_json_schema(
        source,
        any_whitespace=True,
        max_whitespace_cnt=options.json_max_whitespace,
        strict_mode=False,
    )


def emit(record: dict[str, Any]) -> None:
    print(json.dumps({"bench": "engine", **record}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=8, help="prompts (one schema each)")
    parser.add_argument("--max-tokens", type=int, default=64, help="per request, both sides")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument(
        "--batch1-prompts", type=int, default=0, help="batch 1 on the first N prompts (0 = all)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import xgrammar as xgr
    from transformers import AutoModelForCausalLM

    from espalier.engine.engine import Engine, EngineConfig
    from espalier.engine.model.weights import resolve_model_dir
    from espalier.engine.scheduler import SchedulerConfig
    from espalier.server.default_model import default_gguf

    engine = Engine.from_model(
        default_gguf(),
        EngineConfig(
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096),
            compile_timeout_s=600.0,
        ),
    )
    tok = engine.tokenizer
    model_dir = resolve_model_dir(default_gguf())
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    xgr_info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=model.config.vocab_size)
    xgr_compiler = xgr.GrammarCompiler(xgr_info)
    chosen = select_schemas(args.schemas, tok, xgr_compiler)
    names = [name for name, _ in chosen]
    schemas = [schema for _, schema in chosen]
    prompts = [prompt_for(s) for s in schemas]
    compiled = [baseline_grammar(xgr_compiler, s) for s in schemas]
    stops = list(tok.stop_token_ids)
    screen = getattr(engine.strategy, "screen", None)
    if screen is not None:  # the fp16 LM-head screen packs on a thread at start (CPU)
        screen.wait()
    # warm-up: espalier compiles every grammar into its cache; both run a short generation
    run_espalier(engine, prompts, schemas, 1)
    run_transformers(model, tok.hf, compiled[:1], prompts[:1], stops, 2)
    emit(
        {
            "schemas": names,
            "threads": torch.get_num_threads(),
            "max_tokens": args.max_tokens,
            "batch1_prompts": args.batch1_prompts or len(prompts),
        }
    )
    speedups: dict[int, float] = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        count = len(prompts)
        if batch == 1 and args.batch1_prompts:
            count = min(args.batch1_prompts, count)
        speedups[batch] = run_batch(
            batch, count, engine, model, tok, prompts, schemas, compiled, stops, args.max_tokens
        )
    summary: dict[str, Any] = {"summary": True}
    for batch, ratio in speedups.items():
        summary[f"speedup_batch{batch}"] = round(ratio, 3)
        if batch in TARGETS:
            summary[f"target_batch{batch}"] = TARGETS[batch]
            summary[f"met_batch{batch}"] = ratio >= TARGETS[batch]
    emit(summary)
    return 0


def run_batch(
    batch: int,
    count: int,
    engine: Any,
    model: Any,
    tok: Any,
    prompts: list[str],
    schemas: list[Any],
    compiled: list[Any],
    stops: list[int],
    max_tokens: int,
) -> float:
    """Time the first ``count`` prompts in groups of ``batch`` on both sides; the speedup."""
    groups = [list(range(i, min(i + batch, count))) for i in range(0, count, batch)]
    totals = {"espalier": [0, 0.0], "transformers+xgrammar": [0, 0.0]}
    same = valid = 0
    for group in groups:
        g_prompts = [prompts[i] for i in group]
        hf_out, hf_s = run_transformers(
            model, tok.hf, [compiled[i] for i in group], g_prompts, stops, max_tokens
        )
        es_out, es_s, es_valid = run_espalier(
            engine, g_prompts, [schemas[i] for i in group], max_tokens
        )
        hf_n, es_n = sum(len(r) for r in hf_out), sum(len(r) for r in es_out)
        totals["transformers+xgrammar"][0] += hf_n
        totals["transformers+xgrammar"][1] += hf_s
        totals["espalier"][0] += es_n
        totals["espalier"][1] += es_s
        same += sum(a == b for a, b in zip(hf_out, es_out))
        valid += sum(es_valid)
        emit(
            {
                "group": group,
                "batch": batch,
                "espalier": {"tokens": es_n, "seconds": round(es_s, 3)},
                "transformers+xgrammar": {"tokens": hf_n, "seconds": round(hf_s, 3)},
            }
        )
    rates = {}
    for impl, (n_tokens, seconds) in totals.items():
        rates[impl] = n_tokens / seconds
        emit(
            {
                "batch": batch,
                "impl": impl,
                "tokens": n_tokens,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(rates[impl], 2),
            }
        )
    speedup = rates["espalier"] / rates["transformers+xgrammar"]
    emit(
        {
            "batch": batch,
            "speedup": round(speedup, 3),
            "identical_outputs": f"{same}/{count}",
            "espalier_valid": f"{valid}/{count}",
        }
    )
    return speedup


if __name__ == "__main__":
    sys.exit(main())
