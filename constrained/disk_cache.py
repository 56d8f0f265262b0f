"""On-disk cache of compiled xgrammar grammars, so compiles survive a restart.

xgrammar precomputes token masks at compile time (seconds for a large schema on a 262k vocabulary);
llguidance and outlines-core are not stored: llguidance compiles lazily in milliseconds, and an
outlines-core Index has no serialization in its Python API. The file holds xgrammar's own
``CompiledGrammar.serialize_json`` text (without the tokenizer, which xgrammar checks again by its
metadata when loading) and the compile report. A load needs no ``Backend`` (no compiler, no
compile child processes): only xgrammar's view of the vocabulary, built once per tokenizer when
the cache is made (on its writer thread), and the file. Then, on the same thread, the most
recently used files of this tokenizer (and xgrammar version, backend options, layout: the
header's ``scope``) are deserialized ahead, newest first, up to ``preload_bytes`` of files, so
the first request of such a grammar after a restart costs a dictionary look-up; others pay their
file's deserialization (xgrammar's JSON, ~0.1 s per MB). A preloaded grammar is handed out once
(the compile cache keeps it from then on); files of another scope are left alone.

One file per grammar under ``directory`` (a JSON header line, then xgrammar's JSON text), named by
the SHA-256 of its identity: the compile cache key (spec, backend request, tokenizer fingerprint,
options), the backend options, the xgrammar version and :data:`FORMAT`. The file repeats the
identity and a checksum of the xgrammar text, and is used only when both match; anything else (a
corrupt, truncated, foreign or other-version file, an xgrammar load error) is a miss, and the bad
file is removed. The directory is bounded to ``max_bytes``: after a store, the least recently used
files (by mtime; a hit touches its file) are removed. Writes go to a temporary file renamed into
place, so readers never see half a file. Nothing here raises to the caller: disk trouble is logged
and counted.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from espalier.constrained.base import CompiledGrammar, CompileReport
from espalier.constrained.errors import KeywordIssue
from espalier.constrained.spec import BackendName, GrammarKind, GrammarSpec

if TYPE_CHECKING:
    from espalier.constrained.backends.common import BackendOptions
    from espalier.constrained.tokenizer import TokenizerInfo

log = logging.getLogger(__name__)

FORMAT = 6
"""Version of the file layout below; bump it when the layout, the report or a spec's
translation changes (6: GBNF respelled for xgrammar, ``backends/xgrammar/gbnf.py``)."""

STORED_BACKEND = BackendName.XGRAMMAR
SUFFIX = ".xgrammar"
_NAME = re.compile(r"^[0-9a-f]{64}\.xgrammar$")


@dataclass(frozen=True)
class DiskCacheConfig:
    """directory: where the files live (created if missing). max_bytes: bound on the files'
    total size; a single grammar larger than it is not stored. preload_bytes: files loaded ahead
    when the cache is made (module docstring); 0: none."""

    directory: str
    max_bytes: int = 512 << 20
    preload_bytes: int = 64 << 20


@dataclass
class DiskCacheStats:
    """Monotonic counters."""

    hits: int = 0
    misses: int = 0
    stores: int = 0
    bad_files: int = 0
    evictions: int = 0
    errors: int = 0
    preloaded: int = 0  # grammars loaded ahead
    preloaded_hits: int = 0  # hits served by them


class GrammarDiskCache:
    """Load and store compiled xgrammar grammars of one tokenizer; thread-safe."""

    def __init__(
        self,
        config: DiskCacheConfig,
        tokenizer: TokenizerInfo,
        options: BackendOptions | None = None,
    ) -> None:
        from espalier.constrained.backends.common import BackendOptions

        self.config = config
        self.tokenizer = tokenizer
        self.options = options or BackendOptions()
        self.directory = Path(config.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.xgrammar_version = importlib.metadata.version("xgrammar")
        self.stats = DiskCacheStats()
        self._lock = threading.Lock()
        self._trim_lock = threading.Lock()
        # one writer: serializing a grammar takes ~0.1 s per MB (xgrammar drops the GIL)
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "espalier-grammar-disk")
        self._pending: list[concurrent.futures.Future[None]] = []
        self.scope = repr(
            (FORMAT, self.xgrammar_version, repr(self.options), tokenizer.fingerprint)
        )
        self._ready: dict[str, tuple[dict[str, Any], Any]] = {}  # file name -> (header, native)
        self._closing = threading.Event()
        # xgrammar's view of the vocabulary (a second for 262k ids) is built now, off the caller's
        # thread, so no load after a restart pays it; then the recent files are loaded ahead
        self._pending.append(self._writer.submit(self._prepare_vocabulary))
        if config.preload_bytes > 0:
            self._pending.append(self._writer.submit(self._preload))

    def identity(self, key: Any) -> str:
        """The text a file must repeat to be used for ``key`` (the compile cache's key)."""
        return repr((FORMAT, self.xgrammar_version, repr(self.options), repr(key)))

    def path(self, key: Any) -> Path:
        digest = hashlib.sha256(self.identity(key).encode("utf-8")).hexdigest()
        return self.directory / f"{digest}{SUFFIX}"

    def load(self, key: Any) -> tuple[CompiledGrammar, CompileReport] | None:
        """The stored grammar for ``key`` with a report saying ``cache_hit`` (``compile_seconds``:
        the load time); None on a miss, a bad file included."""
        start = time.perf_counter()
        path, identity = self.path(key), self.identity(key)
        with self._lock:
            ready = self._ready.pop(path.name, None)
        try:
            if ready is not None and ready[0]["identity"] == identity:
                result = self._result(ready[0], ready[1], start)
                self.stats.preloaded_hits += 1
            else:  # not preloaded (or, with another identity, read again and refused)
                header, body = self._read(path)
                if header["identity"] != identity:
                    raise ValueError("identity mismatch (a foreign file or a hash collision)")
                result = self._result(header, self._native(header, body), start)
        except FileNotFoundError:
            self.stats.misses += 1
            return None
        except Exception as exc:  # any bad file is a miss, never a crash
            self._bad(path, exc)
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: evicted last
        return result

    def store(self, key: Any, result: tuple[CompiledGrammar, CompileReport]) -> None:
        """Write ``result`` for ``key`` if xgrammar compiled it, on the writer thread (the
        caller does not wait for the serialization: ~0.1 s per MB of grammar); then trim."""
        from espalier.constrained.backends.xgrammar import CompiledGrammar as XgrCompiled

        compiled, report = result
        if not isinstance(compiled, XgrCompiled) or report.cache_hit:
            return
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._writer.submit(self._write, key, compiled, report))

    def flush(self) -> None:
        """Wait until every store so far is on disk (or failed)."""
        with self._lock:
            pending, self._pending = self._pending, []
        concurrent.futures.wait(pending)

    def close(self) -> None:
        self._closing.set()  # a preload in progress stops at its next file
        self.flush()
        self._writer.shutdown(wait=True)

    # -- internals ------------------------------------------------------------------------------

    def _prepare_vocabulary(self) -> None:
        from espalier.constrained.backends.xgrammar import tokenizer_info

        try:
            tokenizer_info(self.tokenizer)
        except Exception as exc:  # the first load builds it again and reports its own trouble
            log.warning("grammar disk cache: cannot prepare the vocabulary: %s", exc)

    def _write(self, key: Any, compiled: Any, report: CompileReport) -> None:
        try:
            body = compiled.native.serialize_json().encode("utf-8")
            header = {
                "scope": self.scope,
                "identity": self.identity(key),
                "spec": {"kind": compiled.spec.kind.value, "source": compiled.spec.source},
                "report": {
                    "weakened": [asdict(issue) for issue in report.weakened],
                    "cache_key": report.cache_key,
                    "notes": list(report.notes),
                },
                "digest": hashlib.sha256(body).hexdigest(),
            }
            head = json.dumps(header, ensure_ascii=True).encode("ascii")
            if len(head) + 1 + len(body) > self.config.max_bytes:
                return
            path = self.path(key)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            with open(tmp, "wb") as f:
                f.write(head + b"\n")
                f.write(body)
            os.replace(tmp, path)
        except Exception as exc:  # a full disk or a read-only directory: serve on, uncached
            log.warning("grammar disk cache: cannot store: %s", exc)
            self.stats.errors += 1
            return
        self.stats.stores += 1
        self._trim()

    def _preload(self) -> None:
        """Deserialize this scope's most recently used files, newest first, within
        ``preload_bytes``; bad ones are removed as a load would."""
        budget = self.config.preload_bytes
        for _, size, path in sorted(self._listing(), key=lambda f: -f[0]):
            if self._closing.is_set():
                return
            if size > budget:
                continue
            try:
                header, body = self._read(path)
                if header.get("scope") != self.scope:
                    continue  # another tokenizer's, version's or options': not ours to judge
                native = self._native(header, body)
            except FileNotFoundError:
                continue
            except Exception as exc:
                self._bad(path, exc)
                continue
            budget -= size
            with self._lock:
                self._ready[path.name] = (header, native)
            self.stats.preloaded += 1

    def _read(self, path: Path) -> tuple[dict[str, Any], bytes]:
        """The header (a JSON object) and the xgrammar text of ``path``; raises on a bad file."""
        if path.stat().st_size > self.config.max_bytes:
            raise ValueError("file larger than the cache bound")
        head, newline, body = path.read_bytes().partition(b"\n")
        if not newline:
            raise ValueError("no header line")
        header = json.loads(head)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        return header, body

    def _native(self, header: dict[str, Any], body: bytes) -> Any:
        """The ``xgrammar.CompiledGrammar`` of a file whose checksum holds."""
        from espalier.constrained.backends.xgrammar import deserialize_compiled, tokenizer_info

        if hashlib.sha256(body).hexdigest() != header["digest"]:
            raise ValueError("checksum mismatch (a damaged file)")
        # no Backend: a load needs neither xgrammar's compiler nor its child processes
        return deserialize_compiled(body, tokenizer_info(self.tokenizer))

    def _result(
        self, header: dict[str, Any], native: Any, start: float
    ) -> tuple[CompiledGrammar, CompileReport]:
        from espalier.constrained.backends.common import vocab_facts
        from espalier.constrained.backends.xgrammar import CompiledGrammar as XgrCompiled

        spec = GrammarSpec(GrammarKind(header["spec"]["kind"]), str(header["spec"]["source"]))
        stored = header["report"]
        report = CompileReport(
            backend=STORED_BACKEND,
            weakened=tuple(KeywordIssue(**issue) for issue in stored["weakened"]),
            compile_seconds=time.perf_counter() - start,
            cache_hit=True,
            cache_key=str(stored["cache_key"]),
            notes=tuple(str(n) for n in stored["notes"]),
        )
        return XgrCompiled(spec, self.tokenizer, vocab_facts(self.tokenizer), native), report

    def _listing(self) -> list[tuple[float, int, Path]]:
        """``(mtime, size, path)`` of each cache file; empty when the directory cannot be read."""
        files = []
        try:
            for entry in os.scandir(self.directory):
                if _NAME.match(entry.name) and entry.is_file():
                    st = entry.stat()
                    files.append((st.st_mtime, st.st_size, Path(entry.path)))
        except OSError as exc:
            log.warning("grammar disk cache: cannot list %s: %s", self.directory, exc)
        return files

    def _trim(self) -> None:
        """Remove least recently used files until the directory fits ``max_bytes``."""
        with self._trim_lock:
            files = self._listing()
            total = sum(size for _, size, _ in files)
            for _, size, path in sorted(files, key=lambda f: f[0]):
                if total <= self.config.max_bytes:
                    break
                self._remove(path)
                self.stats.evictions += 1
                total -= size

    def _bad(self, path: Path, exc: Exception) -> None:
        """Remove a bad file; counted once even when a preload and a load both found it."""
        if self._remove(path):
            log.warning("grammar disk cache: removed bad file %s: %s", path.name, exc)
            self.stats.bad_files += 1

    def _remove(self, path: Path) -> bool:
        """Whether this call removed ``path``."""
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("grammar disk cache: cannot remove %s: %s", path.name, exc)
            return False
        return True
