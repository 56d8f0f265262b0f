"""Compiles past their deadline are stopped, and never hold up other compiles (issue 38).

Real backends on the toy tokenizer: an xgrammar JSON schema with hundreds of long unnamed-
property-excluding keys compiles for tens of seconds (800 keys took 59 s in process here), so
each of ten such compiles runs past its limit in a child process that is killed at the deadline.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from espalier.constrained.backends import get_backend
from espalier.constrained.cache import CacheKey, CompileCache
from espalier.constrained.compile import compile_grammar
from espalier.constrained.errors import CompileTimeoutError
from espalier.constrained.spec import GrammarSpec

SLOW_LIMIT_S = 6.0


def slow_schema(n: int) -> dict[str, Any]:
    properties = {f"s{n}_{i}_{'x' * 20}": {"type": "string"} for i in range(400)}
    return {"type": "object", "properties": properties}


def submit(
    cache: CompileCache, spec: GrammarSpec, tokenizer: Any, backend: str, timeout_s: float
) -> Future[Any]:
    key = CacheKey(spec.cache_key, backend, tokenizer.fingerprint)
    return cache.submit(key, lambda: compile_grammar(spec, tokenizer, backend), timeout_s=timeout_s)


def eventually(condition: Callable[[], bool], cap_s: float = 60.0) -> bool:
    """Polls ``condition`` until it holds (True) or ``cap_s`` passed (False)."""
    done = threading.Event()
    for _ in range(int(cap_s / 0.05)):
        if condition():
            return True
        done.wait(0.05)
    return condition()


def test_slow_compiles_are_killed_and_never_block_a_trivial_one(toy_tokenizer: Any) -> None:
    xgrammar = get_backend("xgrammar", toy_tokenizer)
    get_backend("llguidance", toy_tokenizer)  # built before the clock matters
    pool = xgrammar.pool
    assert pool is not None
    killed_before = pool.killed
    cache = CompileCache()
    try:
        slow = [
            submit(
                cache,
                GrammarSpec.json_schema(slow_schema(n)),
                toy_tokenizer,
                "xgrammar",
                SLOW_LIMIT_S,
            )
            for n in range(10)
        ]
        # a trivial schema on any backend compiles at once, while the slow ones still run
        trivial = submit(
            cache, GrammarSpec.json_schema({"type": "integer"}), toy_tokenizer, "auto", 60.0
        )
        compiled, report = trivial.result(timeout=60.0)
        assert compiled.backend == report.backend
        assert not all(f.done() for f in slow)
        # a trivial xgrammar compile queued behind them waits on its own limit only, and gets a
        # child as soon as the slow ones' deadlines free theirs
        queued = submit(
            cache, GrammarSpec.json_schema({"type": "boolean"}), toy_tokenizer, "xgrammar", 300.0
        )
        for future in slow:
            with pytest.raises(CompileTimeoutError):
                future.result(timeout=120.0)
        compiled, report = queued.result(timeout=300.0)
        assert report.backend == "xgrammar" and report.queue_seconds > 0.0
        # nothing is left running: the children that ran past the deadline were killed, every
        # compile thread returned, and the children still alive are idle
        assert pool.killed >= killed_before + 2
        assert eventually(lambda: cache.stats.running == 0)
        assert cache.stats.abandoned_running == 0
        assert pool.busy() == 0
        assert len(pool.live_pids()) <= pool.max_children
        assert cache.stats.timeouts == 10
    finally:
        cache.close()
