"""``espalier serve``: the gRPC server on a model, the engine stepping in a child process of its
own (``server/engine_process.py``). The only place that reads serving flags/env."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import traceback
from typing import TYPE_CHECKING, Any

from espalier.server.config import MIB, ServerConfig

if TYPE_CHECKING:
    from espalier.server.loading import ModelOptions

AUTH_TOKEN_ENV = "ESPALIER_AUTH_TOKEN"


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the gRPC server", description=__doc__)
    p.add_argument("--model", default="default", help="default (Gemma 3 270M) | PATH | tiny-random")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the model's)")
    p.add_argument("--draft-model", default=None, help="draft model PATH for speculation")
    p.add_argument(
        "--speculative", default=None, help="drafters to load: ngram,draft,forced (comma list)"
    )
    p.add_argument(
        "--speculate-by-default",
        choices=("on", "off"),
        default="on",
        help="with --speculative: whether requests that do not say speculate",
    )
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: best available)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests per batch")
    p.add_argument("--kv-blocks", type=int, default=0, help="KV cache blocks (0 = from memory)")
    p.add_argument(
        "--no-prefix-cache", action="store_true", help="recompute every prompt (no KV sharing)"
    )
    p.add_argument("--grammar-cache-dir", default=None, help="keep compiled xgrammar grammars here")
    p.add_argument(
        "--grammar-cache-max-mb",
        type=float,
        default=512.0,
        help="bound of the compiled-grammar cache in memory (each process), and on disk",
    )
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="shard the model over N ranks that the server starts (cuda: one GPU each)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="0 = any free port (announced)")
    p.add_argument(
        "--smg-port",
        type=int,
        default=None,
        help="also serve SMG's vLLM worker protocol on this port (0 = any free port; "
        "unauthenticated: keep it on loopback)",
    )
    p.add_argument("--smg-host", default="127.0.0.1", help="bind address of --smg-port")
    p.add_argument(
        "--reasoning-end",
        default="",
        help="the model's reasoning end marker (e.g. '</think>'): constraints of requests with "
        "after_reasoning (and SMG requests on a reasoning model) start after it",
    )
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (0 = free)")
    p.add_argument(
        "--auth-token", default=None, help=f"require this bearer token (or ${AUTH_TOKEN_ENV})"
    )
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain")
    p.add_argument("--tls-key", default=None, help="PEM private key")
    p.add_argument("--max-concurrent", type=int, default=256)
    p.add_argument("--max-queue", type=int, default=1024)
    p.add_argument("--max-message-mb", type=float, default=16.0)
    p.add_argument("--max-prompt-tokens", type=int, default=8192)
    p.add_argument("--max-grammar-bytes", type=int, default=MIB)
    p.add_argument("--max-prompt-bytes", type=int, default=MIB, help="text prompt, Tokenize text")
    p.add_argument("--max-stop-bytes", type=int, default=1024, help="each stop string")
    p.add_argument("--max-choices", type=int, default=1024, help="options of a choice")
    p.add_argument(
        "--max-grammar-alternatives", type=int, default=1024, help="'|' in a Lark/GBNF grammar"
    )
    p.add_argument("--max-schema-depth", type=int, default=128, help="JSON nesting of a schema")
    p.add_argument("--admission-threads", type=int, default=4, help="request parsing threads")
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--max-max-tokens", type=int, default=8192)
    p.add_argument("--compile-timeout", type=float, default=30.0, help="seconds")
    p.add_argument(
        "--compile-slots",
        type=int,
        default=2,
        help="compiles of one grammar backend that run at once (xgrammar and outlines-core "
        "child processes, llguidance threads); more wait, each within its own time limit",
    )
    p.add_argument(
        "--matcher-spares",
        type=int,
        default=16,
        help="new grammar matchers kept ready per repeated grammar (the most; each grammar keeps "
        "as many as its bursts need), so its requests do not wait for one; 0: none",
    )
    p.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds")
    p.add_argument(
        "--engine-restarts",
        type=int,
        default=3,
        help="deaths of the engine process replaced within ten minutes; one more exits 1",
    )
    p.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=300.0,
        help="seconds of silence after which the engine process is hung: killed and replaced "
        "(0: never)",
    )
    p.add_argument("--no-reflection", action="store_true")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        max_concurrent_requests=args.max_concurrent,
        max_queue=args.max_queue,
        max_message_bytes=int(args.max_message_mb * MIB),
        max_prompt_tokens=args.max_prompt_tokens,
        max_grammar_bytes=args.max_grammar_bytes,
        max_prompt_bytes=args.max_prompt_bytes,
        max_stop_bytes=args.max_stop_bytes,
        max_choices=args.max_choices,
        max_grammar_alternatives=args.max_grammar_alternatives,
        max_schema_depth=args.max_schema_depth,
        admission_threads=args.admission_threads,
        default_max_tokens=args.default_max_tokens,
        max_max_tokens=args.max_max_tokens,
        compile_timeout_s=args.compile_timeout,
        shutdown_grace_s=args.shutdown_grace,
        engine_restarts=args.engine_restarts,
        engine_stall_timeout_s=args.engine_stall_timeout,
        # given but empty (an unset variable in a script) is refused by validate, not dropped
        auth_token=(
            args.auth_token if args.auth_token is not None else os.environ.get(AUTH_TOKEN_ENV)
        ),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        reflection=not args.no_reflection,
        smg_host=args.smg_host,
        smg_port=args.smg_port,
        reasoning_end=args.reasoning_end,
    )


def model_options_from_args(args: argparse.Namespace, config: ServerConfig) -> ModelOptions:
    """What the model loader needs, from the flags (and the limits already in ``config``)."""
    from espalier.server.loading import ModelOptions

    return ModelOptions(
        model=args.model,
        tokenizer=args.tokenizer,
        draft_model=args.draft_model,
        speculative=tuple(m for m in (args.speculative or "").split(",") if m),
        num_draft_tokens=args.num_draft_tokens,
        speculate_by_default=args.speculate_by_default == "on",
        device=args.device,
        dtype=args.dtype,
        compile_timeout_s=config.compile_timeout_s,
        max_queue=config.max_queue,
        max_num_seqs=args.max_num_seqs,
        kv_blocks=args.kv_blocks,
        prefix_caching=not args.no_prefix_cache,
        grammar_cache_dir=args.grammar_cache_dir,
        grammar_cache_max_bytes=int(args.grammar_cache_max_mb * MIB),
        compile_slots=args.compile_slots,
        matcher_spares=args.matcher_spares,
        tensor_parallel=args.tensor_parallel,
    )


def run(args: argparse.Namespace) -> int:
    from espalier.server.cpu_runtime import apply_runtime_env

    apply_runtime_env(os.environ)  # before torch loads (``server/cpu_runtime.py``)
    from espalier.server.app import serve
    from espalier.server.startup import make_loader
    from espalier.server.state import ServingState

    config = config_from_args(args)
    problems = config.validate()
    if args.compile_slots < 1:
        problems.append("--compile-slots must be at least 1")
    if args.matcher_spares < 0:
        problems.append("--matcher-spares must be at least 0")
    if args.tensor_parallel < 1:
        problems.append("--tensor-parallel must be at least 1")
    if problems:
        raise SystemExit("espalier serve: " + "; ".join(problems))
    options = model_options_from_args(args, config)

    async def main() -> bool:
        state = ServingState(config)
        await serve(config, state, make_loader(options))
        return state.failed.is_set()

    try:
        failed = asyncio.run(main())
    except BaseException:  # a bug: still leave through os._exit (the engine process sees EOF)
        traceback.print_exc()
        failed = True
    # Drained: every accepted request has finished and "stopped" is announced. Leave without
    # the interpreter's teardown: threads that may still be inside native code (a compile
    # abandoned at its deadline, a background build) would otherwise run while native
    # libraries destroy their thread pools, which aborts the process (exit status 134), and
    # multiprocessing would join the engine process, which waits for this end to close.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)
