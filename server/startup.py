"""Start serving: the engine's child process and this process's tokenizer load side by side (the
tokenizer is first ready: Tokenize and CompileGrammar work from then on), then a warm-up
generation before health turns SERVING.

The parts are loaded by ``server/loading.py``; the child process's side is
``server/engine_process.py`` (which loads through ``loading`` too), so this module, which starts
the child, is the one that imports both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from espalier.server.engine_port import ServingEngine
from espalier.server.engine_supervisor import warm_up
from espalier.server.loading import (
    ModelOptions,
    grammar_service,
    load_tokenizer,
    make_compiler,
)
from espalier.server.state import ModelFacts, ServingState, announce

if TYPE_CHECKING:
    from espalier.constrained.tokenizer import TokenizerInfo
    from espalier.engine.constraints import GrammarService
    from espalier.server.engine_process import SpawnedEngine


def make_loader(
    options: ModelOptions,
) -> Callable[[ServingState], Awaitable[tuple[ServingEngine, ModelFacts]]]:
    async def load(state: ServingState) -> tuple[ServingEngine, ModelFacts]:
        from espalier.server.engine_process import spawn_engine_process
        from espalier.server.gc_freeze import freeze_startup_heap

        spawned = spawn_engine_process(options)  # it loads while our tokenizer does
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, options)
        except BaseException:
            spawned.kill()
            raise
        grammar = grammar_service(options, tokenizer)
        state.tokenizer = tokenizer
        state.compiler = make_compiler(grammar, options.compile_timeout_s)
        state.metrics.bind_compile_cache(lambda: grammar.cache.stats)
        announce(event="tokenizer_loaded", tokenizer=tokenizer.name)
        engine, facts = await _start_engine_process(options, state, spawned, tokenizer, grammar)
        await warm_up(engine)
        freeze_startup_heap()  # no multi-ms collections of the startup heap while serving
        return engine, facts

    return load


async def _start_engine_process(
    options: ModelOptions,
    state: ServingState,
    spawned: SpawnedEngine,
    tokenizer: TokenizerInfo,
    grammar: GrammarService,
) -> tuple[ServingEngine, ModelFacts]:
    """The engine in a child process, replaced when it dies (``EngineSupervisor``). From here on
    CompileGrammar compiles in the child's cache (``EngineProcess.compile``)."""
    from espalier.server.engine_process import EngineProcess, EngineProcessConfig
    from espalier.server.engine_supervisor import EngineSupervisor

    def on_engine(engine: EngineProcess) -> None:
        announce(event="engine_process", pid=engine.process.pid)
        if options.tensor_parallel > 1:
            announce(event="tensor_parallel", ranks=options.tensor_parallel, pids=engine.rank_pids)

    config = EngineProcessConfig(
        max_waiting=options.max_queue, compile_timeout_s=options.compile_timeout_s
    )
    engine = EngineSupervisor(
        options,
        state,
        grammar,
        config,
        state.config.engine_restarts,
        on_engine,
        stall_timeout_s=state.config.engine_stall_timeout_s,
    )
    facts, tokenizer = await engine.start(spawned, tokenizer)
    state.tokenizer = tokenizer  # at the engine's width when the model pads its vocabulary
    state.compiler = engine.compile  # CompileGrammar warms the cache the requests use
    state.metrics.bind_compile_cache(lambda: engine.grammar_cache_stats(grammar.cache.stats))
    return engine, facts
