"""Speculative decoding under grammars: constrained vs unconstrained, speculative vs plain, in one
run, printing JSON lines.

Parts (``--part``, comma-separated; default ``forced,cpu``):

- ``forced``: share of tokens accepted from grammar-forced chains on a sample of JSONSchemaBench
  schemas, model-free: the "target" is an oracle whose greedy output is a valid test instance of
  the schema (its tokenization); each step drafts the forced chain at the root, accepts the part
  that matches the instance plus one bonus token. Reports forced-accepted / all tokens.
- ``cpu``: the embedded default model (Gemma 3 270M) on this CPU, JSON-schema prompts, greedy;
  four engine runs on the same requests: {unconstrained, constrained} × {plain, speculative with
  n-gram + forced chains}; tokens/s, accept length, forced share, and the ratios.
- ``gpu``: needs CUDA. An 8B-shaped target (Llama-3-8B dimensions, random bf16 weights, the
  Gemma tokenizer's 262,144-token vocabulary) and an oracle drafter that proposes the target's
  own greedy continuation (recorded by a plain run first: acceptance is known, ~100 %), batch 1
  and 32, {unconstrained, constrained} × {plain, speculative}; the target is
  constrained speculative throughput >= 0.97 x unconstrained speculative throughput.

    .venv/bin/python bench/spec.py [--part forced,cpu,gpu] [--schemas 6] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / ".data" / "jsonschemabench"
ARCHIVE = ROOT.parent / "shared" / "conformance" / "jsonschemabench.tar.xz"
BACKEND = "llguidance"  # compiles in ms for the 262k Gemma vocabulary (xgrammar: seconds here)
SUBSETS = (
    "Github_easy",
    "Github_medium",
    "Glaiveai2K",
    "Kubernetes",
    "Snowplow",
    "JsonSchemaStore",
)


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def sample_schemas(n: int, with_instances: bool) -> list[tuple[str, dict[str, Any], list[Any]]]:
    """``(name, schema, valid instances)`` round-robin over subsets, in file-name order."""
    if not DATA.exists():
        (ROOT / ".data").mkdir(exist_ok=True)
        subprocess.run(["tar", "-xJf", str(ARCHIVE), "-C", str(ROOT / ".data")], check=True)
    files = [sorted((DATA / s).glob("*.json")) for s in SUBSETS if (DATA / s).exists()]
    chosen: list[tuple[str, dict[str, Any], list[Any]]] = []
    index = 0
    while len(chosen) < n and any(index < len(f) for f in files):
        for subset in files:
            if index < len(subset) and len(chosen) < n:
                doc = json.loads(subset[index].read_text())
                valid = [t["data"] for t in doc.get("tests", []) if t.get("valid")]
                if isinstance(doc.get("schema"), dict) and (valid or not with_instances):
                    chosen.append(
                        (f"{subset[index].parent.name}/{subset[index].name}", doc["schema"], valid)
                    )
        index += 1
    return chosen


def instance_pool(tokenizer: Any, n_schemas: int, min_tokens: int) -> list[tuple[Any, list[int]]]:
    """``(compiled grammar, tokens)`` for the valid instances of :func:`sample_schemas`'s
    schemas (llguidance, weakening allowed) that tokenize to at least ``min_tokens`` tokens and
    that the grammar accepts whole; in schema order."""
    pool = []
    for _, schema, instances in sample_schemas(n_schemas, with_instances=True):
        compiled = compile_schema(schema, tokenizer)
        if compiled is None:
            continue
        for instance in instances:
            tokens = tokenizer.encode(json.dumps(instance))
            if len(tokens) >= min_tokens and compiled.matcher().accept_tokens(tokens) == len(
                tokens
            ):
                pool.append((compiled, tokens))
    return pool


def compile_schema(
    schema: dict[str, Any], tokenizer: Any, backend: str = "llguidance"
) -> Any | None:
    from espalier.constrained.compile import compile_grammar
    from espalier.constrained.errors import GrammarError
    from espalier.constrained.spec import GrammarSpec

    try:
        compiled, _ = compile_grammar(
            GrammarSpec.json_schema(schema), tokenizer, backend, allow_weakening=True
        )
    except (GrammarError, ValueError):
        return None
    return compiled


# -- forced-chain share, model-free ------------------------------------------------------------


def forced_share(n_schemas: int, limit: int) -> None:
    from espalier.server.default_model import default_tokenizer

    tokenizer = default_tokenizer()
    total = forced = steps = instances = 0
    for _name, schema, valid in sample_schemas(n_schemas, with_instances=True):
        compiled = compile_schema(schema, tokenizer)
        if compiled is None:
            continue
        for data in valid[:2]:
            text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
            tokens = tokenizer.hf.encode(text, add_special_tokens=False)
            matcher = compiled.matcher()
            t, f, s = _replay_with_forced(matcher, tokens, limit)
            if t:
                instances += 1
                total, forced, steps = total + t, forced + f, steps + s
    emit(
        {
            "part": "forced",
            "schemas": n_schemas,
            "instances": instances,
            "tokens": total,
            "forced_accepted": forced,
            "forced_share": forced / max(total, 1),
            "tokens_per_step": total / max(steps, 1),
        }
    )


def _replay_with_forced(matcher: Any, tokens: list[int], limit: int) -> tuple[int, int, int]:
    """Speculation with forced chains against an oracle target emitting ``tokens``:
    (tokens emitted, of them accepted from forced chains, steps)."""
    pos = forced = steps = 0
    while pos < len(tokens):
        chain = matcher.forced_tokens(limit)
        accepted = 0
        while accepted < len(chain) and pos + accepted < len(tokens):
            if chain[accepted] != tokens[pos + accepted]:
                break
            accepted += 1
        emitted = tokens[pos : pos + accepted + 1]  # + the bonus token
        for token in emitted:
            if not matcher.accept(token):
                return pos, forced, steps  # the tokenization left the grammar: stop here
            pos += 1
        forced += accepted
        steps += 1
    return pos, forced, steps


# -- engine runs -----------------------------------------------------------------------------


def run_engine(engine: Any, requests: Sequence[Any]) -> dict[str, Any]:
    """Run ``requests`` to completion; tokens/s over wall time, speculative stats summed."""
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    drafted = accepted = forced = steps = 0
    start = time.perf_counter()
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].extend(out.token_ids)
            if out.finished and out.speculative is not None:
                s = out.speculative
                drafted, accepted = drafted + s.draft_tokens, accepted + s.accepted_tokens
                forced, steps = forced + s.forced_tokens, steps + s.steps
    seconds = time.perf_counter() - start
    tokens = sum(len(v) for v in outputs.values())
    return {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": tokens / seconds,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "forced_tokens": forced,
        "mean_accept_length": accepted / steps if steps else 0.0,
        "outputs": outputs,
    }


def shared_grammars(
    tokenizer: Any, specs: Sequence[Any], spares_per_grammar: int = 16, backend: str = BACKEND
) -> Any:
    """One GrammarService for every engine of a part, its grammars compiled on ``backend``
    before any timing (``spares_per_grammar``: the service's, as ``espalier serve
    --matcher-spares``)."""
    from espalier.constrained.cache import CompileCache
    from espalier.engine.api import ConstraintOptions
    from espalier.engine.constraints import GrammarService

    service = GrammarService(
        tokenizer,
        cache=CompileCache(timeout_s=600.0),
        spares_per_grammar=spares_per_grammar,
    )
    options = ConstraintOptions(backend=backend, allow_weakening=True)
    for spec in specs:
        service.submit(spec, options).result()
    return service


def requests_for(
    prompts: Sequence[Any],
    grammars: Sequence[Any],
    max_tokens: int,
    spec: Any,
    *,
    token_ids: bool = False,
) -> list[Any]:
    from espalier.engine.api import ConstraintOptions, GenerationRequest, SamplingParams

    return [
        GenerationRequest(
            f"q{i}",
            prompt=None if token_ids else p,
            prompt_token_ids=tuple(p) if token_ids else None,
            sampling=SamplingParams(max_tokens=max_tokens),
            grammar=g,
            constraint=ConstraintOptions(backend=BACKEND, allow_weakening=True),
            speculative=spec,
        )
        for i, (p, g) in enumerate(zip(prompts, grammars))
    ]


def cpu_part(n_schemas: int, max_tokens: int) -> None:
    from espalier.constrained.spec import GrammarSpec
    from espalier.engine.api import SpeculativeOptions
    from espalier.engine.engine import Engine, EngineConfig
    from espalier.engine.spec.ngram import NgramDrafter
    from espalier.engine.spec.strategy import SpecConfig, install
    from espalier.server.default_model import default_gguf

    base = Engine.from_model(default_gguf(), EngineConfig(compile_timeout_s=600))
    runner, tokenizer = base.runner, base.tokenizer
    base.close()
    schemas = [
        s
        for s in sample_schemas(n_schemas, with_instances=False)
        if compile_schema(s[1], tokenizer) is not None
    ]
    prompts = [
        f"Return one JSON object for this JSON schema:\n{json.dumps(s)[:600]}\nJSON: "
        for _, s, _ in schemas
    ]
    service = shared_grammars(tokenizer, [GrammarSpec.json_schema(s) for _, s, _ in schemas])
    results: dict[tuple[bool, bool], dict[str, Any]] = {}
    for constrained in (False, True):
        grammars = [GrammarSpec.json_schema(s) if constrained else None for _, s, _ in schemas]
        for speculative in (False, True):
            engine = Engine(EngineConfig(), runner, tokenizer, grammar=service)
            if speculative:
                install(engine, SpecConfig(num_draft_tokens=8), {"ngram": NgramDrafter()})
            options = SpeculativeOptions(enabled=speculative)
            reqs = requests_for(prompts, grammars, max_tokens, options)
            result = run_engine(engine, reqs)
            engine.close()
            results[(constrained, speculative)] = result
            emit(
                {
                    "part": "cpu",
                    "model": "gemma3-270m",
                    "batch": len(reqs),
                    "constrained": constrained,
                    "speculative": "ngram+forced" if speculative else "off",
                    **{k: v for k, v in result.items() if k != "outputs"},
                }
            )
    _ratios("cpu", results)


def _ratios(part: str, results: dict[tuple[bool, bool], dict[str, Any]], **extra: Any) -> None:
    def tps(c: bool, s: bool) -> float:
        return float(results[(c, s)]["tok_per_s"])

    spec_c = results[(True, True)]
    emit(
        {
            "part": part,
            **extra,
            "speedup_unconstrained": tps(False, True) / tps(False, False),
            "speedup_constrained": tps(True, True) / tps(True, False),
            "constrained_over_unconstrained_speculative": tps(True, True) / tps(False, True),
            "constrained_over_unconstrained_plain": tps(True, False) / tps(False, False),
            "forced_share_constrained": spec_c["forced_tokens"] / max(spec_c["tokens"], 1),
        }
    )


# -- GPU: 8B-shaped target, oracle drafter ---------------------------------------------------


class OracleDrafter:
    """Proposes the target's recorded greedy continuation (a chain): acceptance is known."""

    name = "oracle"

    def __init__(self, continuations: dict[str, tuple[int, list[int]]]) -> None:
        self.continuations = continuations  # request id -> (prompt length, greedy output ids)

    def propose(self, inputs: Sequence[Any]) -> list[Any]:
        from espalier.engine.spec.tree_builder import NodeSource, TreeBuilder

        drafts = []
        for item in inputs:
            prompt_len, output = self.continuations[item.request_id]
            done = len(item.context) + len(item.extra) - prompt_len
            builder = TreeBuilder([*item.context, *item.extra][-1])
            chain = output[done : done + item.budget]
            scores = [-0.01 * (d + 1) for d in range(len(chain))]
            builder.add_path(0, chain, scores, NodeSource.MODEL)
            drafts.append(builder.build(item.budget))
        return drafts

    def release(self, request_id: str) -> None:
        return None


def gpu_part(
    batches: Sequence[int],
    max_tokens: int,
    n_schemas: int,
    *,
    smoke: bool = False,
    tokenizer_dir: str | None = None,
) -> None:
    """``smoke``: the same flow on the CPU with a tiny model (checks the bench itself).

    ``tokenizer_dir``: a converted Gemma tokenizer folder (for machines without the GGUF package).
    """
    import torch

    from espalier.constrained.spec import GrammarSpec
    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.engine.api import SpeculativeOptions
    from espalier.engine.config import CacheConfig, ModelConfig, RunnerConfig
    from espalier.engine.engine import Engine, EngineConfig
    from espalier.engine.model.runner import ModelRunner
    from espalier.engine.scheduler import SchedulerConfig
    from espalier.engine.spec.strategy import SpecConfig, install
    from espalier.server.default_model import default_tokenizer

    if not smoke and not torch.cuda.is_available():
        emit({"part": "gpu", "skipped": "CUDA not available"})
        return
    device = "cpu" if smoke else "cuda"
    if tokenizer_dir:
        tokenizer = TokenizerInfo.from_pretrained(tokenizer_dir)
    else:
        tokenizer = default_tokenizer()
    dims = (
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
        )
        if smoke
        else dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
        )
    )
    config = ModelConfig(
        model_type="llama", vocab_size=tokenizer.vocab_size, rms_norm_eps=1e-5, **dims
    )
    runner = ModelRunner(
        config,
        _random_state(config, device),
        RunnerConfig(device=device, cache=CacheConfig(block_size=16, num_blocks=8192)),
    )
    schemas = [
        s
        for s in sample_schemas(n_schemas, with_instances=False)
        if compile_schema(s[1], tokenizer) is not None
    ]
    service = shared_grammars(tokenizer, [GrammarSpec.json_schema(s) for _, s, _ in schemas])
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        prompts = [torch.randint(0, 200_000, (128,), generator=gen).tolist() for _ in range(batch)]
        results: dict[tuple[bool, bool], dict[str, Any]] = {}
        for constrained in (False, True):
            grammars = [
                GrammarSpec.json_schema(schemas[i % len(schemas)][1]) if constrained else None
                for i in range(batch)
            ]
            engine_config = EngineConfig(
                compile_timeout_s=600,
                scheduler=SchedulerConfig(
                    max_num_seqs=max(batch, 1), max_num_batched_tokens=max(4096, 160 * batch)
                ),
            )
            plain = Engine(engine_config, runner, tokenizer, grammar=service)
            off = SpeculativeOptions(enabled=False)
            run_engine(plain, requests_for(prompts, grammars, 8, off, token_ids=True))  # warm-up
            result = run_engine(
                plain, requests_for(prompts, grammars, max_tokens, off, token_ids=True)
            )
            plain.close()
            results[(constrained, False)] = result
            continuations = {
                f"q{i}": (len(p), result["outputs"][f"q{i}"]) for i, p in enumerate(prompts)
            }
            engine = Engine(engine_config, runner, tokenizer, grammar=service)
            install(
                engine,
                SpecConfig(methods=("oracle",), num_draft_tokens=8, mask_budget_s=None),
                {"oracle": OracleDrafter(continuations)},
            )
            on = SpeculativeOptions(enabled=True)
            # warm-up: tree steps of every size compile kernel variants plain decoding never used
            run_engine(engine, requests_for(prompts, grammars, max_tokens, on, token_ids=True))
            spec = run_engine(
                engine, requests_for(prompts, grammars, max_tokens, on, token_ids=True)
            )
            engine.close()
            results[(constrained, True)] = spec
            for speculative in (False, True):
                r = results[(constrained, speculative)]
                emit(
                    {
                        "part": "gpu",
                        "model": "tiny-smoke" if smoke else "llama-8b-shaped",
                        "attention": runner.attention.name,
                        "decode_graphs": runner.graphs is not None,
                        "batch": batch,
                        "constrained": constrained,
                        "speculative": "oracle" if speculative else "off",
                        **{k: v for k, v in r.items() if k != "outputs"},
                    }
                )
        _ratios("gpu", results, batch=batch)


def _random_state(config: Any, device: str) -> dict[str, Any]:
    """Random weights (bf16 on CUDA, fp32 on CPU), HF Llama names (std 0.02; norms 1).

    The attention and MLP output projections (``o_proj``, ``down_proj``) are zero, so every
    layer adds nothing to the residual stream and the logits are a function of the current
    token alone (a bigram model) while every GEMM, attention call and KV write still runs at
    full size. Why: the oracle drafter replays the greedy output of a plain run, and with fully
    random bf16 weights the top-2 logits of a 262k vocabulary are often closer than the rounding
    differences between a decode forward and a tree-verify forward, so the two runs part ways
    within a few tokens and acceptance collapses to ~0 (first H200 runs). With zero output
    projections the verify and decode logits of a token are the same up to the LM head GEMM's
    accumulation order, and the oracle's acceptance is what it should be: near 100 %.
    """
    import torch

    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_kv_heads * config.head_dim
    gen = torch.Generator(device=device).manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        t = torch.empty(
            shape, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32
        )
        return t.normal_(0.0, 0.02, generator=gen)

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, device=device, dtype=w(1).dtype)

    state = {
        "model.embed_tokens.weight": w(v, h),
        "model.norm.weight": torch.ones(h, device=device),
        "lm_head.weight": w(v, h),
    }
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        state.update(
            {
                p + "self_attn.q_proj.weight": w(h, h),
                p + "self_attn.k_proj.weight": w(kv, h),
                p + "self_attn.v_proj.weight": w(kv, h),
                p + "self_attn.o_proj.weight": zeros(h, h),
                p + "mlp.gate_proj.weight": w(i, h),
                p + "mlp.up_proj.weight": w(i, h),
                p + "mlp.down_proj.weight": zeros(h, i),
                p + "input_layernorm.weight": torch.ones(h, device=device),
                p + "post_attention_layernorm.weight": torch.ones(h, device=device),
            }
        )
    return state


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="forced,cpu")
    parser.add_argument("--schemas", type=int, default=6)
    parser.add_argument("--forced-schemas", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--gpu-max-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--smoke", action="store_true", help="gpu part on the CPU, tiny model")
    parser.add_argument("--tokenizer", default=None, help="converted tokenizer folder (gpu part)")
    args = parser.parse_args(argv)
    parts = set(args.part.split(","))
    if "forced" in parts:
        forced_share(args.forced_schemas, limit=16)
    if "cpu" in parts:
        cpu_part(args.schemas, args.max_tokens)
    if "gpu" in parts:
        batches = [int(b) for b in args.batches.split(",")]
        gpu_part(
            batches,
            args.gpu_max_tokens,
            args.schemas,
            smoke=args.smoke,
            tokenizer_dir=args.tokenizer,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
