"""Load the tokenizer, the grammar service and the engine for ``espalier serve``.

The tokenizer comes first (Tokenize and CompileGrammar work while the model loads); the engine
last, after a warm-up generation, when health turns SERVING.

``--model`` takes ``default`` (the embedded Gemma 3 270M GGUF), a ``.gguf`` file, an HF directory,
or ``tiny-random`` (a 2-layer random-weight llama over the default Gemma tokenizer: for tests and
load benchmarks, where the model's quality does not matter but the tokenizer's size does).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from espalier.server.default_model import DEFAULT_MODEL, default_tokenizer, resolve_model
from espalier.server.state import Compiler, ModelFacts

if TYPE_CHECKING:
    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.engine.constraints import GrammarService
    from espalier.engine.engine import EngineCore

TINY_RANDOM = "tiny-random"


@dataclass(frozen=True)
class ModelOptions:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    draft_model: str | None = None
    speculative: tuple[str, ...] = ()
    num_draft_tokens: int | None = None
    device: str | None = None
    dtype: str | None = None
    speculate_by_default: bool = True
    compile_timeout_s: float = 30.0
    max_queue: int = 1024
    max_num_seqs: int = 64
    kv_blocks: int = 0  # 0 = sized from memory
    prefix_caching: bool = True
    grammar_cache_dir: str | None = None  # on-disk xgrammar compile cache (None: none)
    grammar_cache_max_bytes: int = 512 << 20  # each of the in-memory and on-disk caches
    compile_slots: int = 2  # compiles of one grammar backend at once (BackendOptions)
    matcher_spares: int = 16  # GrammarService(spares_per_grammar=)
    seed: int = 0  # weights of tiny-random
    tensor_parallel: int = 1  # ranks the model is sharded over (engine/model/parallel/)


def load_tokenizer(options: ModelOptions) -> TokenizerInfo:
    from espalier.constrained.tokenizer import TokenizerInfo

    if options.tokenizer is not None:
        return TokenizerInfo.from_pretrained(options.tokenizer)
    if options.model in (DEFAULT_MODEL, TINY_RANDOM):
        return default_tokenizer()
    if options.model.endswith(".gguf"):
        return TokenizerInfo.from_gguf(options.model)
    return TokenizerInfo.from_pretrained(options.model)


def grammar_service(options: ModelOptions, tokenizer: TokenizerInfo) -> GrammarService:
    """The grammar service for ``tokenizer``, with the on-disk compile cache if configured."""
    from espalier.constrained.backends import BackendOptions
    from espalier.constrained.disk_cache import DiskCacheConfig, GrammarDiskCache
    from espalier.engine.constraints import GrammarService

    backend_options = BackendOptions(compile_slots=options.compile_slots)
    disk = None
    if options.grammar_cache_dir is not None:
        config = DiskCacheConfig(options.grammar_cache_dir, options.grammar_cache_max_bytes)
        disk = GrammarDiskCache(config, tokenizer, backend_options)
    return GrammarService(
        tokenizer,
        compile_timeout_s=options.compile_timeout_s,
        disk_cache=disk,
        backend_options=backend_options,
        spares_per_grammar=options.matcher_spares,
        cache_max_bytes=options.grammar_cache_max_bytes,
    )


def wait_unless_left(
    future: Future[Any], limit_s: float, margin_s: float, left: threading.Event
) -> Any:
    """``future``'s result within ``limit_s + margin_s`` (else CompileTimeoutError naming
    ``limit_s``: the compile's own limit, which ends it first), looking at ``left`` every 50 ms:
    once it is set the future is cancelled and CancelledError raised."""
    from espalier.constrained.errors import CompileTimeoutError

    deadline = time.monotonic() + limit_s + margin_s
    while True:
        try:
            return future.result(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
        except FutureTimeout:
            if left.is_set():
                future.cancel()
                raise CancelledError from None
            if time.monotonic() >= deadline:
                future.cancel()
                raise CompileTimeoutError(limit_s) from None


def make_compiler(grammar: GrammarService, timeout_s: float) -> Compiler:
    """CompileGrammar through the engine's grammar service (one compile cache for both)."""

    def compile_one(spec: Any, options: Any, left: threading.Event) -> Any:
        future = grammar.submit(spec, options)
        _compiled, report = wait_unless_left(future, timeout_s, 1.0, left)
        return report

    return compile_one


def _runner(
    options: ModelOptions,
    tokenizer: TokenizerInfo,
    on_failure: Callable[[str], None] | None = None,
) -> Any:
    """The model's runner; with ``options.tensor_parallel > 1`` rank 0 of that many (the other
    ranks started here; ``on_failure(why)``, from a thread, when one of them dies)."""
    import functools

    import torch

    from espalier.engine.config import CacheConfig, RunnerConfig
    from espalier.engine.model.runner import ModelRunner
    from espalier.engine.model.weights import load_weights

    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cache = CacheConfig(block_size=16, num_blocks=options.kv_blocks)
    if options.model == TINY_RANDOM and options.kv_blocks == 0:
        cache = CacheConfig(16, 4096)
    config = RunnerConfig(device=device, dtype=options.dtype or "auto", cache=cache)
    loader: Callable[[], tuple[Any, dict[str, Any]]]
    if options.model == TINY_RANDOM:
        vocab, stops = tokenizer.vocab_size, tuple(tokenizer.stop_token_ids)
        loader = functools.partial(tiny_random_weights, vocab, stops, options.seed)
    else:
        loader = functools.partial(load_weights, resolve_model(options.model))
    if options.tensor_parallel == 1:
        model_config, state = loader()
        return ModelRunner(model_config, state, config)
    from espalier.engine.model.parallel import ParallelConfig
    from espalier.engine.model.parallel.launch import start_tensor_parallel

    parallel = ParallelConfig(world_size=options.tensor_parallel)
    return start_tensor_parallel(loader, config, parallel, on_failure=on_failure)


def tiny_random_weights(
    vocab_size: int, eos_token_ids: tuple[int, ...], seed: int
) -> tuple[Any, dict[str, Any]]:
    """(ModelConfig, state dict) of ``tiny-random``: a 2-layer llama, seeded (picklable, so
    tensor-parallel ranks build the same weights)."""
    import torch

    from espalier.engine.config import ModelConfig
    from espalier.engine.model.models.llama import LlamaForCausalLM

    model_config = ModelConfig(
        model_type="llama",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        eos_token_ids=eos_token_ids,
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = LlamaForCausalLM(model_config, qkv_bias=False, o_bias=False)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] *= 4.0  # sharper logits: fewer greedy near-ties
    return model_config, state


def load_engine(
    options: ModelOptions,
    tokenizer: TokenizerInfo,
    grammar: GrammarService,
    on_failure: Callable[[str], None] | None = None,
    *,
    engine_type: type[EngineCore] | None = None,
) -> tuple[Any, ModelFacts]:
    """Build the engine (blocking; run it on a thread). Returns (engine, facts).
    ``engine_type``: ``Engine`` (the default: its text made in this process) or
    ``EngineCore`` (token chunks: the engine process, whose server makes the text).
    ``on_failure(why)``: called from a thread when a tensor-parallel rank dies."""
    from espalier.constrained.backends import BACKENDS
    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.engine.engine import Engine, EngineConfig
    from espalier.engine.scheduler import SchedulerConfig

    runner = _runner(options, tokenizer, on_failure)
    if tokenizer.vocab_size != max(runner.vocab_size, tokenizer.tokenizer_vocab_size):
        # The model pads its vocabulary: masks need its width, so a grammar service of its own.
        tokenizer = TokenizerInfo(tokenizer.hf, vocab_size=runner.vocab_size, name=tokenizer.name)
        grammar = grammar_service(options, tokenizer)
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_seqs=options.max_num_seqs, prefix_caching=options.prefix_caching
        ),
        compile_timeout_s=options.compile_timeout_s,
    )
    engine = (engine_type or Engine)(config, runner, tokenizer, grammar=grammar)
    if options.speculative:
        install_speculation(engine, options, runner.config)
    facts = ModelFacts(
        model=options.model,
        vocab_size=runner.vocab_size,
        max_context_tokens=engine.max_model_len,
        device=str(runner.device),
        dtype=str(runner.dtype).removeprefix("torch."),
        grammar_backends=tuple(BACKENDS),
        speculative_methods=options.speculative,
    )
    return engine, facts


def install_speculation(engine: Any, options: ModelOptions, runner_config: Any) -> None:
    """Load the drafters named in ``options.speculative`` and make the engine speculate.

    Requests speculate by default when ``options.speculate_by_default``; each may opt in or out
    (``SpeculativeOptions``) and pick among the loaded methods.
    """
    from espalier.engine.spec.strategy import SpecConfig, install

    drafters: dict[str, Any] = {}
    for method in options.speculative:
        if method == "ngram":
            from espalier.engine.spec.ngram import NgramDrafter

            drafters["ngram"] = NgramDrafter()
        elif method == "draft":
            if options.draft_model is None:
                raise ValueError("--speculative draft needs --draft-model PATH")
            from espalier.engine.model.runner import ModelRunner
            from espalier.engine.spec.draft_model import DraftModelDrafter

            drafters["draft"] = DraftModelDrafter(
                ModelRunner.from_pretrained(options.draft_model, runner_config)
            )
        elif method != "forced":
            raise ValueError(f"unknown speculative method {method!r} (ngram, draft, forced)")
    config = SpecConfig(
        enabled=options.speculate_by_default,
        methods=options.speculative,
        num_draft_tokens=options.num_draft_tokens or SpecConfig.num_draft_tokens,
    )
    install(engine, config, drafters)
