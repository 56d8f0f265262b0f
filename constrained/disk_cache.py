"""On-disk cache of compiled xgrammar grammars, so compiles survive a restart.

xgrammar precomputes token masks at compile time (seconds for a large schema on a 262k vocabulary);
llguidance and outlines-core are not stored: llguidance compiles lazily in milliseconds, and an
outlines-core Index has no serialization in its Python API. The file holds xgrammar's own
``CompiledGrammar.serialize_json`` text (without the tokenizer, which xgrammar checks again by its
metadata when loading) and the compile report.

One JSON file per grammar under ``directory``, named by the SHA-256 of its identity: the compile
cache key (spec, backend request, tokenizer fingerprint, options), the backend options, the
xgrammar version and :data:`FORMAT`. The file repeats the identity and a checksum of the
xgrammar text, and is used only when both match; anything else (a corrupt, truncated, foreign
or other-version file, an xgrammar load error) is a miss, and the bad file is removed. The
directory is bounded to ``max_bytes``: after a store, the least recently used files (by mtime;
a hit touches its file) are removed. Writes go to a temporary file renamed into place, so
readers never see half a file. Nothing here raises to the caller: disk trouble is logged and
counted.
"""

from __future__ import annotations

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
from espalier.constrained.spec import GrammarKind, GrammarSpec

if TYPE_CHECKING:
    from espalier.constrained.backends.common import BackendOptions
    from espalier.constrained.tokenizer import TokenizerInfo

log = logging.getLogger(__name__)

FORMAT = 1
"""Version of the file layout below; bump it when the layout or the report changes."""

STORED_BACKEND = "xgrammar"
_NAME = re.compile(r"^[0-9a-f]{64}\.json$")


@dataclass(frozen=True)
class DiskCacheConfig:
    """directory: where the files live (created if missing). max_bytes: bound on the files'
    total size; a single grammar larger than it is not stored."""

    directory: str
    max_bytes: int = 512 << 20


@dataclass
class DiskCacheStats:
    """Monotonic counters."""

    hits: int = 0
    misses: int = 0
    stores: int = 0
    bad_files: int = 0
    evictions: int = 0
    errors: int = 0


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

    def identity(self, key: Any) -> str:
        """The text a file must repeat to be used for ``key`` (the compile cache's key)."""
        return repr((FORMAT, self.xgrammar_version, repr(self.options), repr(key)))

    def path(self, key: Any) -> Path:
        digest = hashlib.sha256(self.identity(key).encode("utf-8")).hexdigest()
        return self.directory / f"{digest}.json"

    def load(self, key: Any) -> tuple[CompiledGrammar, CompileReport] | None:
        """The stored grammar for ``key`` with a report saying ``cache_hit`` (``compile_seconds``:
        the load time); None on a miss, a bad file included."""
        start = time.perf_counter()
        path = self.path(key)
        try:
            if path.stat().st_size > self.config.max_bytes:
                raise ValueError("file larger than the cache bound")
            data = json.loads(path.read_bytes())
            result = self._rebuild(data, self.identity(key), start)
        except FileNotFoundError:
            self.stats.misses += 1
            return None
        except Exception as exc:  # any bad file is a miss, never a crash
            log.warning("grammar disk cache: ignoring bad file %s: %s", path.name, exc)
            self.stats.bad_files += 1
            self.stats.misses += 1
            self._remove(path)
            return None
        self.stats.hits += 1
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: evicted last
        return result

    def store(self, key: Any, result: tuple[CompiledGrammar, CompileReport]) -> None:
        """Write ``result`` for ``key`` if xgrammar compiled it; then trim the directory."""
        from espalier.constrained.backends.xgrammar import CompiledGrammar as XgrCompiled

        compiled, report = result
        if not isinstance(compiled, XgrCompiled) or report.cache_hit:
            return
        try:
            native = compiled.native.serialize_json()
            payload = json.dumps(
                {
                    "identity": self.identity(key),
                    "spec": {"kind": compiled.spec.kind.value, "source": compiled.spec.source},
                    "report": {
                        "weakened": [asdict(issue) for issue in report.weakened],
                        "cache_key": report.cache_key,
                        "notes": list(report.notes),
                    },
                    "digest": hashlib.sha256(native.encode("utf-8")).hexdigest(),
                    "compiled": native,
                }
            ).encode("utf-8")
            if len(payload) > self.config.max_bytes:
                return
            path = self.path(key)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(payload)
            os.replace(tmp, path)
        except Exception as exc:  # a full disk or a read-only directory: serve on, uncached
            log.warning("grammar disk cache: cannot store: %s", exc)
            self.stats.errors += 1
            return
        self.stats.stores += 1
        self._trim()

    # -- internals ------------------------------------------------------------------------------

    def _rebuild(
        self, data: dict[str, Any], identity: str, start: float
    ) -> tuple[CompiledGrammar, CompileReport]:
        import xgrammar

        from espalier.constrained.backends import get_backend
        from espalier.constrained.backends.xgrammar import CompiledGrammar as XgrCompiled

        if data["identity"] != identity:
            raise ValueError("identity mismatch (a foreign file or a hash collision)")
        text = str(data["compiled"])
        if hashlib.sha256(text.encode("utf-8")).hexdigest() != data["digest"]:
            raise ValueError("checksum mismatch (a damaged file)")
        spec = GrammarSpec(GrammarKind(data["spec"]["kind"]), str(data["spec"]["source"]))
        backend: Any = get_backend(STORED_BACKEND, self.tokenizer, self.options)
        native = xgrammar.CompiledGrammar.deserialize_json(text, backend.tokenizer_info)
        stored = data["report"]
        report = CompileReport(
            backend=STORED_BACKEND,
            weakened=tuple(KeywordIssue(**issue) for issue in stored["weakened"]),
            compile_seconds=time.perf_counter() - start,
            cache_hit=True,
            cache_key=str(stored["cache_key"]),
            notes=tuple(str(n) for n in stored["notes"]),
        )
        return XgrCompiled(spec, self.tokenizer, backend.facts, native), report

    def _trim(self) -> None:
        """Remove least recently used files until the directory fits ``max_bytes``."""
        with self._lock:
            files = []
            try:
                for entry in os.scandir(self.directory):
                    if _NAME.match(entry.name) and entry.is_file():
                        st = entry.stat()
                        files.append((st.st_mtime, st.st_size, Path(entry.path)))
            except OSError as exc:
                log.warning("grammar disk cache: cannot list %s: %s", self.directory, exc)
                return
            total = sum(size for _, size, _ in files)
            for _, size, path in sorted(files, key=lambda f: f[0]):
                if total <= self.config.max_bytes:
                    break
                self._remove(path)
                self.stats.evictions += 1
                total -= size

    def _remove(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("grammar disk cache: cannot remove %s: %s", path.name, exc)
