"""``--compile-slots`` reaches every backend's compile bound, and a compile's wait for a place to
run is reported apart from its run: in CompileGrammarResponse and in a request's Timings.
``--matcher-spares`` reaches the grammar service's spare matchers."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import pytest
from espalier_client import Client

from espalier.constrained.backends import BackendOptions, get_backend
from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import ConstraintOptions
from espalier.server import convert
from espalier.server.cli_serve import config_from_args, model_options_from_args, run
from espalier.server.loading import grammar_service
from espalier.server.main import build_parser
from tests.fixtures.server_process import ServerProcess


def options(*argv: str) -> Any:
    args = build_parser().parse_args(["serve", *argv])
    return model_options_from_args(args, config_from_args(args))


def test_compile_slots_flag_reaches_the_backend_options(toy_tokenizer: Any, tmp_path: Any) -> None:
    assert options().compile_slots == 2
    flagged = options("--compile-slots", "3", "--grammar-cache-dir", str(tmp_path))
    service = grammar_service(flagged, toy_tokenizer)
    assert service.backend_options == BackendOptions(compile_slots=3)
    assert service.disk_cache is not None and service.disk_cache.options == service.backend_options


def test_matcher_spares_flag_reaches_the_grammar_service(toy_tokenizer: Any) -> None:
    assert grammar_service(options(), toy_tokenizer).spares_per_grammar == 16
    assert grammar_service(options("--matcher-spares", "0"), toy_tokenizer).spares_per_grammar == 0
    args = build_parser().parse_args(["serve", "--matcher-spares", "-1"])
    with pytest.raises(SystemExit, match="--matcher-spares must be at least 0"):
        run(args)


def test_compile_slots_below_one_is_refused_before_serving() -> None:
    args = build_parser().parse_args(["serve", "--compile-slots", "0"])
    with pytest.raises(SystemExit, match="--compile-slots must be at least 1"):
        run(args)


def test_a_compile_waiting_for_its_backends_slot_reports_the_wait_apart(toy_tokenizer: Any) -> None:
    """One llguidance slot, held here: the service's compile waits for it (it cannot finish
    while the slot is held), then runs; its report splits the wait from the run."""
    slots = BackendOptions(compile_slots=1)
    service = grammar_service(options("--compile-slots", "1"), toy_tokenizer)
    lane = get_backend("llguidance", toy_tokenizer, slots).lane  # type: ignore[attr-defined]
    spec = GrammarSpec.regex("[0-9]{3}-" + uuid.uuid4().hex[:6])
    try:
        with lane.slot():
            future = service.submit(spec, ConstraintOptions(backend="llguidance"))
            with pytest.raises(FutureTimeout):
                future.result(timeout=1.0)
        _compiled, report = future.result(timeout=120.0)
    finally:
        service.close()
    assert not report.cache_hit
    assert report.queue_seconds >= 0.5  # the slot was held for the second waited on above
    assert report.compile_seconds > 0.0
    message = convert.compile_report_to_proto(report)
    assert message.queue_seconds == report.queue_seconds
    assert message.compile_seconds == report.compile_seconds


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.address, timeout_s=600.0) as c:
        yield c


@pytest.mark.model
def test_generate_timings_split_the_compile_and_are_zero_on_a_cache_hit(
    serving: ServerProcess, client: Client
) -> None:
    regex = "[a-c]{2}" + uuid.uuid4().hex[:4]  # a grammar no other test compiled
    first = client.generate("x", regex=regex, backend="llguidance", max_tokens=8)
    again = client.generate("x", regex=regex, backend="llguidance", max_tokens=8)
    missed, hit = first.raw.timings, again.raw.timings
    assert missed.compile_run_seconds > 0.0 and missed.compile_queue_seconds >= 0.0
    assert missed.compile_seconds >= missed.compile_run_seconds
    assert hit.compile_run_seconds == 0.0 and hit.compile_queue_seconds == 0.0
    compiled = client.compile_grammar(regex=regex, backend="llguidance")
    assert compiled.cache_hit and compiled.queue_seconds == 0.0


def test_a_compile_wait_ends_when_its_caller_leaves() -> None:
    """CompileGrammar's wait (``wait_unless_left``): the caller's event set, the wait ends with
    CancelledError and the compile's future is cancelled (its cache wait withdrawn); unset, a
    result arrives as usual and a pending one times out with the compile's own limit."""
    import threading
    from concurrent.futures import CancelledError, Future

    import pytest

    from espalier.constrained.errors import CompileTimeoutError
    from espalier.server.loading import wait_unless_left

    pending: Future[int] = Future()
    left = threading.Event()
    threading.Timer(0.2, left.set).start()
    with pytest.raises(CancelledError):
        wait_unless_left(pending, 600.0, 0.0, left)
    assert pending.cancelled()
    done: Future[int] = Future()
    done.set_result(7)
    assert wait_unless_left(done, 600.0, 0.0, threading.Event()) == 7
    with pytest.raises(CompileTimeoutError, match=r"0\.1"):
        wait_unless_left(Future(), 0.1, 0.1, threading.Event())
