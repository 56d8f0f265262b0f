"""Registry of grammar backends, each imported lazily from its own module.

``get_backend("xgrammar", tokenizer)`` imports ``constrained/backends/xgrammar.py`` only when asked,
so a missing optional library fails with a message naming the pip package, and only for that
backend. Backends are cached per (name, tokenizer fingerprint, options).
"""

from __future__ import annotations

import importlib
import threading
from typing import TYPE_CHECKING

from espalier.constrained.backends.common import BackendOptions, BackendUnavailableError
from espalier.constrained.errors import UnknownBackendError

if TYPE_CHECKING:
    from espalier.constrained.base import GrammarBackend
    from espalier.constrained.tokenizer import TokenizerInfo

BACKENDS: tuple[str, ...] = ("xgrammar", "llguidance", "outlines_core")

# backend name -> (module under espalier.constrained.backends, pip package it needs)
_MODULES: dict[str, tuple[str, str]] = {
    "xgrammar": ("espalier.constrained.backends.xgrammar", "xgrammar"),
    "llguidance": ("espalier.constrained.backends.llguidance", "llguidance"),
    "outlines_core": ("espalier.constrained.backends.outlines_core", "outlines-core"),
}

_CACHE: dict[tuple[str, str, BackendOptions], GrammarBackend] = {}
_LOCK = threading.Lock()


def get_backend(
    name: str, tokenizer: TokenizerInfo, options: BackendOptions | None = None
) -> GrammarBackend:
    """The backend ``name`` bound to ``tokenizer``; built once per (name, tokenizer, options)."""
    if name not in _MODULES:
        raise UnknownBackendError(name, list(BACKENDS))
    options = options or BackendOptions()
    key = (name, tokenizer.fingerprint, options)
    with _LOCK:
        backend = _CACHE.get(key)
    if backend is not None:
        return backend
    module_name, package = _MODULES[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(name, package, str(exc)) from exc
    built: GrammarBackend = module.Backend(tokenizer, options)
    with _LOCK:
        return _CACHE.setdefault(key, built)


def clear_backend_cache() -> None:
    """Forget every built backend (tests; tokenizer reloads)."""
    with _LOCK:
        _CACHE.clear()


__all__ = [
    "BACKENDS",
    "BackendOptions",
    "BackendUnavailableError",
    "clear_backend_cache",
    "get_backend",
]
