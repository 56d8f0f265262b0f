"""``CompileProbe`` (``bench/compile_probe.py``): compiles in a child process, which is killed past
the timeout and restarted."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from bench.compile_probe import CompileProbe
from espalier.constrained.spec import GrammarKind, GrammarSpec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, toy_tokenizer: Any) -> Path:
    folder = tmp_path_factory.mktemp("toy_tokenizer")
    toy_tokenizer.hf.save_pretrained(folder)
    return folder


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/status").read_text().count("zombie")


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "outlines_core"])
def test_compiles_reports_refusals_and_kills_at_timeout(tokenizer_dir: Path, backend: str) -> None:
    with CompileProbe([backend], str(tokenizer_dir)) as probe:
        good = probe.compile(backend, GrammarSpec.json_schema(SCHEMA), timeout=60.0)
        assert good.ok and not good.timed_out and good.seconds < 60.0
        first = probe.pid
        assert first is not None and alive(first)

        bad = probe.compile(backend, GrammarSpec(GrammarKind.REGEX, "(unclosed"), timeout=60.0)
        assert not bad.ok and not bad.timed_out and bad.error
        assert probe.pid == first  # a refusal does not cost the child

        # nothing compiles in 1 µs: the child is killed, not left running
        late = probe.compile(backend, GrammarSpec.json_schema(SCHEMA), timeout=1e-6)
        assert late.timed_out and not late.ok
        assert probe.pid is None and probe.kills == 1 and not alive(first)

        again = probe.compile(backend, GrammarSpec.json_schema(SCHEMA), timeout=60.0)
        assert again.ok and probe.pid not in (None, first)
    assert probe.pid is None


def test_a_reply_read_late_still_times_out(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reply of a compile that ran past its timeout can be waiting already when the parent
    first looks (it was descheduled meanwhile: CI saw a cached compile pass a 1 µs timeout this
    way); the compile's own time decides, and the child is killed as on a timed-out wait."""
    spec = GrammarSpec.json_schema(SCHEMA)
    with CompileProbe(["xgrammar"], str(tokenizer_dir)) as probe:
        assert probe.compile("xgrammar", spec, timeout=60.0).ok
        first = probe.pid
        assert first is not None
        look = probe._next_line

        def look_late(timeout: float) -> str | None:
            time.sleep(0.5)  # the child answers meanwhile
            return look(timeout)

        monkeypatch.setattr(probe, "_next_line", look_late)
        late = probe.compile("xgrammar", spec, timeout=1e-6)
        assert late.timed_out and not late.ok
        assert probe.kills == 1 and not alive(first)
