"""Constrained generation throughput: espalier's engine vs transformers ``generate`` with
xgrammar's transformers logits processor (``xgrammar.contrib.hf.LogitsProcessor``).

Same default model (Gemma 3 270M, fp32 on CPU), same prompts (short completion prompts naming
the schema's title) and JSON schemas from JSONSchemaBench, greedy. Batch 1 runs each prompt
alone; batch 8 runs the 8 prompts together (transformers: one padded ``generate``; espalier: 8
concurrent requests). Tokens/s counts the tokens each request generated (up to and including its
stop token), over wall time including prefill; grammar compilation is done before timing on both
sides. Prints JSON lines.

    .venv/bin/python bench/engine.py [--schemas 8] [--max-tokens 96] [--threads N]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
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
    from espalier.engine.scheduler import SchedulerConfig
    from espalier.engine.weights import resolve_model_dir

    engine = Engine.from_model(
        "default",
        EngineConfig(
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096),
            compile_timeout_s=600.0,
        ),
    )
    tok = engine.tokenizer
    model_dir = resolve_model_dir("default")
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    xgr_info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=model.config.vocab_size)
    xgr_compiler = xgr.GrammarCompiler(xgr_info)
    chosen = select_schemas(args.schemas, tok, xgr_compiler)
    names = [name for name, _ in chosen]
    schemas = [schema for _, schema in chosen]
    prompts = [prompt_for(s) for s in schemas]
    compiled = [xgr_compiler.compile_json_schema(json.dumps(s)) for s in schemas]
    stops = list(tok.stop_token_ids)
    # warm-up: espalier compiles every grammar into its cache; both run a short generation
    run_espalier(engine, prompts, schemas, 1)
    run_transformers(model, tok.hf, compiled[:1], prompts[:1], stops, 2)
    print(json.dumps({"bench": "engine", "schemas": names, "threads": torch.get_num_threads()}))

    for batch in [int(b) for b in args.batches.split(",")]:
        groups = [
            list(range(i, min(i + batch, len(prompts)))) for i in range(0, len(prompts), batch)
        ]
        totals = {"espalier": [0, 0.0], "transformers+xgrammar": [0, 0.0]}
        same = valid = 0
        for group in groups:
            g_prompts = [prompts[i] for i in group]
            hf_out, hf_s = run_transformers(
                model, tok.hf, [compiled[i] for i in group], g_prompts, stops, args.max_tokens
            )
            es_out, es_s, es_valid = run_espalier(
                engine, g_prompts, [schemas[i] for i in group], args.max_tokens
            )
            totals["transformers+xgrammar"][0] += sum(len(r) for r in hf_out)
            totals["transformers+xgrammar"][1] += hf_s
            totals["espalier"][0] += sum(len(r) for r in es_out)
            totals["espalier"][1] += es_s
            same += sum(a == b for a, b in zip(hf_out, es_out))
            valid += sum(es_valid)
        rates = {}
        for impl, (n_tokens, seconds) in totals.items():
            rates[impl] = n_tokens / seconds
            print(
                json.dumps(
                    {
                        "batch": batch,
                        "impl": impl,
                        "tokens": n_tokens,
                        "seconds": round(seconds, 3),
                        "tokens_per_s": round(rates[impl], 2),
                    }
                )
            )
        print(
            json.dumps(
                {
                    "batch": batch,
                    "speedup": round(rates["espalier"] / rates["transformers+xgrammar"], 3),
                    "identical_outputs": f"{same}/{len(prompts)}",
                    "espalier_valid": f"{valid}/{len(prompts)}",
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
