"""Conformance runner: does a compiled grammar accept exactly the valid instances of a schema?

Reads JSON-Schema-Test-Suite files (a list of ``{schema, tests: [{data, valid}]}``) and
JSONSchemaBench / MaskBench files (``{schema, tests: [...]}``). Per schema: compile in strict mode;
per test instance: serialise with ``json.dumps(data, ensure_ascii=False)`` (``ensure_ascii=True``
would turn every non-ASCII character into ``\\uXXXX``, which backends accept unevenly — llguidance
rejects escaped surrogate pairs — so a valid instance would be rejected for its spelling), tokenize,
push the tokens through a fresh matcher and accept a stop token. Classification:

- ``passed``: valid and accepted to a terminating state, or invalid and rejected;
- ``false_accept``: invalid but accepted (the number that must stay 0);
- ``false_reject``: valid but rejected, counted again by cause (``false_reject_<cause>``,
  :mod:`false_rejects`): ``format``, ``number``, ``property_order`` and ``whitespace`` are
  generation policies (asserted formats, number spelling and bounds, declared property order,
  bounded whitespace); ``other`` is a defect;
- ``runtime_error``: the matcher raised on the instance (a backend's runtime limit, e.g.
  llguidance's parser row limit, or a bug): counted, not passed, never a crash of the run.
A schema the backend refuses counts all its tests as not passed, with the reason.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from espalier.constrained.errors import EmptyLanguageError
from espalier.constrained.false_rejects import CAUSES

if TYPE_CHECKING:
    import referencing

    from espalier.constrained.tokenizer import TokenizerInfo

DIALECT_BY_FOLDER = {
    "draft7": "http://json-schema.org/draft-07/schema#",
    "draft2019-09": "https://json-schema.org/draft/2019-09/schema",
    "draft2020-12": "https://json-schema.org/draft/2020-12/schema",
}
SUMMARY_KEYS = (
    "schemas",
    "compiled",
    "refused",
    "tests",
    "passed",
    "false_accept",
    "false_reject",
    "runtime_error",
    *(f"false_reject_{cause}" for cause in CAUSES),
)


@dataclass
class FileResult:
    """Counts for one file; ``failures`` lists (kind, case, test, detail) for reports."""

    path: str
    schemas: int = 0
    compiled: int = 0
    refused: int = 0
    tests: int = 0
    passed: int = 0
    false_accept: int = 0
    false_reject: int = 0
    runtime_error: int = 0
    false_reject_format: int = 0
    false_reject_number: int = 0
    false_reject_property_order: int = 0
    false_reject_whitespace: int = 0
    false_reject_other: int = 0
    seconds: float = 0.0
    backends: dict[str, int] = field(default_factory=dict)
    failures: list[tuple[str, str, str, str]] = field(default_factory=list)

    def summary(self) -> dict[str, int]:
        return {k: int(getattr(self, k)) for k in SUMMARY_KEYS}


@dataclass(frozen=True)
class RunConfig:
    tokenizer: str  # a Hugging Face directory or a .gguf file (the CLI resolves its default)
    backend: str = "auto"
    remotes: str | None = None  # folder served at http://localhost:1234/
    timeout_s: float = 10.0


def find_files(path: str | Path, include_optional: bool = False) -> list[Path]:
    """The ``*.json`` files under ``path`` (or ``path`` itself), sorted; ``optional/`` skipped."""
    path = Path(path)
    if path.is_file():
        return [path]
    skip = {"optional"} if not include_optional else set()
    return sorted(
        p
        for p in path.rglob("*.json")
        if not skip & set(p.relative_to(path).parts[:-1]) and p.name not in ("manifest.json",)
    )


def interleave(files: list[Path], root: Path) -> list[Path]:
    """Round-robin over the first-level subfolders, so that any prefix is a fair sample."""
    groups: dict[str, list[Path]] = {}
    for path in files:
        parts = path.relative_to(root).parts if path != root else (path.name,)
        groups.setdefault(parts[0] if len(parts) > 1 else "", []).append(path)
    out: list[Path] = []
    queues = list(groups.values())
    for i in range(max((len(q) for q in queues), default=0)):
        out.extend(q[i] for q in queues if i < len(q))
    return out


def iter_cases(path: Path) -> Iterator[tuple[str, Any, list[dict[str, Any]]]]:
    """``(description, schema, tests)`` of one file in either format; nothing for other files."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    cases = data if isinstance(data, list) else [data]
    for i, case in enumerate(cases):
        if isinstance(case, dict) and "schema" in case and isinstance(case.get("tests"), list):
            tests = [t for t in case["tests"] if isinstance(t, dict)]
            yield str(case.get("description", i)), case["schema"], tests


def default_dialect(path: Path) -> str | None:
    for part in reversed(path.parts):
        if part in DIALECT_BY_FOLDER:
            return DIALECT_BY_FOLDER[part]
    return None


def find_remotes(path: Path) -> Path | None:
    """The test suite's ``remotes/`` folder next to a draft folder, if any."""
    for parent in [path, *path.parents]:
        candidate = parent / "remotes"
        if candidate.is_dir() and parent.joinpath("draft2020-12").exists():
            return candidate
    return None


class Runner:
    """Runs files against one backend choice; holds the tokenizer and the remote registry."""

    def __init__(self, config: RunConfig) -> None:
        from espalier.constrained.cache import CompileCache

        self.config = config
        self.tokenizer = _load_tokenizer(config.tokenizer)
        self.registry = _registry(config.remotes)
        self.cache = CompileCache(timeout_s=config.timeout_s, max_bytes=256 << 20)
        self._warm_up()

    def _warm_up(self) -> None:
        """The one-time compile costs now, outside the compile time limit (:func:`warm_up`)."""
        from espalier.constrained.compile import warm_up

        warm_up(self.tokenizer, self.config.backend)

    def run_file(self, path: Path) -> FileResult:
        result = FileResult(str(path))
        start = time.perf_counter()
        dialect = default_dialect(path)
        for description, schema, tests in iter_cases(path):
            if dialect and isinstance(schema, dict) and "$schema" not in schema:
                schema = {"$schema": dialect, **schema}
            self._run_case(result, description, schema, tests)
        result.seconds = time.perf_counter() - start
        return result

    def _run_case(
        self, result: FileResult, description: str, schema: Any, tests: list[Any]
    ) -> None:
        result.schemas += 1
        result.tests += len(tests)
        try:
            compiled = self._compile(schema)
        except EmptyLanguageError:  # refused as matching nothing: every test is judged on that
            result.compiled += 1
            result.backends["empty"] = result.backends.get("empty", 0) + 1
            for test in tests:
                if test.get("valid"):  # the emptiness check was wrong: the worst kind of bug
                    result.false_reject += 1
                    result.false_reject_other += 1
                    text = serialize(test.get("data"))[:200]
                    name = str(test.get("description", ""))
                    result.failures.append(("false_reject", description, name, f"[empty] {text}"))
                else:
                    result.passed += 1
            return
        except Exception as exc:  # a GrammarError, or a bug: reported as a refusal, never a crash
            result.refused += 1
            result.failures.append(("refused", description, "", _describe(exc)))
            return
        result.compiled += 1
        result.backends[compiled.backend] = result.backends.get(compiled.backend, 0) + 1
        for test in tests:
            valid = bool(test.get("valid"))
            try:
                accepted = self.accepts(compiled, test.get("data"))
            except Exception as exc:  # a runtime limit of the backend, or a bug: counted
                result.runtime_error += 1
                name = str(test.get("description", ""))
                result.failures.append(("runtime_error", description, name, _describe(exc)))
                continue
            if accepted == valid:
                result.passed += 1
                continue
            kind = "false_accept" if accepted else "false_reject"
            setattr(result, kind, getattr(result, kind) + 1)
            text = serialize(test.get("data"))[:200]
            if not accepted:
                cause = self._cause(compiled, schema, test.get("data"))
                setattr(result, kind + "_" + cause, getattr(result, kind + "_" + cause) + 1)
                text = f"[{cause}] {text}"
            result.failures.append((kind, description, str(test.get("description", "")), text))

    def _cause(self, compiled: Any, schema: Any, data: Any) -> str:
        """Why a valid instance was rejected (:mod:`false_rejects`); "other" when that fails."""
        from espalier.constrained.false_rejects import false_reject_cause

        try:
            return false_reject_cause(
                lambda text: grammar_accepts(compiled, self.tokenizer, text),
                schema,
                data,
                self.registry,
            )
        except Exception:  # a matcher limit while retrying: no policy found
            return "other"

    def _compile(self, schema: Any) -> Any:
        from espalier.constrained.cache import CacheKey
        from espalier.constrained.compile import compile_grammar
        from espalier.constrained.spec import GrammarSpec

        spec = GrammarSpec.json_schema(schema)
        key = CacheKey(spec.cache_key, self.config.backend, self.tokenizer.fingerprint, ("strict",))
        compiled, _ = self.cache.get(
            key,
            lambda: compile_grammar(
                spec, self.tokenizer, self.config.backend, registry=self.registry
            ),
        )
        return compiled

    def accepts(self, compiled: Any, data: Any) -> bool:
        """Whether the grammar accepts ``json.dumps(data)`` followed by a stop token."""
        return grammar_accepts(compiled, self.tokenizer, serialize(data))


def _describe(exc: BaseException) -> str:
    """One line naming the exception; ``internal error`` marks what is not a GrammarError."""
    from espalier.constrained.errors import GrammarError

    internal = "" if isinstance(exc, GrammarError) else "internal error "
    return f"{internal}{type(exc).__name__}: {(str(exc) or '-').splitlines()[0][:300]}"


def serialize(data: Any) -> str:
    """The text a test instance is checked as (see the module docstring)."""
    return json.dumps(data, ensure_ascii=False)


def grammar_accepts(compiled: Any, tokenizer: TokenizerInfo, text: str) -> bool:
    """Whether a fresh matcher, wrapped as the engine wraps it (no repeated keys, unique items
    where the schema wants them), accepts the tokens of ``text`` and then a stop token."""
    from espalier.constrained.keys import with_unique_keys

    matcher = with_unique_keys(compiled.spec, compiled.matcher(), tokenizer)
    for token in tokenizer.encode_text(text):
        if not matcher.accept(token):
            return False
    return bool(matcher.can_terminate()) and bool(matcher.accept(tokenizer.stop_token_ids[0]))


def total(results: list[FileResult]) -> dict[str, int]:
    out = dict.fromkeys(SUMMARY_KEYS, 0)
    for r in results:
        for k in SUMMARY_KEYS:
            out[k] += getattr(r, k)
    return out


def result_row(result: FileResult) -> dict[str, Any]:
    row = asdict(result)
    row.pop("failures")
    row["seconds"] = round(result.seconds, 3)
    return row


_WORKER: Runner | None = None


def _init_worker(config: RunConfig) -> None:
    global _WORKER
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    _WORKER = Runner(config)


def _run_in_worker(path: str) -> FileResult:
    assert _WORKER is not None
    return _WORKER.run_file(Path(path))


def run_files(files: list[Path], config: RunConfig, jobs: int = 1) -> Iterator[FileResult]:
    """Results per file, in order; ``jobs > 1`` spreads files over worker processes."""
    if jobs <= 1:
        runner = Runner(config)
        for path in files:
            yield runner.run_file(path)
        return
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with context.Pool(jobs, initializer=_init_worker, initargs=(config,)) as pool:
        yield from pool.imap(_run_in_worker, [str(p) for p in files], chunksize=4)


def _load_tokenizer(source: str) -> TokenizerInfo:
    from espalier.constrained.tokenizer import TokenizerInfo

    if source.endswith(".gguf"):
        return TokenizerInfo.from_gguf(source)
    return TokenizerInfo.from_pretrained(source)


def _registry(remotes: str | None) -> referencing.Registry[Any] | None:
    if remotes is None:
        return None
    from espalier.constrained.schema.refs import directory_registry

    return directory_registry(remotes)
