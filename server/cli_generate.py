"""``espalier generate``: in-process with ``--local`` (the engine), else a client of a server.

The flags are shared with the remote client (``cli_remote.add_generation_arguments``);
:func:`run_local` is the whole local path and :func:`local_request` turns the flags into a
``GenerationRequest``, so other subcommands can reuse them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from espalier.server.cli_remote import (
    add_generation_arguments,
    add_remote_arguments,
    load_schema_file,
    run_remote,
)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "generate", help="generate one completion (in-process with --local, else via a server)"
    )
    add_generation_arguments(p)
    add_remote_arguments(p)
    local = p.add_argument_group("local engine (--local)")
    local.add_argument("--local", action="store_true", help="run the engine in this process")
    local.add_argument("--model", default="default", help="HF directory, .gguf file or 'default'")
    local.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    local.add_argument(
        "--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16")
    )
    local.add_argument("--logprobs", type=int, default=0, help="top-n logprobs per token")
    local.add_argument(
        "--speculative",
        default="off",
        help="off, or drafters joined by commas: ngram, draft, eagle, forced (e.g. ngram,forced)",
    )
    local.add_argument("--num-draft-tokens", type=int, default=8, help="draft tree nodes")
    local.add_argument("--draft-model", default=None, help="draft model (same tokenizer) PATH")
    local.add_argument("--eagle", default=None, help="EAGLE / EAGLE-3 head checkpoint DIR")
    local.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="shard the model over N ranks that this command starts (cuda: one GPU each)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_local(args) if args.local else run_remote(args)


def local_request(args: argparse.Namespace, prompt: str) -> Any:
    """The ``GenerationRequest`` the flags describe (raises the grammar layer's errors)."""
    from espalier.constrained.spec import GrammarSpec
    from espalier.engine.api import ConstraintOptions, GenerationRequest, SamplingParams

    grammar = None
    if args.schema:
        grammar = GrammarSpec.json_schema(load_schema_file(args.schema))
    elif args.regex:
        grammar = GrammarSpec.regex(args.regex)
    elif args.grammar:
        text = Path(args.grammar).read_text()
        lark = args.grammar.endswith(".lark")
        grammar = GrammarSpec.lark(text) if lark else GrammarSpec.ebnf(text)
    elif args.choice:
        grammar = GrammarSpec.choice(list(args.choice))
    elif args.any_json:
        grammar = GrammarSpec.any_json()
    sampling = SamplingParams(
        temperature=args.temperature or 0.0,
        top_k=args.top_k or 0,
        top_p=args.top_p if args.top_p is not None else 1.0,
        seed=args.seed,
        max_tokens=args.max_tokens or 256,
        stop=tuple(args.stop or ()),
        logprobs=getattr(args, "logprobs", 0),
    )
    return GenerationRequest(
        "local-0",
        prompt=prompt,
        sampling=sampling,
        grammar=grammar,
        constraint=ConstraintOptions(backend=args.backend, allow_weakening=args.allow_weakening),
    )


def run_local(args: argparse.Namespace) -> int:
    """Load the model, generate once, print the text (``--json``: text plus stats)."""
    from espalier.constrained.errors import GrammarError
    from espalier.engine.api import InvalidRequestError
    from espalier.engine.config import RunnerConfig
    from espalier.engine.engine import Engine, EngineConfig
    from espalier.server.default_model import resolve_model

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        request = local_request(args, prompt)
    except (GrammarError, OSError, ValueError) as exc:
        print(f"espalier generate: {exc}", file=sys.stderr)
        return 2
    problem = _device_problem(args.device)
    if problem is not None:
        print(f"espalier generate: --device {args.device}: {problem}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    # one-shot use: the first compile also builds the backend's view of the vocabulary
    config = EngineConfig(compile_timeout_s=600.0)
    runner_config = RunnerConfig(args.device, args.dtype)
    runner = None
    try:
        path = resolve_model(args.model)
        runner = tensor_parallel_runner(path, runner_config, args.tensor_parallel)
        engine = Engine.from_model(path, config, runner_config=runner_config, runner=runner)
    except (OSError, ValueError, RuntimeError) as exc:  # no such model, or one we cannot run
        if runner is not None:
            runner.close()
        print(f"espalier generate: {exc}", file=sys.stderr)
        return 2
    try:
        _enable_speculation(engine, args)
    except (OSError, ValueError) as exc:
        _close(engine)
        print(f"espalier generate: {exc}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t0
    try:
        engine.add_request(request)
    except InvalidRequestError as exc:
        print(f"espalier generate: {exc}", file=sys.stderr)
        return 2
    chunks = []
    try:
        while engine.has_unfinished():
            for out in engine.step():
                chunks.append(out)
                if args.stream and not args.json:
                    print(out.text_delta, end="", flush=True)
    finally:
        _close(engine)
    last = chunks[-1]
    text = "".join(c.text_delta for c in chunks)
    if args.json:
        print(json.dumps(_summary(text, chunks, last, load_s), ensure_ascii=False))
    elif args.stream:
        print()
    else:
        print(text)
    if last.error:
        print(f"espalier generate: {last.error}", file=sys.stderr)
        return 1
    return 0


def tensor_parallel_runner(path: Any, runner_config: Any, ranks: int) -> Any:
    """Rank 0's runner of ``ranks`` ranks over the model at ``path`` (the others spawned now),
    or None for one rank: the engine loads the model itself."""
    import functools

    from espalier.engine.model.parallel import ParallelConfig
    from espalier.engine.model.parallel.launch import start_tensor_parallel
    from espalier.engine.model.weights import load_weights

    if ranks == 1:
        return None
    parallel = ParallelConfig(world_size=ranks)  # ValueError below 1
    loader = functools.partial(load_weights, path)
    return start_tensor_parallel(loader, runner_config, parallel)


def _close(engine: Any) -> None:
    engine.close()
    engine.runner.close()  # the engine's owner owns its runner (a TP runner's other ranks)


def _speculative(stats: Any) -> dict[str, Any] | None:
    if stats is None:
        return None
    return {**dataclasses.asdict(stats), "mean_accept_length": stats.mean_accept_length}


def _enable_speculation(engine: Any, args: argparse.Namespace) -> None:
    """``--speculative``: switch the engine to speculative decoding with those drafters."""
    from espalier.engine.spec.setup import enable_speculation, parse_methods

    methods = parse_methods(getattr(args, "speculative", "off") or "off")
    enable_speculation(
        engine,
        methods,
        num_draft_tokens=args.num_draft_tokens,
        draft_model=args.draft_model,
        eagle=args.eagle,
    )


def _device_problem(device: str) -> str | None:
    """Why ``device`` cannot run the model (unknown, or CUDA absent); None when it can."""
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError:
        return "not a device (cpu, cuda, cuda:N)"
    if kind == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available"
    if kind not in ("cpu", "cuda"):
        return "only cpu and cuda are supported"
    return None


def _summary(text: str, chunks: list[Any], last: Any, load_s: float) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "text": text,
        "token_ids": [t for c in chunks for t in c.token_ids],
        "finish_reason": last.finish_reason.value if last.finish_reason else None,
        "usage": dataclasses.asdict(last.usage) if last.usage else None,
        "timings": dataclasses.asdict(last.timings) if last.timings else None,
        "backend": last.backend,
        "weakened": [issue.describe() for issue in last.weakened],
        "validation": dataclasses.asdict(last.validation) if last.validation else None,
        "error": last.error,
        "load_s": load_s,
        "speculative": _speculative(last.speculative),
    }
    if last.timings and last.usage and last.timings.decode_s > 0:
        summary["decode_tokens_per_s"] = last.usage.completion_tokens / last.timings.decode_s
    logprobs = [dataclasses.asdict(lp) for c in chunks for lp in c.logprobs]
    if logprobs:
        summary["logprobs"] = logprobs
    return summary
