"""Fixtures: one shared server process for the suite, and the SDK clients bound to it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fixtures.server_process import ServerProcess


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """The plain (no auth, no TLS) server on the tiny random model, tokenizer loaded."""
    limits = ["--max-prompt-tokens", "512", "--max-grammar-bytes", "4096", "--max-message-mb", "1"]
    limits += ["--max-prompt-bytes", "65536"]
    # Speculation loaded but off by default: requests opt in (SpeculativeOptions).
    spec = ["--speculative", "ngram,forced", "--speculate-by-default", "off"]
    # A compile limit far above any real compile: first compiles build 262k-token vocabulary
    # views, which takes tens of seconds on a loaded 2-core machine.
    reasoning = ["--reasoning-end", "</think>"]  # used only by after_reasoning requests
    with ServerProcess(*limits, *spec, *reasoning, "--compile-timeout", "900") as srv:
        srv.wait_event("tokenizer_loaded")
        yield srv


@pytest.fixture(scope="session")
def serving(server: ServerProcess) -> ServerProcess:
    """The shared server once its model is SERVING (skips while the engine cannot load)."""
    if not server.wait_loaded():
        event = server.wait_event("load_failed")
        pytest.skip(f"the engine is not available yet: {event.get('error')}")
    return server
