"""End-to-end validity of the embedded model's constrained outputs (issues 35 and 36).

Every output must be valid, or say why not: refused at compile (with the reason), or cut by
max_tokens with ``FinishReason.LENGTH_UNCLOSED`` where the closing policy could not close it.
The embedded default (Gemma 3 270M, ``--model default``), greedy, ``--max-tokens`` (256), the
in-process engine with ``--concurrency`` requests in flight (the rest queue), server defaults
otherwise (strict ``auto`` backend, 30 s compile limit, post-validation, closing policy on).

Schemas (``--set``):
- ``bench100`` (default): a fixed sample of ``--schemas`` (100) JSONSchemaBench schemas, the
  same count from each of the ten JSONSchemaBench subsets (``SUBSETS``): in each subset folder
  of ``../shared/conformance/jsonschemabench.tar.xz`` (unpacked into the git-ignored
  ``.data/jsonschemabench``), ``random.Random("<subset>:<seed>").sample`` of its files in name
  order (``--seed`` 0). No schema is skipped: compile refusals are one of the outcomes.
- ``vllm_cpu``: ``bench/vllm_cpu.py``'s benchmark schemas (``bench/engine.py``'s
  ``select_schemas``, its first ``--schemas``).
``--only NAME[,NAME]`` re-runs the named schemas of the set (``subset/stem``).

Prompt: ``bench/engine.py``'s ``prompt_for`` (a completion prompt naming the schema's title).

Per request, a JSON line (``"event": "request"``) with its outcome, one of: ``valid`` (the
engine's post-validation passed; ``closed_by_budget`` says the closing policy ended it),
``refused`` (a GrammarError at compile; ``reason``), ``error`` (any other failure),
``cut_unclosed`` (LENGTH_UNCLOSED), ``cut_without_reason`` (finish ``length`` but invalid) and
``invalid`` (ended STOP/GRAMMAR/LENGTH yet failing post-validation); and ``duplicate_keys``
(an object of the text repeats a key) with ``judge_valid``, both from ``bench/vllm_cpu.py``'s
``judge`` (its own parse and jsonschema check, apart from the engine's). Then a summary line
with the counts and the issues' done-when: 0 invalid, 0 with duplicate keys, 0 cut without the
distinct reason.

    .venv/bin/python bench/validity.py [--set bench100|vllm_cpu] [--schemas 100]
        [--max-tokens 256] [--concurrency 16] [--only Github_easy/o1234] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / ".data" / "jsonschemabench"
ARCHIVE = ROOT.parent / "shared" / "conformance" / "jsonschemabench.tar.xz"
SUBSETS = (
    "Github_trivial",
    "Github_easy",
    "Github_medium",
    "Github_hard",
    "Github_ultra",
    "Glaiveai2K",
    "JsonSchemaStore",
    "Kubernetes",
    "Snowplow",
    "WashingtonPost",
)
OUTCOMES = ("valid", "refused", "error", "cut_unclosed", "cut_without_reason", "invalid")


def emit(record: dict[str, Any]) -> None:
    print(json.dumps({"bench": "validity", **record}), flush=True)


def sample_bench100(count: int, seed: int) -> list[tuple[str, Any]]:
    """``count`` schemas, an equal share per subset (the first subsets take the remainder)."""
    if not DATA.exists():
        (ROOT / ".data").mkdir(exist_ok=True)
        subprocess.run(["tar", "-xJf", str(ARCHIVE), "-C", str(ROOT / ".data")], check=True)
    chosen: list[tuple[str, Any]] = []
    for i, subset in enumerate(SUBSETS):
        share = count // len(SUBSETS) + (1 if i < count % len(SUBSETS) else 0)
        files = sorted((DATA / subset).glob("*.json"))
        for path in random.Random(f"{subset}:{seed}").sample(files, min(share, len(files))):
            chosen.append((f"{subset}/{path.stem}", json.loads(path.read_text())["schema"]))
    return chosen


def sample_vllm_cpu(count: int, tokenizer: Any) -> list[tuple[str, Any]]:
    """``bench/vllm_cpu.py``'s schemas: ``bench/engine.py``'s selection."""
    import xgrammar

    from engine import select_schemas  # bench/engine.py

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=tokenizer.vocab_size)
    return select_schemas(count, tokenizer, xgrammar.GrammarCompiler(info))


def outcome_of(last: Any) -> tuple[str, str]:
    """(outcome, detail) of a request from its final chunk (``RequestOutput``)."""
    from espalier.constrained.errors import GrammarError
    from espalier.engine.api import FinishReason

    reason = last.finish_reason
    if reason is FinishReason.ERROR:
        kind = "refused" if isinstance(last.exception, GrammarError) else "error"
        return kind, str(last.error)
    if reason is FinishReason.LENGTH_UNCLOSED:
        return "cut_unclosed", ""
    validation = last.validation
    if validation is not None and validation.valid:
        return "valid", ""
    errors = "; ".join(validation.errors[:3]) if validation is not None else "not validated"
    if reason is FinishReason.LENGTH:
        return "cut_without_reason", errors
    return "invalid", errors


def run(engine: Any, chosen: list[tuple[str, Any]], max_tokens: int) -> dict[str, int]:
    """Every request added at once (the scheduler keeps its limit in flight); a line per
    finished request; the counts."""
    from vllm_cpu import judge  # bench/vllm_cpu.py

    from engine import prompt_for  # bench/engine.py
    from espalier.constrained.spec import GrammarSpec
    from espalier.engine.api import GenerationRequest, SamplingParams

    names, schemas = {}, {}
    for i, (name, schema) in enumerate(chosen):
        names[f"v{i}"], schemas[f"v{i}"] = name, schema
        engine.add_request(
            GenerationRequest(
                f"v{i}",
                prompt=prompt_for(schema),
                sampling=SamplingParams(max_tokens=max_tokens),
                grammar=GrammarSpec.json_schema(schema),
            )
        )
    counts = dict.fromkeys([*OUTCOMES, "closed_by_budget", "duplicate_keys", "tokens"], 0)
    texts: dict[str, list[str]] = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            texts.setdefault(out.request_id, []).append(out.text_delta)
            if not out.finished:
                continue
            text = "".join(texts.pop(out.request_id))
            outcome, detail = outcome_of(out)
            # parsed apart from the engine (bench/vllm_cpu.py's judge: its own parse and
            # jsonschema check, no format checker)
            verdict = judge(text, schemas[out.request_id], out.finish_reason.value)
            repeated = verdict["duplicate_keys"] if outcome != "refused" else None
            tokens = out.usage.completion_tokens if out.usage is not None else 0
            counts[outcome] += 1
            counts["closed_by_budget"] += outcome == "valid" and out.closed_by_budget
            counts["duplicate_keys"] += bool(repeated)
            counts["tokens"] += tokens
            emit(
                {
                    "event": "request",
                    "schema": names[out.request_id],
                    "outcome": outcome,
                    "detail": detail[:300],
                    "finish_reason": out.finish_reason.value,
                    "closed_by_budget": out.closed_by_budget,
                    "duplicate_keys": repeated,
                    "judge_valid": verdict["valid"],
                    "backend": out.backend,
                    "tokens": tokens,
                    "text": text[:400],
                    "elapsed_s": round(time.perf_counter() - start, 1),
                }
            )
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=("bench100", "vllm_cpu"), default="bench100")
    parser.add_argument("--schemas", type=int, default=0, help="0: 100 (bench100), 24 (vllm_cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--only", default="", help="comma-separated schema names of the set")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))

    from espalier.engine.engine import Engine, EngineConfig
    from espalier.engine.scheduler import SchedulerConfig
    from espalier.server.default_model import default_gguf

    start = time.perf_counter()
    engine = Engine.from_model(
        default_gguf(),
        EngineConfig(
            scheduler=SchedulerConfig(max_num_seqs=args.concurrency, max_num_batched_tokens=4096)
        ),
    )
    if args.set == "bench100":
        chosen = sample_bench100(args.schemas or 100, args.seed)
    else:
        chosen = sample_vllm_cpu(args.schemas or 24, engine.tokenizer)
    if args.only:
        wanted = set(args.only.split(","))
        chosen = [(name, schema) for name, schema in chosen if name in wanted]
    emit({"event": "start", **vars(args), "schemas": len(chosen)})
    try:
        counts = run(engine, chosen, args.max_tokens)
    finally:
        engine.close()
    done = {
        "no_invalid": counts["invalid"] == 0,
        "no_duplicate_keys": counts["duplicate_keys"] == 0,
        "no_cut_without_reason": counts["cut_without_reason"] == 0,
    }
    seconds = time.perf_counter() - start
    emit(
        {
            "event": "summary",
            "schemas": len(chosen),
            **counts,
            "done_when": done,
            "seconds": round(seconds, 1),
        }
    )
    return 0 if all(done.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
