"""GrammarService.submit_request: each request gets its own matcher, made off the calling thread.

A new llguidance matcher builds its own lexer (milliseconds on a large vocabulary); made in the
engine's step it held every running request of the batch (issue 28's timeline: 6-10 ms per
speculative step at batch 32). These tests pin where it is made and what the Future carries.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from espalier.constrained.errors import GrammarError
from espalier.constrained.spec import GrammarKind, GrammarSpec
from espalier.engine.api import ConstraintOptions
from espalier.engine.constraints import GrammarService

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_each_request_gets_its_own_matcher_made_off_the_calling_thread(
    toy_tokenizer: Any, backend: str
) -> None:
    service = GrammarService(toy_tokenizer, compile_timeout_s=60.0)
    try:
        spec = GrammarSpec.json_schema(SCHEMA)
        options = ConstraintOptions(backend=backend)
        first = service.submit_request(spec, options).result(timeout=120)
        compiled = first[0]
        made_on: list[str] = []
        original = compiled.matcher

        def recording_matcher() -> Any:
            made_on.append(threading.current_thread().name)
            return original()

        compiled.matcher = recording_matcher  # type: ignore[method-assign]
        second = service.submit_request(spec, options).result(timeout=120)
    finally:
        service.close()
    assert second[0] is compiled  # the compile is shared (cache hit)
    assert second[2] is not first[2]  # the matcher is not
    # the request's own matcher on a matcher thread (its grammar's spare, if one is made
    # already, on a spare thread): none on the calling thread
    assert "espalier-matcher" in {name.rsplit("_", 1)[0] for name in made_on}
    assert all(name.startswith(("espalier-matcher", "espalier-spare")) for name in made_on)
    text = b'{"a": 1}'
    ids = toy_tokenizer.hf.encode(text.decode(), add_special_tokens=False)
    assert second[2].accept_tokens(ids) == len(ids)
    assert first[2].accept_tokens(ids[:1]) == 1  # the first request's state is its own


def test_a_compile_error_reaches_the_request_future(toy_tokenizer: Any) -> None:
    service = GrammarService(toy_tokenizer, compile_timeout_s=60.0)
    try:
        unclosed = GrammarSpec(GrammarKind.REGEX, "(unclosed")  # past GrammarSpec.regex's check
        future = service.submit_request(unclosed, ConstraintOptions())
        with pytest.raises(GrammarError):
            future.result(timeout=120)
    finally:
        service.close()


def test_a_service_shared_by_engines_still_makes_matchers_after_one_closes(
    toy_tokenizer: Any,
) -> None:
    # benchmarks and the server hand one service to successive engines; Engine.close closes it
    service = GrammarService(toy_tokenizer, compile_timeout_s=60.0)
    spec = GrammarSpec.json_schema(SCHEMA)
    try:
        first = service.submit_request(spec, ConstraintOptions()).result(timeout=120)
        service.close()
        again = service.submit_request(spec, ConstraintOptions()).result(timeout=120)
    finally:
        service.close()
    assert again[0] is first[0] and again[2] is not first[2]


def _text_ids(tokenizer: Any) -> list[int]:
    ids: list[int] = tokenizer.hf.encode('{"a": 1}', add_special_tokens=False)
    return ids


def test_a_repeated_grammar_takes_spares_each_new_and_its_own(toy_tokenizer: Any) -> None:
    service = GrammarService(toy_tokenizer, compile_timeout_s=60.0, spares_per_grammar=2)
    spec = GrammarSpec.json_schema(SCHEMA)
    options = ConstraintOptions(backend="llguidance")
    ids = _text_ids(toy_tokenizer)
    try:
        first = service.submit_request(spec, options).result(timeout=120)  # marks the grammar
        second = service.submit_request(spec, options).result(timeout=120)  # a spare is made
        assert second[2].accept_tokens(ids[:3]) == 3  # used: must not leak into a spare
        spare = None
        deadline = time.monotonic() + 60
        while spare is None and time.monotonic() < deadline:
            future = service.submit_request(spec, options)
            if future.done():  # a spare is handed over at once, on the calling thread
                spare = future.result()
            else:
                future.result(timeout=120)
                time.sleep(0.05)
    finally:
        service.close()
    assert spare is not None, "no spare was ever ready"
    assert spare[0] is first[0]
    assert spare[2] is not first[2] and spare[2] is not second[2]
    assert spare[2].accept_tokens(ids) == len(ids) and spare[2].can_terminate()  # at the start


def test_a_grammar_requested_once_makes_no_spare(toy_tokenizer: Any) -> None:
    service = GrammarService(toy_tokenizer, compile_timeout_s=60.0)
    spec = GrammarSpec.json_schema(SCHEMA)
    try:
        compiled = service.submit_request(spec, ConstraintOptions()).result(timeout=120)[0]
        made: list[int] = []
        original = compiled.matcher

        def counting() -> Any:
            made.append(1)
            return original()

        compiled.matcher = counting  # type: ignore[method-assign]
        other = GrammarSpec.json_schema({"type": "array", "items": {"type": "integer"}})
        service.submit_request(other, ConstraintOptions()).result(timeout=120)
        time.sleep(0.2)
    finally:
        service.close()
    assert made == []


def test_no_spares_when_turned_off(toy_tokenizer: Any) -> None:
    service = GrammarService(toy_tokenizer, compile_timeout_s=60.0, spares_per_grammar=0)
    spec = GrammarSpec.json_schema(SCHEMA)
    try:
        first = service.submit_request(spec, ConstraintOptions()).result(timeout=120)
        made_on: list[str] = []
        original = first[0].matcher

        def recording() -> Any:
            made_on.append(threading.current_thread().name)
            return original()

        first[0].matcher = recording  # type: ignore[method-assign]
        for _ in range(3):
            service.submit_request(spec, ConstraintOptions()).result(timeout=120)
        time.sleep(0.2)
    finally:
        service.close()
    assert len(made_on) == 3  # one per request, none ahead
    assert all(name.startswith("espalier-matcher") for name in made_on)


def _hold_spare_threads(compiled: Any, gate: threading.Event) -> None:
    """Make ``compiled``'s matchers on spare threads wait for ``gate`` (a request's own do not)."""
    original = compiled.matcher

    def gated() -> Any:
        if threading.current_thread().name.startswith("espalier-spare"):
            assert gate.wait(60)
        return original()

    compiled.matcher = gated


def _settled_spares(service: GrammarService, compiled: Any) -> Any:
    """``compiled``'s spares entry once no refill is being made (or after 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        with service._spares_lock:
            entry = service._spares[id(compiled)]
            if not entry.making or time.monotonic() >= deadline:
                return entry
        time.sleep(0.02)


def test_a_grammar_keeps_as_many_spares_as_its_bursts_need_up_to_the_cap(
    toy_tokenizer: Any,
) -> None:
    service = GrammarService(toy_tokenizer, compile_timeout_s=60.0, spares_per_grammar=3)
    spec = GrammarSpec.json_schema(SCHEMA)
    options = ConstraintOptions(backend="llguidance")
    ids = _text_ids(toy_tokenizer)
    gate = threading.Event()  # holds the spare threads until the burst is in
    try:
        compiled = service.submit_request(spec, options).result(timeout=120)[0]  # marks it
        _hold_spare_threads(compiled, gate)
        burst = [service.submit_request(spec, options) for _ in range(5)]  # each finds none
        for future in burst:
            future.result(timeout=120)
        gate.set()
        entry = _settled_spares(service, compiled)  # the refills run on the spare threads
        with service._spares_lock:
            assert len(entry.ready) == 3  # the cap, not the burst's 5
        again = [service.submit_request(spec, options) for _ in range(3)]
        assert all(f.done() for f in again)  # handed over at once: the burst was learned
        matchers = [f.result()[2] for f in again]
    finally:
        gate.set()
        service.close()
    assert len({id(m) for m in matchers}) == 3
    for matcher in matchers:
        assert matcher.accept_tokens(ids) == len(ids) and matcher.can_terminate()


def test_refills_queued_when_the_service_closes_still_run(toy_tokenizer: Any) -> None:
    # benchmarks and the server hand one service to successive engines; Engine.close closes it
    # while refills may be queued: dropped, their counts would stay "being made" for good, and
    # the grammar would keep fewer spares after every close
    service = GrammarService(toy_tokenizer, compile_timeout_s=60.0, spares_per_grammar=4)
    spec = GrammarSpec.json_schema(SCHEMA)
    options = ConstraintOptions(backend="llguidance")
    gate = threading.Event()  # holds the spare threads: two refills run, two wait in the queue
    try:
        compiled = service.submit_request(spec, options).result(timeout=120)[0]  # marks it
        _hold_spare_threads(compiled, gate)
        for future in [service.submit_request(spec, options) for _ in range(5)]:
            future.result(timeout=120)
        service.close()
        gate.set()
        entry = _settled_spares(service, compiled)
        with service._spares_lock:
            assert entry.making == 0 and len(entry.ready) == 4
    finally:
        gate.set()
        service.close()


def test_a_request_matcher_comes_with_its_own_native_matcher(toy_tokenizer: Any) -> None:
    """Made on the service's thread: each llguidance request's matcher has its own C-API
    matcher (a clone of the grammar's template), at the start state."""
    from espalier.constrained.backends import get_backend

    assert get_backend("llguidance", toy_tokenizer).tree_walk(timeout=120) == "native"
    service = GrammarService(toy_tokenizer, compile_timeout_s=60.0)
    try:
        spec = GrammarSpec.json_schema(SCHEMA)
        options = ConstraintOptions(backend="llguidance")
        _, _, matcher = service.submit_request(spec, options).result(timeout=120)
        _, _, other = service.submit_request(spec, options).result(timeout=120)
    finally:
        service.close()
    inner = getattr(matcher, "inner", matcher)  # a duplicate-key tracker may wrap it
    other_inner = getattr(other, "inner", other)
    assert inner.materialized and inner.history == []
    assert inner.native.pointer != other_inner.native.pointer
    text = '{"a": 12}'
    ids = toy_tokenizer.hf.encode(text, add_special_tokens=False)
    assert matcher.accept_tokens(ids) == len(ids)
    assert matcher.can_terminate()


def test_a_cancelled_request_withdraws_from_its_compile(
    toy_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request's Future cancelled (an aborted request) cancels its wait in the compile
    cache, which stops a compile nobody else waits for (``test_compile_pool.py``)."""
    from concurrent.futures import Future

    service = GrammarService(toy_tokenizer, compile_timeout_s=60.0)
    waits: list[Future[Any]] = []

    def pending(*_: Any, **__: Any) -> Future[Any]:
        waits.append(Future())
        return waits[-1]

    try:
        monkeypatch.setattr(service.cache, "submit", pending)
        out = service.submit_request(GrammarSpec.json_schema(SCHEMA), ConstraintOptions())
        assert len(waits) == 1 and not waits[0].cancelled()
        assert out.cancel()
        assert waits[0].cancelled()
    finally:
        service.close()


def test_grammars_the_cache_evicts_are_freed_without_a_collection(toy_tokenizer: Any) -> None:
    """A held-out sweep grew the engine by ~200 MB per distinct outlines-core schema: grammars
    the compile cache had evicted stayed alive, held by their spare matchers (the 16 grammars
    requested last), the closing paths' per-grammar memos (up to 256) and a cycle of each
    request's two Futures (freed only by a full collection, rare under the engine's gc
    settings). With the cache bounded to about one grammar, every evicted grammar is freed by
    reference counting alone, spares and closing paths on."""
    import gc
    import weakref

    service = GrammarService(
        toy_tokenizer, compile_timeout_s=60.0, spares_per_grammar=2, cache_max_bytes=1_600_000
    )
    service.closing_paths()  # every matcher leaves with its grammar's start path searched
    options = ConstraintOptions(backend="llguidance")
    grammars: list[weakref.ref[Any]] = []
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for i in range(6):
            name = f"k{i}"
            spec = GrammarSpec.json_schema(
                {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}
            )
            for _ in range(3):  # the second and third request make and take spares
                result = service.submit_request(spec, options).result(timeout=120)
                grammars.append(weakref.ref(result[0]))
                del result
            deadline = time.monotonic() + 30
            while service._spares and time.monotonic() < deadline:  # refills finish
                entry = next(reversed(service._spares.values()))
                if not entry.making:
                    break
                time.sleep(0.01)
        assert service.cache.stats.evictions >= 4
        kept = {id(ref()) for ref in grammars if ref() is not None}
        assert len(kept) <= 2, (
            f"{len(kept)} grammars alive, the cache holds {service.cache.stats.entries}"
        )
    finally:
        if was_enabled:
            gc.enable()
        service.close()
