"""outlines-core Index builds in child processes (``backends/outlines_core/index.py``): the same
Index as in process, a clear error past the memory cap, the child killed at a compile cache's
deadline, and the builder serving on after each; the child loads no torch."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import pytest

from espalier.constrained.backends import get_backend
from espalier.constrained.backends.common import BackendOptions
from espalier.constrained.cache import CacheKey, CompileCache
from espalier.constrained.compile import compile_grammar
from espalier.constrained.errors import (
    CompileMemoryError,
    CompileTimeoutError,
    UnsupportedGrammarError,
)
from espalier.constrained.spec import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name"],
}
# the DFA of "an 'a' 16 (or 22) characters from the end" has 2**17 (2**23) states
EXPLODES = "[ab]*a[ab]{16}"
# {20} took 18.8 s and +0.56 GiB in process here; {22} has 4 times its states
EXPLODES_SLOWLY = "[ab]*a[ab]{22}"


def backend(tokenizer: Any, memory_limit: int) -> Any:
    return get_backend(
        "outlines_core", tokenizer, BackendOptions(outlines_memory_limit=memory_limit)
    )


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def index_facts(index: Any) -> tuple[Any, ...]:
    return index.get_initial_state(), index.get_final_states(), index.get_transitions()


@pytest.mark.parametrize(
    "spec", [GrammarSpec.regex(r"(ab|c)+d?"), GrammarSpec.json_schema(SCHEMA)], ids=str
)
def test_child_builds_the_index_the_process_would(spec: GrammarSpec, toy_tokenizer: Any) -> None:
    child = backend(toy_tokenizer, 1 << 30)
    assert child.builder is not None
    here = backend(toy_tokenizer, 0)
    assert here.builder is None
    built = child.compile(spec)
    assert index_facts(built.native) == index_facts(here.compile(spec).native)
    assert child.builder.live_pids()  # kept for the next build


def test_past_the_memory_cap_is_a_clear_error_and_the_builder_goes_on(toy_tokenizer: Any) -> None:
    outlines = backend(toy_tokenizer, 64 << 20)
    builder = outlines.builder
    builder.close()
    started, killed = builder.started, builder.killed
    with pytest.raises(CompileMemoryError) as info:
        outlines.compile(GrammarSpec.regex(EXPLODES))
    assert info.value.backend == "outlines_core" and info.value.limit_bytes == 64 << 20
    assert "64 MiB" in str(info.value)
    assert builder.killed == killed + 1 and builder.live_pids() == []
    # a regex the library refuses (Python reads it: outlines-core does not) is its error, and
    # the child that answered it stays
    with pytest.raises(UnsupportedGrammarError, match="error building NFA") as refused:
        outlines.compile(GrammarSpec.regex("(?<=a)b"))
    assert refused.value.kind == "regex"
    kept = builder.live_pids()
    assert len(kept) == 1
    assert outlines.compile(GrammarSpec.regex("ab+")).native.get_final_states()
    assert builder.live_pids() == kept and builder.started == started + 2


def nested_arrays(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    return schema


def test_a_schema_regex_is_built_in_the_child(toy_tokenizer: Any) -> None:
    outlines = backend(toy_tokenizer, 1 << 30)
    builder = outlines.builder
    builder.close()
    started = builder.started
    regex = outlines.regex(GrammarSpec.json_schema(SCHEMA))
    assert builder.started == started + 1  # the regex alone asked a child
    assert regex == backend(toy_tokenizer, 0).regex(GrammarSpec.json_schema(SCHEMA))


def test_a_schema_whose_regex_outgrows_the_cap_is_a_memory_error(toy_tokenizer: Any) -> None:
    """25 levels (under 1.5 KB): outlines-core's regex for it asks for 3.6 GB at once, which
    aborted the process that built it, the engine's when it was built there."""
    outlines = backend(toy_tokenizer, 1 << 30)
    with pytest.raises(CompileMemoryError):
        outlines.compile(GrammarSpec.json_schema(nested_arrays(25)))
    assert outlines.compile(GrammarSpec.json_schema(nested_arrays(3))).native.get_final_states()


def test_cache_deadline_kills_the_building_child(toy_tokenizer: Any) -> None:
    outlines = backend(toy_tokenizer, 4 << 30)
    builder = outlines.builder
    builder.close()
    started, killed = builder.started, builder.killed
    cache = CompileCache(timeout_s=0.5)
    spec = GrammarSpec.regex(EXPLODES_SLOWLY)
    finished = threading.Event()
    raised: list[BaseException] = []

    def compile_fn() -> Any:
        try:
            return compile_grammar(spec, toy_tokenizer, "outlines_core", options=outlines.options)
        except BaseException as exc:
            raised.append(exc)
            raise
        finally:
            finished.set()

    key = CacheKey(spec.cache_key, "outlines_core", toy_tokenizer.fingerprint)
    try:
        with pytest.raises(CompileTimeoutError):
            cache.get(key, compile_fn)
        # the abandoned compile thread stops with its child instead of building on for minutes
        assert finished.wait(30.0)
        assert [type(exc) for exc in raised] == [CompileTimeoutError]
        assert builder.killed == killed + 1 and builder.live_pids() == []
        assert builder.started == started + 1
        # and the next compile on the backend starts a new child
        assert outlines.compile(GrammarSpec.regex("xy?")).native is not None
        (pid,) = builder.live_pids()
        builder.close()
        assert builder.live_pids() == [] and gone(pid)
    finally:
        cache.close()


def test_a_cap_too_small_to_start_the_child_is_a_clear_error(toy_tokenizer: Any) -> None:
    outlines = backend(toy_tokenizer, 1 << 20)  # 1 MiB: not even the interpreter fits
    with pytest.raises(CompileMemoryError) as info:
        outlines.compile(GrammarSpec.regex("ab+"))
    assert "1 MiB" in str(info.value)  # at start or at the first build: where it reads
    assert outlines.builder.live_pids() == []


def test_the_child_module_loads_neither_torch_nor_the_adapter() -> None:
    """The child imports its package on the way to ``index_child``: that chain stays free of
    torch and of the adapter, whose memory each capped child would otherwise hold."""
    from espalier.constrained.backends.outlines_core.index import CHILD_MODULE

    probe = (
        f"import sys, {CHILD_MODULE}; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.endswith('.adapter')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_a_long_forced_literal_is_no_recursion_error(toy_tokenizer: Any) -> None:
    """``é{1000}``: 2,000 forced states of one-byte tokens; the forced-bytes walk recursed past
    Python's limit (INTERNAL at the first step). It stops deep enough instead."""
    compiled, _ = compile_grammar(GrammarSpec.regex("é{1000}"), toy_tokenizer, "outlines_core")
    forced = compiled.matcher().forced_tokens(4096)
    written = b"".join(toy_tokenizer.token_bytes[t] for t in forced)
    assert 0 < len(written) < 2000 and ("é" * 1000).encode().startswith(written)


ANY_VALUE_BELOW = {"type": "object", "properties": {"a": {}}, "required": ["a"]}
ANY_VALUE_DESCRIBED = {"type": "object", "properties": {"a": {"description": "any value"}}}


@pytest.mark.parametrize(
    "schema",
    [True, {}, {"title": "anything", "$comment": "x"}, ANY_VALUE_BELOW, ANY_VALUE_DESCRIBED],
)
def test_a_schema_that_takes_any_value_is_refused_at_once_on_outlines(
    schema: Any, toy_tokenizer: Any
) -> None:
    """Its depth-unrolled regex's index ran 5 minutes into the 4 GiB limit (a request waited
    for its 30 s compile limit); llguidance and xgrammar take it, so does auto. Below the root
    too (a held-out sweep: a property ``{}`` timed out at 30 s, one with only a
    ``description`` was INVALID_GRAMMAR)."""
    from espalier.constrained.errors import UnsupportedGrammarError

    spec = GrammarSpec.json_schema(schema)
    with pytest.raises(UnsupportedGrammarError, match="any JSON value"):
        compile_grammar(spec, toy_tokenizer, "outlines_core")
    for name in ("llguidance", "xgrammar", "auto"):
        compiled, _ = compile_grammar(spec, toy_tokenizer, name)
        matcher = compiled.matcher()
        text = '{"a": [1, "x", null]}'
        assert matcher.completes(toy_tokenizer.encode(text)), name


def test_a_valid_schema_outlines_core_cannot_index_is_unsupported_not_invalid(
    toy_tokenizer: Any,
) -> None:
    """A held-out sweep: ``^a$|^b$`` (an anchor in each alternative, valid ECMA-262) failed as
    INVALID_GRAMMAR "Index failed since anchored universal start state doesn't exist" on
    outlines-core; xgrammar and llguidance take it. A schema is valid by then (checked at
    admission): what outlines-core cannot build says nothing against it."""
    from espalier.constrained.errors import UnsupportedGrammarError

    spec = GrammarSpec.json_schema({"type": "string", "pattern": "^a$|^b$"})
    with pytest.raises(UnsupportedGrammarError, match="outlines-core"):
        compile_grammar(spec, toy_tokenizer, "outlines_core")
    for name in ("llguidance", "auto"):
        compiled, _ = compile_grammar(spec, toy_tokenizer, name)
        assert compiled.matcher().completes(toy_tokenizer.encode('"b"')), name
