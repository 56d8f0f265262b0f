"""The fast GPU path against the HBM roofline, in one run on a CUDA machine, printing JSON lines.

1. ``bandwidth``: a 4 GiB device-to-device copy (bytes read + written over the median time of
   10 copies): the anchor. Roofline decode rate at batch B = B x bandwidth / weight bytes read
   per step (every parameter but the embedding table, which is gathered, not streamed).
2. ``decode``: an 8B-Llama-shaped target (Llama-3-8B dimensions, the Gemma tokenizer's 262,144
   vocabulary, random bf16 weights as ``bench/spec.py``), batch 1 / 8 / 64, 128-token prompts,
   greedy decode steps fed back through the runner with one host sync per step (the argmax, as
   the engine does): tokens/s and the ratio to the roofline for eager torch SDPA, flashinfer
   eager and flashinfer + CUDA graphs (the runners share the weights); and graphs captured with
   the residual adds as separate kernels (``ModelOptions(fuse_residual_add=False)``), the
   anchor of the fused add + RMSNorm; and graphs with every projection on cuBLAS
   (``skinny_gemv=False``), the anchor of the skinny GEMM kernel of decode steps
   (``espalier.kernels.gemv``; ``bench/gemv.py`` times it per shape); graphs whose decode steps
   attend with flashinfer's decode kernel (off by default: ``ModelOptions`` says why) at every
   batch size (``decode_kernel_up_to``), against the default prefill kernel; graphs with rope
   and the K/V write as three launches (``fuse_rope_store=False``), the anchor of the fused
   ``rope_store``; decode and tree steps on flashinfer's prefill kernel
   (``small_query_up_to=0``), the anchor of the small-query attention kernel
   (``kernels/paged_attention``, the default for them); every kernel in plain stream order
   (``KernelOptions(pdl=False)``), the anchor of programmatic dependent launch, and PDL with
   the batch-1 gate/up projection left on cuBLAS (``gate_up_m1_under_pdl=False``); PDL at
   every batch size (``pdl_max_rows``), not only for steps of one token. Each path's runner is
   built with its options (``path_options``).
   ``pre_replay_ms``: host time
   from a graph step's call to its replay (the GPU idles through it, after the previous step's
   sync).
   ``graph_replay_ms``: GPU time of one replay of the step's captured graph (everything but the
   LM head), from back-to-back replays: the kernels' share of ``step_ms``, free of host noise.
3. ``profile``: top CUDA ops of batch-1 decode steps (torch.profiler), per path, and the host
   time to launch one eager step: what limits each.
4. ``spec_equal_work``: constrained vs unconstrained, plain and speculative (oracle drafter),
   batch 1 and 32, the same tokens per request on both sides (``bench/gpu_spec.py``, reusing
   ``bench/spec.py``'s machinery), on the default path (flashinfer + decode and tree-verify
   CUDA graphs); host profile of the constrained runs at ``--profile-batch``. The engines are
   ``EngineCore``s, what ``espalier serve``'s engine process steps (its server process
   detokenizes and post-validates); ``--in-process-text`` runs ``Engine`` (``--local``).
   ``--lead-spec`` also runs ``bench/spec.py``'s GPU part as it is.

The last line is a summary. Usage (on the GPU machine)::

    python3 bench/gpu.py --tokenizer .data/gpu/gemma_tok [--batches 1,8,64] [--steps 64]
        [--decode-reps 5] [--skip-profile] [--paths a,b]
        [--spec-batches 1,32] [--spec-max-tokens 96] [--mask-threads 8] [--skip-spec]
        [--tight-budget] [--grammar-after-launch [N]] [--forced] [--unconstrained-lengths F]
        [--in-process-text]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from cuda_timing import copy_bandwidth  # bench/cuda_timing.py (this folder is on sys.path)

PROMPT_LEN = 128
PATHS = {  # name -> (attention backend, decode CUDA-graph batch sizes)
    "sdpa_eager": ("sdpa", ()),
    "flashinfer_eager": ("flashinfer", ()),
    "flashinfer_graphs": ("flashinfer", (1, 2, 4, 8, 16, 32, 64)),
    # the anchor of the fused residual add: graphs captured with add and norm kernels separate
    "flashinfer_graphs_unfused_add": ("flashinfer", (1, 8, 64)),
    # the anchor of the skinny GEMM: graphs captured (and LM heads run) with cuBLAS only
    "flashinfer_graphs_cublas": ("flashinfer", (1, 8, 64)),
    # the decode kernel (tensor cores) at every batch size
    "flashinfer_graphs_decode_tc": ("flashinfer", (1, 8, 64)),
    # the anchor of the fused rope + K/V write: rope kernel, then two index_copy launches
    "flashinfer_graphs_unfused_rope": ("flashinfer", (1, 8, 64)),
    # the anchor of the small-query attention kernel: decode steps on flashinfer's prefill kernel
    "flashinfer_graphs_prefill_attention": ("flashinfer", (1, 8, 64)),
    # the anchor of programmatic dependent launch: every kernel in plain stream order
    "flashinfer_graphs_no_pdl": ("flashinfer", (1, 2, 4, 8, 16, 32, 64)),
    # PDL, but the batch-1 gate/up projection on cuBLAS (outside the chain of early launches)
    "flashinfer_graphs_pdl_cublas_gate_up": ("flashinfer", (1, 8, 64)),
    "flashinfer_graphs_pdl_every_batch": ("flashinfer", (1, 2, 4, 8, 16, 32, 64)),
}


def path_options(name: str) -> Any:
    """The ``ModelOptions`` a path's runner is built with (the defaults but for its anchor)."""
    from espalier.engine.config import ModelOptions
    from espalier.kernels.options import KernelOptions

    no_small_query = {"small_query_up_to": 0}
    changes: dict[str, dict[str, Any]] = {
        "flashinfer_graphs_unfused_add": {"fuse_residual_add": False},
        "flashinfer_graphs_cublas": {"skinny_gemv": False},
        "flashinfer_graphs_decode_tc": {"decode_kernel_up_to": 1 << 30, **no_small_query},
        "flashinfer_graphs_unfused_rope": {"fuse_rope_store": False},
        "flashinfer_graphs_prefill_attention": no_small_query,
        "flashinfer_graphs_no_pdl": {"kernels": KernelOptions(pdl=False)},
        "flashinfer_graphs_pdl_cublas_gate_up": {
            "kernels": KernelOptions(gate_up_m1_under_pdl=False)
        },
        "flashinfer_graphs_pdl_every_batch": {"kernels": KernelOptions(pdl_max_rows=1 << 30)},
    }
    return ModelOptions(**changes.get(name, {}))


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def weight_bytes(runner: Any) -> int:
    """Bytes one decode step streams: every parameter except an untied embedding table."""
    model = runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not runner.model_config.tie_word_embeddings:
        embed = model.model.embed_tokens.weight
        total -= embed.numel() * embed.element_size()
    return int(total)


def decode_rate(
    runner: Any, batch: int, steps: int, seed: int = 0, prompt_len: int = PROMPT_LEN
) -> dict[str, float]:
    """Greedy decode tokens/s at ``batch`` after a 128-token prefill (one sync per step)."""
    from espalier.engine.kv_cache import blocks_needed
    from espalier.engine.model.runner import SeqInput

    per_seq = blocks_needed(prompt_len + steps + 8, runner.block_size)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 200_000, (prompt_len,), generator=gen).tolist() for _ in tables]
    out = runner.forward([SeqInput(t, p, 0) for t, p in zip(tables, prompts)])
    tokens = out.logits.argmax(-1).tolist()
    ctx = prompt_len
    launch_s: list[float] = []
    start = prepare_s = 0.0
    graphs = runner.graphs
    for step in range(steps + 4):
        if step == 4:  # warm-up done (lazy init, JIT, allocator)
            torch.cuda.synchronize()
            start = time.perf_counter()
            prepare_s = graphs.prepare_s if graphs is not None else 0.0
        t0 = time.perf_counter()
        out = runner.forward([SeqInput(t, [tok], ctx) for t, tok in zip(tables, tokens)])
        launch_s.append(time.perf_counter() - t0)
        # host sync: the next tokens go back to python, once per step (as the engine)
        tokens = out.logits.argmax(-1).tolist()
        ctx += 1
    seconds = time.perf_counter() - start
    replay_ms = graph_replay_ms(runner, batch)
    if graphs is not None:
        prepare_s = graphs.prepare_s - prepare_s
    return {
        "tok_per_s": batch * steps / seconds,
        "step_ms": 1e3 * seconds / steps,
        "host_launch_ms": 1e3 * statistics.median(launch_s[4:]),
        # host time the graph runner spends planning and copying inputs before each replay
        # (part of the GPU's idle time after the previous step's sync; 0 when eager)
        "pre_replay_ms": 1e3 * prepare_s / steps,
        "graph_replay_ms": replay_ms,
    }


def graph_replay_ms(runner: Any, batch: int, replays: int = 20) -> float:
    """GPU ms of one replay of the decode graph that served ``batch`` (as last planned), from
    ``replays`` back-to-back replays between CUDA events; 0 when no graph fits (eager)."""
    graphs = runner.graphs
    if graphs is None:
        return 0.0
    bucket = next((b for b, n in graphs.captured if n == 1 and b >= batch), None)
    if bucket is None:
        return 0.0
    graph = graphs.graphs[(bucket, 1)].graph
    graph.replay()  # the same step again: it rewrites its own K/V slots
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / replays


def profile_decode(runner: Any, steps: int = 6, top: int = 12) -> list[dict[str, Any]]:
    """Top ops by self CUDA time over ``steps`` batch-1 decode steps."""
    from torch.profiler import ProfilerActivity, profile

    decode_rate(runner, 1, 4)  # warm
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode_rate(runner, 1, steps, seed=1)
    rows = []
    for evt in prof.key_averages():
        cuda_us = getattr(evt, "self_device_time_total", None)
        if cuda_us is None:
            cuda_us = getattr(evt, "self_cuda_time_total", 0.0)
        rows.append({"op": evt.key[:80], "self_cuda_ms": cuda_us / 1e3, "calls": evt.count})
    rows.sort(key=lambda r: -r["self_cuda_ms"])
    return rows[:top]


def build_runners(
    tokenizer_vocab: int,
    batches: Sequence[int],
    steps: int,
    paths: Sequence[str] = tuple(PATHS),
    prompt_len: int = PROMPT_LEN,
) -> dict[str, Any]:
    from spec import _random_state  # bench/spec.py (this script's folder is on sys.path)

    from espalier.engine.config import CacheConfig, RunnerConfig
    from espalier.engine.kv_cache import blocks_needed
    from espalier.engine.model.runner import ModelRunner

    config = llama_8b_config(tokenizer_vocab)
    state = _random_state(config, "cuda")
    blocks = max(batches) * blocks_needed(prompt_len + steps + 8, 16)
    runners = {}
    for name, (backend, graphs) in PATHS.items():
        if name not in paths:
            continue
        try:
            runners[name] = ModelRunner(
                config,
                state,
                RunnerConfig(
                    device="cuda",
                    attention_backend=backend,
                    cache=CacheConfig(block_size=16, num_blocks=blocks),
                    cuda_graph_batch_sizes=graphs,
                    options=path_options(name),
                ),
            )
        except Exception as exc:  # keep the other paths measurable
            emit({"part": "decode", "path": name, "error": repr(exc)[:400]})
    return runners


def decode_part(
    runners: dict[str, Any],
    bandwidth: float,
    batches: Sequence[int],
    steps: int,
    prompt_len: int = PROMPT_LEN,
    reps: int = 1,
    skip_profile: bool = False,
) -> dict[str, Any]:
    """Each path's decode rate at each batch, ``reps`` times: the paths in turn, in reverse
    order on odd reps (ABBA, so drift in clocks or temperature does not favour one path). Each
    record holds the median over the reps (``of_roofline``, ``step_ms``, ...) and every rep's
    ``of_roofline_reps``. Then a batch-1 profile per path (unless ``skip_profile``)."""
    summary: dict[str, Any] = {}
    rates: dict[tuple[str, int], list[dict[str, float]]] = {}
    names = list(runners)
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            for batch in batches:
                if (name, batch) in rates and not rates[(name, batch)]:
                    continue  # failed before
                try:
                    rate = decode_rate(runners[name], batch, steps, prompt_len=prompt_len)
                except Exception as exc:
                    emit({"part": "decode", "path": name, "batch": batch, "error": repr(exc)[:400]})
                    rates[(name, batch)] = []
                    continue
                rates.setdefault((name, batch), []).append(rate)
    for name in names:
        runner = runners[name]
        wbytes = weight_bytes(runner)
        graphs = runner.graphs
        for batch in batches:
            measured = rates.get((name, batch), [])
            if not measured:
                continue
            roofline = batch * bandwidth / wbytes
            rate = {k: statistics.median(r[k] for r in measured) for k in measured[0]}
            record = {
                "part": "decode",
                "path": name,
                "attention": runner.attention.name,
                "graphs": graphs.captured if graphs is not None else [],
                "batch": batch,
                **{k: round(v, 3) for k, v in rate.items()},
                "roofline_tok_per_s": round(roofline, 1),
                "of_roofline": round(rate["tok_per_s"] / roofline, 3),
                "of_roofline_reps": [round(r["tok_per_s"] / roofline, 3) for r in measured],
                "weight_gb": round(wbytes / 1e9, 3),
            }
            emit(record)
            summary[f"{name}_b{batch}_of_roofline"] = record["of_roofline"]
            summary[f"{name}_b{batch}_tok_per_s"] = round(rate["tok_per_s"], 1)
        if graphs is not None and graphs.failures:
            failures = {f"{b}x{n}": reason for (b, n), reason in graphs.failures.items()}
            emit({"part": "decode", "path": name, "graph_failures": failures})
    if skip_profile:
        return summary
    for name, runner in runners.items():
        try:
            top_ops = profile_decode(runner)
            emit({"part": "profile", "path": name, "batch": 1, "top_ops": top_ops})
        except Exception as exc:
            emit({"part": "profile", "path": name, "error": repr(exc)[:400]})
    return summary


def spec_part(tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Constrained vs unconstrained, plain and oracle-speculative, equal work
    (``bench/gpu_spec.py``) on the default path (flashinfer, decode + tree-verify graphs)."""
    import gpu_spec
    from gpu_spec import equal_work
    from spec import _random_state

    gpu_spec.DUMP_STREAMS = args.dump_streams

    from espalier.engine.config import CacheConfig, RunnerConfig
    from espalier.engine.model.runner import ModelRunner

    config = llama_8b_config(tokenizer.vocab_size)
    runner = ModelRunner(
        config,
        _random_state(config, "cuda"),
        RunnerConfig(device="cuda", cache=CacheConfig(block_size=16, num_blocks=8192)),
    )
    emit(
        {
            "part": "spec_equal_work",
            "attention": runner.attention.name,
            "graphs": runner.graphs.captured if runner.graphs is not None else [],
        }
    )
    from espalier.constrained.backends import get_backend

    walk = get_backend("llguidance", tokenizer).tree_walk()  # type: ignore[attr-defined]
    emit({"part": "spec_equal_work", "llguidance_walk": walk})
    batches = [int(b) for b in args.spec_batches.split(",")]
    out: dict[str, float] = {}
    values: dict[str, bool | None] = {"default": None, "on": True, "off": False}
    names = [name.strip() for name in args.close_ahead.split(",") if name.strip()]
    threads = [int(t) for t in str(args.mask_threads).split(",") if t.strip()]
    if len(names) == 1:
        names = names * len(threads)
    if len(threads) == 1:
        threads = threads * len(names)
    if len(names) != len(threads):
        raise SystemExit("--close-ahead and --mask-threads: one value, or as many as each other")
    pools = _per_pass(args.torch_threads, len(names), "--torch-threads")
    switches = _per_pass(args.switch_interval, len(names), "--switch-interval")
    aheads = [values[name] for name in names]
    passes = zip(names, aheads, threads, pools, switches)
    default_pool = torch.get_num_threads()
    default_switch = sys.getswitchinterval()
    lengths_file = args.unconstrained_lengths
    anchor_lengths = gpu_spec.read_anchor_lengths(lengths_file) if lengths_file else None
    for i, (name, ahead, mask_threads, pool, switch) in enumerate(passes):
        # torch's CPU thread pool of the engine process (the closing workers are processes)
        torch.set_num_threads(default_pool if pool == "default" else int(pool))
        # how long a thread holds the GIL before one waiting for it may take it
        sys.setswitchinterval(default_switch if switch == "default" else float(switch) / 1e3)
        ratios = equal_work(
            runner,
            tokenizer,
            batches,
            args.spec_max_tokens,
            args.schemas,
            mask_threads,
            emit,
            profile_batch=args.profile_batch,
            closing=not args.no_closing,
            launch_first=False if args.masks_first else None,
            close_ahead=ahead,
            reps=args.spec_reps,
            tight_budget=args.tight_budget,
            matcher_spares=args.matcher_spares,
            backend=args.backend,
            grammar_after_launch=args.grammar_after_launch,
            forced=args.forced,
            anchor_lengths=anchor_lengths,
            text=args.in_process_text,
        )
        prefix = (
            ""
            if len(aheads) == 1
            else f"run{i}_ahead_{name}_t{mask_threads}_"
            + ("" if pool == "default" else f"torch_threads_{pool}_")
            + ("" if switch == "default" else f"switch_{switch}ms_")
        )
        out.update({f"{prefix}{k}": v for k, v in ratios.items()})
    if runner.graphs is not None:
        emit({"part": "spec_equal_work", "graph_replays": runner.graphs.replays})
    return out


def _per_pass(values: str, passes: int, flag: str) -> list[str]:
    """A comma-separated flag's value per equal-work pass: one value for all, or one each."""
    listed = [value.strip() for value in values.split(",") if value.strip()]
    if len(listed) == 1:
        listed = listed * passes
    if len(listed) != passes:
        raise SystemExit(f"{flag}: one value, or as many as --close-ahead")
    return listed


def llama_8b_config(vocab_size: int) -> Any:
    """Llama-3-8B dimensions with the tokenizer's vocabulary."""
    from espalier.engine.config import ModelConfig

    return ModelConfig(
        model_type="llama",
        vocab_size=vocab_size,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
    )


def main(argv: Sequence[str] | None = None) -> int:
    from spec import BACKEND

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=None, help="converted tokenizer folder")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument(
        "--prompt-len", type=int, default=PROMPT_LEN, help="decode part: prompt tokens per sequence"
    )
    parser.add_argument("--spec-batches", default="1,32")
    parser.add_argument("--spec-max-tokens", type=int, default=96)
    parser.add_argument("--schemas", type=int, default=6)
    parser.add_argument("--skip-spec", action="store_true")
    parser.add_argument(
        "--close-ahead",
        default="default",
        help="SpecConfig.close_ahead per equal-work pass, comma-separated from default (the "
        "engine's: on), on, off: e.g. default,off,on,on,off (a warm-up pass, then an ABBA A/B: "
        "the first pass in a process meets cold grammar caches)",
    )
    parser.add_argument(
        "--torch-threads",
        default="default",
        help="torch.set_num_threads of the engine process per equal-work pass (default: torch's, "
        "one per core), one value or as many as --close-ahead: e.g. --close-ahead "
        "default,default --torch-threads default,4",
    )
    parser.add_argument(
        "--switch-interval",
        default="default",
        help="sys.setswitchinterval in ms per equal-work pass (default: Python's, 5 ms), one "
        "value or as many as --close-ahead: e.g. --close-ahead default,default "
        "--switch-interval default,0.5",
    )
    parser.add_argument(
        "--dump-streams",
        default=None,
        help="append each batch's constrained outputs (schema, tokens, max_tokens) to this "
        "JSON-lines file, for bench/postvalidate.py --streams",
    )
    parser.add_argument(
        "--mask-threads",
        default="8",
        help="tree-mask threads; a list (2,8,8,2) runs one pass each (zipped with --close-ahead)",
    )
    parser.add_argument(
        "--matcher-spares",
        type=int,
        default=16,
        help="the grammar service's spare matchers per grammar (espalier serve's "
        "--matcher-spares; 0: every request's matcher made when it arrives)",
    )
    parser.add_argument(
        "--backend",
        default=BACKEND,
        help="the constrained requests' grammar backend (ConstraintOptions.backend)",
    )
    parser.add_argument("--profile-batch", type=int, default=32, help="cProfile this batch")
    parser.add_argument(
        "--spec-reps",
        type=int,
        default=5,
        help="speculative constrained/unconstrained pairs per batch size (ABBA; median ratio)",
    )
    parser.add_argument(
        "--no-closing", action="store_true", help="EngineConfig(close_within_budget=False)"
    )
    parser.add_argument(
        "--tight-budget",
        action="store_true",
        help="constrained speculative requests get max_tokens = their plain output length (the "
        "old setting: closing checks on every request's last tokens), not --spec-max-tokens",
    )
    parser.add_argument(
        "--masks-first",
        action="store_true",
        help="start the tree-mask fills before launching the verify forward (the old order)",
    )
    import gpu_spec

    gpu_spec.add_after_launch_flag(parser)
    gpu_spec.add_forced_flag(parser)
    gpu_spec.add_text_flag(parser)
    parser.add_argument(
        "--unconstrained-lengths",
        default=None,
        metavar="STREAMS",
        help="unconstrained requests take the lengths of this --dump-streams file (another "
        "tree's constrained outputs: bench/inputs/h200_b32_streams.jsonl is b2525ec's at b32), "
        "so unconstrained tok/s compare with that tree's in equal work",
    )
    parser.add_argument("--lead-spec", action="store_true", help="also bench/spec.py's GPU part")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument(
        "--decode-reps", type=int, default=1, help="ABBA repetitions of the decode paths"
    )
    parser.add_argument("--skip-profile", action="store_true", help="no batch-1 decode profile")
    parser.add_argument("--paths", default=",".join(PATHS), help="decode paths to measure")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        emit({"skipped": "CUDA not available"})
        return 0
    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.server.default_model import default_tokenizer

    tokenizer = (
        TokenizerInfo.from_pretrained(args.tokenizer) if args.tokenizer else default_tokenizer()
    )
    bandwidth = copy_bandwidth()
    emit(
        {
            "part": "bandwidth",
            "copy_tb_per_s": round(bandwidth / 1e12, 3),
            "device": torch.cuda.get_device_name(),
        }
    )
    summary: dict[str, Any] = {"part": "summary", "copy_tb_per_s": round(bandwidth / 1e12, 3)}
    batches = [int(b) for b in args.batches.split(",")]
    if not args.skip_decode:
        paths = [p for p in args.paths.split(",") if p]
        runners = build_runners(tokenizer.vocab_size, batches, args.steps, paths, args.prompt_len)
        summary.update(
            decode_part(
                runners,
                bandwidth,
                batches,
                args.steps,
                args.prompt_len,
                reps=args.decode_reps,
                skip_profile=args.skip_profile,
            )
        )
        del runners
        gc.collect()
        torch.cuda.empty_cache()
    if not args.skip_spec:
        summary.update(spec_part(tokenizer, args))
    if args.lead_spec:
        import spec

        spec.gpu_part(
            [int(b) for b in args.spec_batches.split(",")],
            args.spec_max_tokens,
            args.schemas,
            tokenizer_dir=args.tokenizer,
        )
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
