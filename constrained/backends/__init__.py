"""Registry of grammar backends, each imported lazily from its own module.

``get_backend(BackendName.XGRAMMAR, tokenizer)`` (or its name, ``"xgrammar"``) imports
``constrained/backends/xgrammar/`` only when asked,
so a missing optional library fails with a message naming the pip package, and only for that
backend. Backends are cached per (name, tokenizer fingerprint, options).

Importing this package loads no torch (``common``, which does, is imported on first use): a
compile child that lives in a backend's folder (``outlines_core/index_child.py``) imports it.
"""

from __future__ import annotations

import importlib
import threading
from typing import TYPE_CHECKING, Any

from espalier.constrained.errors import UnknownBackendError
from espalier.constrained.spec import BackendName

if TYPE_CHECKING:
    from espalier.constrained.backends.common import BackendOptions, BackendUnavailableError
    from espalier.constrained.base import GrammarBackend
    from espalier.constrained.tokenizer import TokenizerInfo

BACKENDS: tuple[BackendName, ...] = tuple(BackendName)

# backend -> pip package it needs (its module: espalier.constrained.backends.<name>)
_PACKAGES: dict[BackendName, str] = {
    BackendName.XGRAMMAR: "xgrammar",
    BackendName.LLGUIDANCE: "llguidance",
    BackendName.OUTLINES_CORE: "outlines-core",
}

_CACHE: dict[tuple[str, str, BackendOptions], GrammarBackend] = {}
_LOCK = threading.Lock()


def get_backend(
    name: str, tokenizer: TokenizerInfo, options: BackendOptions | None = None
) -> GrammarBackend:
    """The backend ``name`` bound to ``tokenizer``; built once per (name, tokenizer, options)."""
    from espalier.constrained.backends.common import BackendOptions, BackendUnavailableError

    if name not in _PACKAGES:
        raise UnknownBackendError(name, [str(b) for b in BACKENDS])
    options = options or BackendOptions()
    key = (name, tokenizer.fingerprint, options)
    with _LOCK:
        backend = _CACHE.get(key)
    if backend is not None:
        return backend
    backend_name = BackendName(name)
    package = _PACKAGES[backend_name]
    try:
        module = importlib.import_module(f"{__name__}.{backend_name.value}")
    except ImportError as exc:
        raise BackendUnavailableError(backend_name, package, str(exc)) from exc
    built: GrammarBackend = module.Backend(tokenizer, options)
    with _LOCK:
        return _CACHE.setdefault(key, built)


def __getattr__(name: str) -> Any:
    """``BackendOptions`` and ``BackendUnavailableError``, from ``common`` on first use."""
    if name in ("BackendOptions", "BackendUnavailableError"):
        from espalier.constrained.backends import common

        return getattr(common, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def clear_backend_cache() -> None:
    """Forget every built backend (tests; tokenizer reloads)."""
    with _LOCK:
        _CACHE.clear()


__all__ = [
    "BACKENDS",
    "BackendName",
    "BackendOptions",
    "BackendUnavailableError",
    "clear_backend_cache",
    "get_backend",
]
