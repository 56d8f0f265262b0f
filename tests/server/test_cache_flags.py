"""The cache flags of ``espalier serve``: ``--no-prefix-cache`` reaches the scheduler config,
``--grammar-cache-dir`` the grammar service; and a real restart with ``--grammar-cache-dir``
loads an xgrammar grammar compiled before it instead of compiling it again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from espalier_client import Client

from espalier.server.cli_serve import config_from_args, model_options_from_args
from espalier.server.loading import grammar_service
from espalier.server.main import build_parser
from tests.fixtures.server_helpers import SCHEMA
from tests.fixtures.server_process import ServerProcess


def options(*argv: str) -> Any:
    args = build_parser().parse_args(["serve", *argv])
    return model_options_from_args(args, config_from_args(args))


def test_prefix_cache_is_on_by_default_and_the_flag_turns_it_off() -> None:
    assert options().prefix_caching
    assert not options("--no-prefix-cache").prefix_caching


def test_grammar_cache_dir_gives_the_grammar_service_a_disk_cache(
    toy_tokenizer: Any, tmp_path: Path
) -> None:
    assert grammar_service(options(), toy_tokenizer).disk_cache is None
    flagged = options("--grammar-cache-dir", str(tmp_path), "--grammar-cache-max-mb", "2")
    disk = grammar_service(flagged, toy_tokenizer).disk_cache
    assert disk is not None
    assert disk.directory == tmp_path and disk.config.max_bytes == 2 << 20


def _compile(srv: ServerProcess) -> Any:
    srv.wait_event("tokenizer_loaded")  # CompileGrammar works while the model loads
    with Client(srv.address, timeout_s=900.0) as client:
        return client.compile_grammar(schema=SCHEMA, backend="xgrammar", allow_weakening=True)


@pytest.mark.slow
@pytest.mark.model
def test_restart_skips_the_compile_of_a_grammar_compiled_before(tmp_path: Path) -> None:
    flags = ("--grammar-cache-dir", str(tmp_path), "--compile-timeout", "900")
    with ServerProcess(*flags) as srv:
        first = _compile(srv)
        srv.wait_loaded()  # then stop: the engine's shutdown flushes the disk cache's writer
    assert first.backend == "xgrammar" and not first.cache_hit
    assert len(list(tmp_path.glob("*.xgrammar"))) == 1
    with ServerProcess(*flags) as srv:  # a new process: its in-memory compile cache is empty
        again = _compile(srv)
    assert again.backend == "xgrammar" and again.cache_hit
    assert again.cache_key == first.cache_key


def test_prefix_cache_gauges_read_the_engine_stats() -> None:
    from espalier.server.metrics import ServerMetrics

    metrics = ServerMetrics()
    stats = {
        "prefix_queried_tokens": 4000,
        "prefix_hit_tokens": 3000,
        "prefix_cached_blocks": 70,
        "prefix_evictions": 5,
    }
    metrics.bind_engine(lambda: stats)
    value = metrics.registry.get_sample_value
    assert value("espalier_engine_prefix_cache_hit_rate") == 0.75
    assert value("espalier_engine_prefix_cache_blocks") == 70
    assert value("espalier_engine_prefix_cache_evictions") == 5
    stats["prefix_queried_tokens"] = 0  # nothing admitted yet: a rate of 0, not a division error
    assert value("espalier_engine_prefix_cache_hit_rate") == 0.0
