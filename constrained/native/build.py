"""Compile a C helper of this folder into a shared library, once, cached by source hash.

The library lands in ``<cache root>/native/<name>-<hash>.so`` (``constrained/tokenizer.py``'s
cache folder). It is built with the system C compiler (``cc``, else ``gcc``) into a temporary file
and renamed into place, so processes that race (e.g. compile probes) never load a partial file.
No compiler, or a failed build: :func:`build_library` returns ``None`` and says why in
:func:`last_error`; callers fall back to their Python paths.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from espalier.constrained.tokenizer import cache_root

CFLAGS = ("-O2", "-shared", "-fPIC", "-pthread", "-std=c11", "-D_POSIX_C_SOURCE=200809L")
BUILD_TIMEOUT_S = 120.0

_lock = threading.Lock()
_built: dict[str, Path | None] = {}
_errors: dict[str, str] = {}


def find_compiler() -> str | None:
    """The C compiler helpers are built with (``cc``, else ``gcc``), or None."""
    return shutil.which("cc") or shutil.which("gcc")


def source_path(name: str) -> Path:
    """The C source ``name`` (e.g. ``"llg_walk.c"``) shipped in this folder."""
    return Path(__file__).with_name(name)


def build_library(name: str) -> Path | None:
    """The compiled library of ``name`` (built on first call per process), or None."""
    with _lock:
        if name in _built:
            return _built[name]
        path: Path | None = None
        try:
            path = _build(name)
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            _errors[name] = str(exc)
        _built[name] = path
        return path


def last_error(name: str) -> str | None:
    """Why :func:`build_library` returned None for ``name`` (None if it did not)."""
    return _errors.get(name)


def _build(name: str) -> Path:
    source = source_path(name)
    text = source.read_bytes()
    compiler = find_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    tag = hashlib.sha256(text + " ".join(CFLAGS).encode() + sys.platform.encode()).hexdigest()
    folder = cache_root() / "native"
    target = folder / f"{Path(name).stem}-{tag[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        run = subprocess.run(
            [compiler, *CFLAGS, "-o", tmp, str(source)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if run.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {name}: {run.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
