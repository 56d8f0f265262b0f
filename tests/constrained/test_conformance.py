"""The conformance runner and CLI, and the ratchet on the JSON Schema Test Suite.

The ratchet (``tests/ratchet_conformance.json``) records, per backend and for ``auto``, the
summary on the draft2020-12 core files. CI reruns a representative subset with a toy tokenizer
(fast, no model), and a JSONSchemaBench sample with each backend chosen by name (strict mode);
``ESPALIER_SLOW=1`` reruns the full core of each draft folder (2020-12, 2019-09, 7) with the
embedded Gemma tokenizer. Each fails when
``passed`` drops below the record or ``false_accept`` is not 0.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

from espalier.constrained.conformance import (
    SUMMARY_KEYS,
    RunConfig,
    find_files,
    find_remotes,
    run_files,
    total,
)
from espalier.server.default_model import default_gguf
from espalier.server.main import main

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT.parent / "shared" / "conformance" / "json-schema-test-suite"
DRAFT = SUITE / "draft2020-12"
DRAFT_FOLDERS = ("draft2020-12", "draft2019-09", "draft7")
BENCH_TAR = SUITE.parent / "jsonschemabench.tar.xz"
RATCHET = json.loads((ROOT / "tests" / "ratchet_conformance.json").read_text())
needs_suite = pytest.mark.skipif(not DRAFT.is_dir(), reason="JSON Schema Test Suite not present")
needs_bench = pytest.mark.skipif(not BENCH_TAR.is_file(), reason="JSONSchemaBench not present")


@pytest.fixture(scope="module")
def toy_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.fixtures.tokenizers import build_byte_level_hf

    folder = tmp_path_factory.mktemp("toy-tokenizer")
    build_byte_level_hf().save_pretrained(str(folder))
    return str(folder)


def run_cli(*args: str) -> list[dict[str, Any]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["conformance", *args]) == 0
    return [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]


def test_cli_reads_both_file_formats(tmp_path: Path, toy_tokenizer_dir: str) -> None:
    suite_file = tmp_path / "suite.json"
    suite_file.write_text(
        json.dumps(
            [
                {
                    "description": "strings",
                    "schema": {"type": "string", "maxLength": 2},
                    "tests": [
                        {"description": "ok", "data": "ab", "valid": True},
                        {"description": "long", "data": "abc", "valid": False},
                        {"description": "number", "data": 1, "valid": False},
                    ],
                },
                {
                    "description": "refused: uniqueItems",
                    "schema": {"type": "array", "uniqueItems": True},
                    "tests": [{"description": "dup", "data": [1, 1], "valid": False}],
                },
            ]
        )
    )
    bench = tmp_path / "sub" / "bench.json"
    bench.parent.mkdir()
    bench.write_text(
        json.dumps(
            {
                "description": "bench",
                "meta": {},
                "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
                "tests": [
                    {"description": "ok", "data": {"a": 1}, "valid": True},
                    {"description": "bad", "data": {"a": "x"}, "valid": False},
                ],
            }
        )
    )
    failures = tmp_path / "failures.jsonl"
    rows = run_cli(str(tmp_path), "--tokenizer", toy_tokenizer_dir, "--failures", str(failures))
    summary = rows[-1]
    assert tuple(summary) == SUMMARY_KEYS
    assert summary == {
        **dict.fromkeys(SUMMARY_KEYS, 0),
        "schemas": 3,
        "compiled": 2,
        "refused": 1,
        "tests": 6,
        "passed": 5,
        "false_accept": 0,
        "false_reject": 0,
        "runtime_error": 0,
    }
    assert len(rows) == 3  # one row per file, then the summary
    records = [json.loads(line) for line in failures.read_text().splitlines()]
    assert [r["kind"] for r in records] == ["refused"]
    assert "uniqueItems" in records[0]["detail"]


def test_an_instance_the_matcher_cannot_take_is_counted_not_fatal(
    tmp_path: Path, toy_tokenizer_dir: str
) -> None:
    # a lone surrogate is legal in JSON text but no tokenizer can encode it
    (tmp_path / "s.json").write_text(
        '[{"description": "s", "schema": {"type": "string"}, "tests": ['
        '{"description": "lone", "data": "a\\ud800b", "valid": false},'
        '{"description": "ok", "data": "ab", "valid": true}, "not a test"]}]'
    )
    failures = tmp_path / "failures.jsonl"
    rows = run_cli(str(tmp_path), "--tokenizer", toy_tokenizer_dir, "--failures", str(failures))
    assert rows[-1] == {
        **dict.fromkeys(SUMMARY_KEYS, 0),
        "schemas": 1,
        "compiled": 1,
        "refused": 0,
        "tests": 2,
        "passed": 1,
        "false_accept": 0,
        "false_reject": 0,
        "runtime_error": 1,
    }
    (record,) = [json.loads(line) for line in failures.read_text().splitlines()]
    assert (record["kind"], record["test"]) == ("runtime_error", "lone")


def test_false_rejects_are_counted_by_cause(tmp_path: Path, toy_tokenizer_dir: str) -> None:
    pair = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    (tmp_path / "policies.json").write_text(
        json.dumps(
            [
                {
                    "description": "declared order",
                    "schema": pair,
                    "tests": [
                        {"description": "in order", "data": {"a": 1, "b": "x"}, "valid": True},
                        {"description": "reversed", "data": {"b": "x", "a": 1}, "valid": True},
                    ],
                },
                {
                    "description": "numbers",
                    "schema": {"type": "number", "maximum": 1},
                    "tests": [
                        {"description": "exponent", "data": 1e-07, "valid": True},
                        {"description": "plain", "data": 0.5, "valid": True},
                    ],
                },
                {
                    "description": "format annotation",
                    "schema": {
                        "$schema": "https://json-schema.org/draft/2020-12/schema",
                        "type": "string",
                        "format": "date",
                    },
                    "tests": [{"description": "not a date", "data": "06/19/1963", "valid": True}],
                },
            ]
        )
    )
    failures = tmp_path / "failures.jsonl"
    rows = run_cli(str(tmp_path), "--tokenizer", toy_tokenizer_dir, "--failures", str(failures))
    summary = rows[-1]
    assert (summary["tests"], summary["passed"], summary["false_reject"]) == (5, 2, 3)
    causes = {k: v for k, v in summary.items() if k.startswith("false_reject_") and v}
    assert causes == {
        "false_reject_format": 1,
        "false_reject_number": 1,
        "false_reject_property_order": 1,
    }
    details = [json.loads(line)["detail"] for line in failures.read_text().splitlines()]
    assert sorted(d.split("]")[0] for d in details) == ["[format", "[number", "[property_order"]


def test_a_schema_refused_as_matching_nothing_rejects_every_instance(
    tmp_path: Path, toy_tokenizer_dir: str
) -> None:
    """An empty-language refusal is judged as a grammar that accepts nothing: its invalid
    instances pass, a valid one (a wrong emptiness verdict) is a false reject."""
    (tmp_path / "empty.json").write_text(
        json.dumps(
            [
                {
                    "description": "a required property with no value",
                    "schema": {"type": "object", "properties": {"a": False}, "required": ["a"]},
                    "tests": [
                        {"description": "empty object", "data": {}, "valid": False},
                        {"description": "with a", "data": {"a": 1}, "valid": False},
                    ],
                },
                {
                    "description": "claimed valid",
                    "schema": False,
                    "tests": [{"description": "a number", "data": 1, "valid": True}],
                },
            ]
        )
    )
    summary = run_cli(str(tmp_path), "--tokenizer", toy_tokenizer_dir)[-1]
    assert (summary["compiled"], summary["refused"]) == (2, 0)
    assert (summary["passed"], summary["false_reject"], summary["false_accept"]) == (2, 1, 0)


def test_optional_files_are_skipped_unless_asked(tmp_path: Path) -> None:
    (tmp_path / "optional").mkdir()
    (tmp_path / "a.json").write_text("[]")
    (tmp_path / "optional" / "b.json").write_text("[]")
    assert [p.name for p in find_files(tmp_path)] == ["a.json"]
    assert [p.name for p in find_files(tmp_path, include_optional=True)] == ["a.json", "b.json"]


def test_missing_path_is_an_error() -> None:
    with contextlib.redirect_stderr(io.StringIO()):
        assert main(["conformance", "/no/such/path"]) == 2


def check_ratchet(got: dict[str, int], record: dict[str, int]) -> None:
    assert got["false_accept"] == 0, got
    assert got["tests"] == record["tests"], (got, record)
    assert got["passed"] >= record["passed"], f"regression: {got} < {record}"


@needs_suite
@pytest.mark.parametrize("backend", ["auto", "llguidance", "xgrammar"])
def test_ratchet_ci_subset(backend: str, toy_tokenizer_dir: str) -> None:
    subset = RATCHET["ci_subset"]
    files = [DRAFT / name for name in subset["files"]]
    config = RunConfig(
        backend=backend,
        tokenizer=toy_tokenizer_dir,
        remotes=str(SUITE / "remotes"),
        timeout_s=60.0,  # a loaded CI machine must not turn a slow compile into a refusal
    )
    check_ratchet(total(list(run_files(files, config))), subset["summary"][backend])


@pytest.fixture(scope="module")
def bench_sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ratchet's JSONSchemaBench files, extracted in one pass over the archive."""
    record = RATCHET["jsonschemabench_ci"]
    wanted = {f"jsonschemabench/{name}" for name in record["files"] + record["outlines_core_files"]}
    folder = tmp_path_factory.mktemp("jsonschemabench")
    with tarfile.open(BENCH_TAR, "r|xz") as archive:
        for member in archive:
            if member.isfile() and member.name in wanted:
                archive.extract(member, folder, filter="data")
    return folder / "jsonschemabench"


@needs_bench
@pytest.mark.parametrize("backend", ["auto", "llguidance", "xgrammar", "outlines_core"])
def test_ratchet_jsonschemabench_sample(
    backend: str, bench_sample: Path, toy_tokenizer_dir: str
) -> None:
    record = RATCHET["jsonschemabench_ci"]
    names = record["outlines_core_files" if backend == "outlines_core" else "files"]
    files = [bench_sample / name for name in names]
    assert all(path.is_file() for path in files)
    config = RunConfig(backend=backend, tokenizer=toy_tokenizer_dir, timeout_s=60.0)
    got = total(list(run_files(files, config)))
    print(json.dumps({"backend": backend, **got}))
    check_ratchet(got, record["summary"][backend])


@needs_suite
@pytest.mark.slow
@pytest.mark.model
@pytest.mark.skipif(os.environ.get("ESPALIER_SLOW") != "1", reason="set ESPALIER_SLOW=1")
@pytest.mark.parametrize(
    ("folder", "backend"), [(f, b) for f in DRAFT_FOLDERS for b in RATCHET[f] if b != "comment"]
)
def test_ratchet_full_core(folder: str, backend: str) -> None:
    """Each draft folder with its own meaning (the runner gives it the folder's ``$schema``)."""
    draft = SUITE / folder
    files = find_files(draft)
    remotes = find_remotes(draft)
    tokenizer = str(default_gguf())
    config = RunConfig(tokenizer, backend=backend, remotes=str(remotes) if remotes else None)
    check_ratchet(total(list(run_files(files, config))), RATCHET[folder][backend])
