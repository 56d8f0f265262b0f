"""llguidance's C API through ctypes, and the native draft-tree walk (``llg_walk.c``).

The llguidance wheel's library exports the C API (``llg_new_tokenizer_v2``, ``llg_new_matcher``,
``llg_clone_matcher``, ``llg_matcher_compute_mask_into``, ...). Every request's llguidance
matcher is one (``backends/llguidance/__init__.py``); the Python ``LLMatcher`` only checks
grammars at compile time. Built from the same token bytes, special ids, stop ids and grammar
text, the two compute the same masks (checked by the tree oracle tests). The
walk in ``llg_walk.c`` drives such matchers for a whole tree in one ctypes call, which drops the
GIL for its whole length: trees of a batch fill in parallel on as many threads as there are
cores, with no per-node Python.

Lifetimes: a :class:`NativeMatcher` keeps its :class:`NativeTokenizer` alive and frees its C
matcher when collected, on :data:`RELEASER`'s thread; the tokenizer keeps its token buffers and
tokenize callback alive.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.metadata
import os
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from espalier.constrained import bitmask as bm

WALK_DONE, WALK_BUDGET_HIT = 0, 1
ROOT_COMPUTE, ROOT_READY = 0, 1
ERROR_BYTES = 1024

_TokenizeFn = ctypes.CFUNCTYPE(
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_uint8),
    ctypes.c_size_t,
    ctypes.POINTER(ctypes.c_uint32),
    ctypes.c_size_t,
)


class _WalkApi(ctypes.Structure):
    """``EspLlgApi`` of ``llg_walk.c``: the llguidance functions the walk calls."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "consume",
            "consume_many",
            "mask_into",
            "get_error",
            "clone",
            "free_matcher",
        )
    ]


class _TreeBatchArgs(ctypes.Structure):
    """``EspTreeBatch`` of ``llg_walk.c``: a step's trees, their inputs and outputs."""

    _fields_ = [
        ("n_trees", ctypes.c_int64),
        ("roots", ctypes.c_void_p),
        ("filter_states", ctypes.c_void_p),
        ("filter", ctypes.c_void_p),
        ("node_at", ctypes.c_void_p),
        ("row_at", ctypes.c_void_p),
        ("flag_at", ctypes.c_void_p),
        ("tokens", ctypes.c_void_p),
        ("parents", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("flags", ctypes.c_void_p),
        ("plane", ctypes.c_int64),
        ("words", ctypes.c_int64),
        ("limit", ctypes.c_int64),
        ("vocab_size", ctypes.c_int64),
        ("excluded", ctypes.c_void_p),
        ("stops", ctypes.c_void_p),
        ("budget_s", ctypes.c_double),
        ("root_mode", ctypes.c_int64),
        ("threads", ctypes.c_int64),
        ("tree_threads", ctypes.c_int64),
        ("status", ctypes.c_void_p),
        ("n_filled", ctypes.c_void_p),
        ("helper_filled", ctypes.c_void_p),
        ("seconds", ctypes.c_void_p),
        ("errors", ctypes.c_void_p),
        ("err_len", ctypes.c_int64),
        ("want_snapshot", ctypes.c_void_p),
        ("snapshots", ctypes.c_void_p),
    ]


WALK_ABI = 6
"""``espalier_llg_walk_abi()`` of the ``llg_walk.c`` this binding was written for."""

TOKENIZE_CACHE_ENTRIES = 8192
"""Slots of the C tokenize cache (texts remembered: up to half of it; cleared when full)."""

LAYOUT_PROBLEMS = {
    1: "the tokenizer pointer is not the first field of LlgConstraintInit",
    2: "the log levels of LlgConstraintInit are not where llg_abi.h puts them",
    3: "the flags of LlgConstraintInit are not where llg_abi.h puts them",
    4: "LlgConstraintInit's parser limits are not where llg_abi.h puts them",
    5: "the library's LlgConstraintInit is larger than llg_abi.h's",
}
"""``espalier_llg_check_layout``'s failure codes (``llg_abi.c``)."""


class NativeBuildError(RuntimeError):
    """The native walk cannot be used with this install: its extension is missing, or the
    installed llguidance is not the series its ``llg_abi.h`` was written for."""


class Api:
    """The llguidance library and the walk extension, with their ctypes signatures."""

    def __init__(self, llg: ctypes.CDLL, walk: ctypes.CDLL) -> None:
        self.llg = llg
        self.walk = walk
        vp, sz, i32, u32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_uint32
        sig: dict[str, tuple[Any, list[Any]]] = {
            "llg_free_tokenizer": (None, [vp]),
            "llg_new_matcher": (vp, [vp, ctypes.c_char_p, ctypes.c_char_p]),
            "llg_matcher_get_error": (ctypes.c_char_p, [vp]),
            "llg_matcher_is_error": (ctypes.c_bool, [vp]),
            "llg_clone_matcher": (vp, [vp]),
            "llg_free_matcher": (None, [vp]),
            "llg_matcher_consume_tokens": (i32, [vp, vp, sz]),
            "llg_matcher_consume_token": (i32, [vp, u32]),
            "llg_matcher_rollback": (i32, [vp, sz]),
            "llg_matcher_compute_mask_into": (i32, [vp, vp, sz]),
            "llg_matcher_validate_tokens": (i32, [vp, vp, sz]),
            "llg_matcher_compute_ff_tokens": (i32, [vp, vp, sz]),
            "llg_matcher_is_accepting": (ctypes.c_bool, [vp]),
        }
        for name, (restype, argtypes) in sig.items():
            fn = getattr(llg, name)
            fn.restype, fn.argtypes = restype, argtypes
        self.set_defaults = _address(llg, "llg_constraint_init_set_defaults")
        self.new_tokenizer_v2 = _address(llg, "llg_new_tokenizer_v2")
        self.fns = _WalkApi(
            *(
                _address(llg, name)
                for name in (
                    "llg_matcher_consume_token",
                    "llg_matcher_consume_tokens",
                    "llg_matcher_compute_mask_into",
                    "llg_matcher_get_error",
                    "llg_clone_matcher",
                    "llg_free_matcher",
                )
            )
        )
        walk_sig: dict[str, tuple[Any, list[Any]]] = {
            "espalier_llg_walk_batch": (ctypes.c_int64, [vp, vp]),
            "espalier_llg_accept_batch": (
                ctypes.c_int64,
                [vp, vp, vp, vp, vp, vp, ctypes.c_int64, ctypes.c_int64, vp],
            ),
            "espalier_tokenize_cache_new": (vp, [vp, vp, sz]),
            "espalier_llg_series": (ctypes.c_char_p, []),
            "espalier_llg_constraint_init_size": (sz, []),
            "espalier_llg_check_layout": (i32, [vp]),
            "espalier_llg_constraint_init": (None, [vp, vp, vp, sz]),
            "espalier_llg_new_tokenizer": (vp, [vp, u32, vp, vp, vp, vp, vp, u32, vp, sz]),
        }
        for name, (restype, argtypes) in walk_sig.items():
            fn = getattr(walk, name)
            fn.restype, fn.argtypes = restype, argtypes
        self.walk_batch_fn = walk.espalier_llg_walk_batch
        self.accept_batch_fn = walk.espalier_llg_accept_batch
        self.validate_address = _address(llg, "llg_matcher_validate_tokens")
        self.tokenize_cache_new = walk.espalier_tokenize_cache_new
        self.tokenize_cached: int = _address(walk, "espalier_tokenize_cached")
        self.fns_address = ctypes.addressof(self.fns)

    def series(self) -> str:
        """The llguidance series (``"1.9"``) whose C structs the extension was built with."""
        return bytes(self.walk.espalier_llg_series()).decode()

    def check_layout(self) -> None:
        """Raise :class:`NativeBuildError` unless the library writes ``LlgConstraintInit`` as
        ``llg_abi.h`` declares it (a probe through ``llg_constraint_init_set_defaults``)."""
        code = int(self.walk.espalier_llg_check_layout(self.set_defaults))
        if code != 0:
            raise NativeBuildError(
                f"llguidance {installed_llguidance()}: "
                f"{LAYOUT_PROBLEMS.get(code, f'layout check {code}')}; {_remedy(self.series())}"
            )

    def constraint_init(self, tokenizer: int) -> ctypes.Array[ctypes.c_char]:
        """An ``LlgConstraintInit`` for ``tokenizer``: llguidance's defaults but
        :data:`STEP_MAX_ITEMS`, no stderr logs."""
        init = ctypes.create_string_buffer(int(self.walk.espalier_llg_constraint_init_size()))
        self.walk.espalier_llg_constraint_init(self.set_defaults, init, tokenizer, STEP_MAX_ITEMS)
        return init


def _address(lib: ctypes.CDLL, name: str) -> int:
    address = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    assert address is not None  # a symbol ctypes found has an address
    return address


STEP_MAX_ITEMS = 500_000
"""Earley items one mask may build (llguidance's default: 50,000). A class repeated inside a
rule is one-character lexemes: ``"a" [ -~]* "z"`` needs ~100,000 items a mask on the Gemma
vocabulary (6-11 ms) and failed its second mask at the default; an ambiguous grammar still fails
here within ~25 ms, under the slow-fill guard's 50 ms (``constrained/fill_cost.py``)."""

WALK_EXTENSION = "_llg_walk"
"""The walk's extension module in this folder, built with the package (``setup.py``)."""

_api: Api | None = None
_api_error: NativeBuildError | None = None
_api_lock = threading.Lock()


def installed_llguidance() -> str:
    """The installed llguidance distribution's version."""
    return importlib.metadata.version("llguidance")


def check_version(installed: str, series: str) -> None:
    """Raise :class:`NativeBuildError`, naming both versions, unless llguidance ``installed``
    belongs to ``series`` (the extension's ``"major.minor"``)."""
    if installed.split(".")[:2] != series.split("."):
        raise NativeBuildError(
            f"llguidance {installed} is installed, but espalier's native tree walk declares "
            f"llguidance {series}.x's C structs; {_remedy(series)}"
        )


def _remedy(series: str) -> str:
    pins = [r for r in importlib.metadata.requires("espalier") or [] if r.startswith("llguidance")]
    wanted = pins[0] if pins else f"llguidance=={series}.*"
    return f"install {wanted!r} (espalier's pin), or set llguidance_native_walk=False"


def _extension_path() -> Path:
    folder = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = folder / f"{WALK_EXTENSION}{suffix}"
        if candidate.exists():
            return candidate
    raise NativeBuildError(
        f"espalier's native tree walk ({WALK_EXTENSION}) is not built in {folder}: reinstall "
        "espalier (pip install -e . builds it with the system C compiler)"
    )


def api() -> Api:
    """The native API, loaded and checked on first call (version, then layout); raises
    :class:`NativeBuildError` (every call) when it cannot be used."""
    global _api, _api_error
    with _api_lock:
        if _api is None and _api_error is None:
            try:
                _api = _load()
            except NativeBuildError as exc:
                _api_error = exc
        if _api_error is not None:
            raise _api_error
        assert _api is not None
        return _api


def _load() -> Api:
    import llguidance._lib as llg_module

    try:
        walk = ctypes.CDLL(str(_extension_path()))
    except OSError as exc:
        raise NativeBuildError(f"espalier's native tree walk does not load: {exc}") from exc
    built = 1  # the first build exported no ABI number
    if hasattr(walk, "espalier_llg_walk_abi"):
        walk.espalier_llg_walk_abi.restype = ctypes.c_int64
        built = int(walk.espalier_llg_walk_abi())
    if built != WALK_ABI:
        raise NativeBuildError(
            f"espalier's native tree walk was built from llg_walk.c ABI {built}, this binding "
            f"expects {WALK_ABI}: reinstall espalier (pip install -e .)"
        )
    walk.espalier_llg_series.restype = ctypes.c_char_p
    series = bytes(walk.espalier_llg_series()).decode()
    check_version(installed_llguidance(), series)  # before any llguidance call: layout may differ
    lib = Api(ctypes.CDLL(llg_module.__file__), walk)
    lib.check_layout()
    return lib


@dataclass(frozen=True)
class TokenizerSource:
    """What a native tokenizer is built from (the same as the Python ``LLTokenizer``).

    Attributes:
        tokens: bytes of every id, padding included (``n_vocab`` entries).
        special_ids: ids llguidance treats as special (their bytes get its 0xFF marker).
        stop_ids: stop (EOS) ids, first one primary.
        encode: text -> ids, the tokenizer's own tokenization (llguidance calls it for forced
            text; from any thread, taking the GIL).
    """

    tokens: Sequence[bytes]
    special_ids: Sequence[int]
    stop_ids: Sequence[int]
    encode: Callable[[str], list[int]]


SPECIAL_MARKER = 0xFF


class NativeTokenizer:
    """An ``LlgTokenizer`` (C API) and the constraint init that makes matchers with it."""

    def __init__(self, lib: Api, source: TokenizerSource) -> None:
        self.api = lib
        tokens = list(source.tokens)
        for token in source.special_ids:
            if 0 <= token < len(tokens) and tokens[token][:1] != bytes([SPECIAL_MARKER]):
                tokens[token] = bytes([SPECIAL_MARKER]) + tokens[token]
        lens = np.fromiter((len(t) for t in tokens), dtype=np.uint32, count=len(tokens))
        blob = np.frombuffer(b"".join(tokens) or b"\0", dtype=np.uint8)
        stops = np.array([int(s) for s in source.stop_ids], dtype=np.uint32)
        if stops.size == 0:
            raise ValueError("llguidance needs at least one stop id")
        encode = source.encode

        def tokenize(_user: Any, data: Any, size: int, out: Any, capacity: int) -> int:
            text = ctypes.string_at(data, size).decode("utf-8", errors="replace")
            ids = encode(text)
            for i, token in enumerate(ids[:capacity]):
                out[i] = token
            return len(ids)

        self._callback = _TokenizeFn(tokenize)  # kept alive as long as the tokenizer
        # llguidance calls the tokenizer from inside masks: a C cache answers the texts it asks
        # for again and again, without the GIL; only misses reach the Python callback (never
        # freed: one per tokenizer, and tokenizers live as long as the process)
        cache = lib.tokenize_cache_new(
            ctypes.cast(self._callback, ctypes.c_void_p), None, TOKENIZE_CACHE_ENTRIES
        )
        if not cache:
            raise MemoryError("tokenize cache")
        error = ctypes.create_string_buffer(ERROR_BYTES)
        pointer = lib.walk.espalier_llg_new_tokenizer(
            lib.new_tokenizer_v2,
            len(tokens),
            lens.ctypes.data,
            blob.ctypes.data,
            lib.tokenize_cached,  # the callback wants valid UTF-8 text (llg_abi.c sets so)
            cache,
            stops.ctypes.data,
            stops.size,
            error,
            ERROR_BYTES,
        )
        if not pointer:
            raise RuntimeError(f"llg_new_tokenizer_v2: {error.value.decode(errors='replace')}")
        self.pointer: int = pointer
        self._init = lib.constraint_init(pointer)
        weakref.finalize(self, lib.llg.llg_free_tokenizer, pointer)

    def matcher(self, grammar: str) -> NativeMatcher:
        """A matcher at the start state of llguidance grammar text ``grammar``."""
        pointer = self.api.llg.llg_new_matcher(self._init, b"llguidance", grammar.encode())
        matcher = NativeMatcher(self, pointer)
        if self.api.llg.llg_matcher_is_error(pointer):
            raise RuntimeError(f"llg_new_matcher: {matcher.error()}")
        return matcher


class Releaser:
    """Frees C-API matchers on a daemon thread of its own (one per process), in the order they
    were dropped. llguidance's free takes tens of µs (the matcher's lexer and parser state), and
    a matcher is dropped by whichever thread held it last: mostly the engine thread, mid-step
    (closing forks, replaced closing bases, finished requests)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[int], None], int]] | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def free(self, function: Callable[[int], None], pointer: int) -> None:
        """Call ``function(pointer)`` on the releaser's thread (started on first use, and again
        in a forked child, where the parent's thread does not exist)."""
        pending = self._queue
        if pending is None or self._pid != os.getpid():
            pending = self._start()
        pending.put((function, pointer))

    def _start(self) -> queue.SimpleQueue[tuple[Callable[[int], None], int]]:
        with self._lock:
            if self._queue is None or self._pid != os.getpid():
                self._queue = queue.SimpleQueue()
                self._pid = os.getpid()
                threading.Thread(
                    target=_release, args=(self._queue,), name="espalier-llg-free", daemon=True
                ).start()
            return self._queue


def _release(pending: queue.SimpleQueue[tuple[Callable[[int], None], int]]) -> None:
    while True:
        function, pointer = pending.get()
        function(pointer)


RELEASER = Releaser()
"""The process's :class:`Releaser` (every :class:`NativeMatcher` frees through it)."""


class NativeMatcher:
    """One C-API matcher (freed when collected, on :data:`RELEASER`'s thread). Every call goes
    through ctypes, which releases the GIL for its length. Not thread-safe: one thread at a time
    may use a matcher (a clone is independent of its source, its lexer included)."""

    def __init__(self, tokenizer: NativeTokenizer, pointer: int) -> None:
        if not pointer:
            raise MemoryError("llguidance returned no matcher")
        self.tokenizer = tokenizer
        self.pointer = pointer
        self.llg = tokenizer.api.llg
        self._one = ctypes.c_uint32()  # try_consume's argument buffer
        weakref.finalize(self, RELEASER.free, self.llg.llg_free_matcher, pointer)

    def clone(self) -> NativeMatcher:
        return NativeMatcher(self.tokenizer, self.llg.llg_clone_matcher(self.pointer))

    def error(self) -> str:
        message = self.llg.llg_matcher_get_error(self.pointer)
        return message.decode(errors="replace") if message else ""

    def is_error(self) -> bool:
        return bool(self.llg.llg_matcher_is_error(self.pointer))

    def mask_into(self, row: np.ndarray) -> None:
        """Compute the mask into int32 ``row`` (``[words]``, C-contiguous)."""
        self.mask_at(row.ctypes.data, row.nbytes)

    def mask_at(self, address: int, nbytes: int) -> None:
        """Compute the mask into the ``nbytes`` bytes at ``address`` (a whole bitmask row)."""
        if self.llg.llg_matcher_compute_mask_into(self.pointer, address, nbytes) != 0:
            raise RuntimeError(f"llguidance mask: {self.error()}")

    def validate(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (text token ids) the matcher would consume, consuming none;
        -1: the matcher is in its error state."""
        if not tokens:
            return 0
        array = (ctypes.c_uint32 * len(tokens))(*tokens)
        return int(self.llg.llg_matcher_validate_tokens(self.pointer, array, len(tokens)))

    def try_consume(self, tokens: Sequence[int]) -> int:
        """Consume the longest allowed prefix of ``tokens`` (text token ids); returns its
        length, or -1 when the matcher is in its error state. A disallowed token is never
        consumed, so a rejection leaves the matcher usable. Token by token, each validated
        first, as :func:`accept_batch` does; two ctypes calls a token (a few µs), where one
        :func:`accept_batch` call costs tens of µs to lay out: that is for a batch's runs."""
        llg, pointer, one = self.llg, self.pointer, self._one
        taken = 0
        for token in tokens:
            one.value = token
            valid = llg.llg_matcher_validate_tokens(pointer, ctypes.byref(one), 1)
            if valid < 0:
                return -1
            if valid == 0:
                break
            if llg.llg_matcher_consume_token(pointer, token) != 0:
                return -1
            taken += 1
        return taken

    def rollback(self, n: int) -> bool:
        return bool(self.llg.llg_matcher_rollback(self.pointer, n) == 0)

    def is_accepting(self) -> bool:
        return bool(self.llg.llg_matcher_is_accepting(self.pointer))

    def forced_tokens(self, limit: int) -> list[int]:
        """The tokens the grammar forces next (at most ``limit``); [] on an error."""
        if limit <= 0:
            return []
        out = (ctypes.c_uint32 * limit)()
        n = int(self.llg.llg_matcher_compute_ff_tokens(self.pointer, out, limit))
        return list(out[: max(n, 0)])


def accept_batch(
    lib: Api, matchers: Sequence[NativeMatcher], runs: Sequence[Sequence[int]], threads: int
) -> list[int]:
    """Matcher ``j`` consumes the longest allowed prefix of ``runs[j]`` (text token ids), token
    by token, each validated first (``llg_walk.c``'s ``espalier_llg_accept_batch``, on up to
    ``threads`` native threads, the GIL released): as the Python API's ``try_consume_tokens``
    does (a whole run validated, then consumed, can fail where token-by-token consumes do not:
    ``tests/constrained/test_llguidance_isolation.py``'s schema). Per matcher: how many, or -1
    when it is in its error state. The matchers must be distinct."""
    pointers = np.fromiter((m.pointer for m in matchers), dtype=np.uint64, count=len(matchers))
    return _accept_batch(lib, pointers, None, runs, threads)


def fork_batch(
    lib: Api, sources: Sequence[NativeMatcher], runs: Sequence[Sequence[int]], threads: int
) -> list[tuple[NativeMatcher | None, int]]:
    """A clone of each of ``sources`` that has consumed what it allows of ``runs[j]``, as
    :func:`accept_batch` consumes, clones made in the same native call (a clone copies the
    lexer: tens of µs each, on the native threads rather than one by one); the sources do not
    change. Per source: its clone (None when the clone failed) and the count, -1 when the clone
    is in its error state. The sources must be distinct and not in use on another thread."""
    n = len(sources)
    pointers = np.zeros(n, dtype=np.uint64)
    froms = np.fromiter((m.pointer for m in sources), dtype=np.uint64, count=n)
    counts = _accept_batch(lib, pointers, froms, runs, threads)
    out: list[tuple[NativeMatcher | None, int]] = []
    for source, pointer, count in zip(sources, pointers.tolist(), counts):
        clone = NativeMatcher(source.tokenizer, int(pointer)) if pointer else None
        out.append((clone, count if clone is not None else -1))
    return out


def _accept_batch(
    lib: Api,
    pointers: np.ndarray,
    sources: np.ndarray | None,
    runs: Sequence[Sequence[int]],
    threads: int,
) -> list[int]:
    """``espalier_llg_accept_batch`` over uint64 ``pointers`` ``[n]`` (written by the call,
    clones of uint64 ``sources`` ``[n]``, when those are given)."""
    n = len(pointers)
    lengths = np.fromiter((len(r) for r in runs), dtype=np.int64, count=n)
    at = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=at[1:])
    tokens = np.fromiter((t for r in runs for t in r), dtype=np.uint32, count=int(at[-1]))
    out = np.empty(n, dtype=np.int64)
    lib.accept_batch_fn(
        lib.fns_address,
        lib.validate_address,
        pointers.ctypes.data,
        None if sources is None else sources.ctypes.data,
        tokens.ctypes.data,
        at.ctypes.data,
        n,
        max(1, threads),
        out.ctypes.data,
    )
    return [int(x) for x in out.tolist()]


@dataclass(frozen=True)
class WalkTables:
    """Per-tokenizer constants of a walk: uint32 ``[words]`` bitmaps over the vocabulary."""

    excluded: np.ndarray  # special non-stop ids: never valid
    stops: np.ndarray  # stop ids: valid where allowed, never consumed; also the stop row
    limit: int  # ids at or above are invalid (model padding)

    @property
    def words(self) -> int:
        return int(self.excluded.shape[0])


@dataclass(frozen=True)
class BatchTrees:
    """A step's trees for :func:`walk_batch`, laid out back to back (``B`` trees, ``N`` nodes).

    Attributes:
        roots: uint64 ``[B]``: each tree's root matcher (a ``NativeMatcher``'s pointer: the
            request's own, which the walk never advances).
        tokens, parents: int64 ``[N]``: tree ``b``'s nodes are ``node_at[b]:node_at[b + 1]``
            (int64 ``[B + 1]``), ``parents`` local to the tree (root -1, siblings in index
            order).
        row_at: int64 ``[B]``: tree ``b``'s first row of the rows; flag_at: int64 ``[B]`` its
            first node in the flag planes.
        filter_states: uint64 ``[B]``: per tree the state ``filter`` is called with after its
            walk (0: none); filter: address of an ``EspTreeFilterFn`` (``llg_walk.c``), 0: none.
        want_snapshot: uint8 ``[B]``, 1 where the tree's root is to be snapshot after its walk
            (``BatchEnd.snapshots``); None: none is.
    """

    roots: np.ndarray
    tokens: np.ndarray
    parents: np.ndarray
    node_at: np.ndarray
    row_at: np.ndarray
    flag_at: np.ndarray
    filter_states: np.ndarray
    filter: int = 0
    want_snapshot: np.ndarray | None = None

    @property
    def count(self) -> int:
        return int(self.roots.shape[0])


@dataclass
class BatchEnd:
    """How each tree of a :func:`walk_batch` ended, numpy ``[B]`` each: ``status`` (WALK_DONE,
    WALK_BUDGET_HIT, or negative: failed, then ``errors[b]`` says why), rows filled
    (``helper_filled`` of them by a second thread), seconds; ``snapshots``: per tree the
    :class:`NativeMatcher` its ``want_snapshot`` asked for (a clone of the root once its row
    was computed), or None."""

    status: np.ndarray
    filled: np.ndarray
    helper_filled: np.ndarray
    seconds: np.ndarray
    errors: dict[int, str]
    snapshots: list[NativeMatcher | None]


def walk_batch(
    lib: Api,
    trees: BatchTrees,
    rows: np.ndarray,
    flags: np.ndarray,
    tables: WalkTables,
    vocab_size: int,
    budget_s: float,
    threads: int,
    tree_threads: int = 1,
    root_mode: int = ROOT_COMPUTE,
    tokenizer: NativeTokenizer | None = None,
) -> BatchEnd:
    """Fill every tree of ``trees`` in one call of ``llg_walk.c``'s ``espalier_llg_walk_batch``
    (the GIL released throughout): on up to ``threads`` native threads, a tree whole on one of
    them (``tree_threads`` 2: a branchy tree of 8 nodes or more shares its walk with a second),
    each tree's root row computed and the tree walked on clones (``budget_s`` from the tree's
    start, < 0 none), its unfilled rows given the stop bits and the bits past ``vocab_size``
    cleared, then its filter. ``root_mode`` ROOT_READY: every tree's row 0 is given (not
    computed). rows: int32 ``[R, W]`` C-contiguous; flags: uint8 ``[3, M]`` C-contiguous, zero
    where trees go (valid, filled, terminated planes), written in place. ``tokenizer``: the
    roots' tokenizer, needed with ``trees.want_snapshot``."""
    n = trees.count
    assert rows.dtype == np.int32 and rows.flags.c_contiguous and rows.shape[1] == tables.words
    assert trees.want_snapshot is None or tokenizer is not None  # it frees the snapshots
    assert flags.dtype == np.uint8 and flags.flags.c_contiguous and flags.shape[0] == 3
    status = np.zeros(n, dtype=np.int64)
    filled = np.zeros(n, dtype=np.int64)
    helper = np.zeros(n, dtype=np.int64)
    seconds = np.zeros(n, dtype=np.float64)
    errors = ctypes.create_string_buffer(ERROR_BYTES * max(n, 1))
    want = trees.want_snapshot
    snapshots = np.zeros(n, dtype=np.uint64)
    args = _TreeBatchArgs(
        n,
        trees.roots.ctypes.data,
        trees.filter_states.ctypes.data,
        trees.filter,
        trees.node_at.ctypes.data,
        trees.row_at.ctypes.data,
        trees.flag_at.ctypes.data,
        trees.tokens.ctypes.data,
        trees.parents.ctypes.data,
        rows.ctypes.data,
        flags.ctypes.data,
        flags.shape[1],
        tables.words,
        tables.limit,
        vocab_size,
        tables.excluded.ctypes.data,
        tables.stops.ctypes.data,  # also the stop row (the stop ids' bitmap)
        budget_s,
        root_mode,
        max(1, threads),
        max(1, tree_threads),
        status.ctypes.data,
        filled.ctypes.data,
        helper.ctypes.data,
        seconds.ctypes.data,
        ctypes.addressof(errors),
        ERROR_BYTES,
        want.ctypes.data if want is not None else None,
        snapshots.ctypes.data,
    )
    failed = int(lib.walk_batch_fn(lib.fns_address, ctypes.addressof(args)))
    messages: dict[int, str] = {}
    if failed:
        for b in np.flatnonzero(status < 0).tolist():
            text = errors.raw[b * ERROR_BYTES : (b + 1) * ERROR_BYTES].split(b"\0", 1)[0]
            messages[b] = text.decode(errors="replace") or f"status {int(status[b])}"
    made = [
        NativeMatcher(tokenizer, pointer) if pointer and tokenizer is not None else None
        for pointer in snapshots.tolist()
    ]
    return BatchEnd(status, filled, helper, seconds, messages, made)


class NativeTokenizerSlot:
    """A :class:`NativeTokenizer` built on a background thread (Gemma's 262k ids: ~1.5 s),
    started by the first :meth:`get` or :meth:`wait`: a process that never walks a tree (a
    compile probe, a server without speculation) never builds it.

    Until it is ready :meth:`get` returns None and callers use their Python paths; :attr:`error`
    says why the build failed, if it did. (An unusable install never gets here: the backend
    calls :func:`api` when it is made, which raises :class:`NativeBuildError`.)
    """

    def __init__(self, source: Callable[[], TokenizerSource], tables: WalkTables) -> None:
        self.tables = tables
        self.error: str | None = None
        self._source = source
        self._value: NativeTokenizer | None = None
        self._done = threading.Event()
        self._started = False
        self._lock = threading.Lock()

    def _start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        # not a daemon: the interpreter waits for the build (bounded) at exit instead of tearing
        # native state down under it
        threading.Thread(target=self._build, name="llg-native-tokenizer").start()

    def _build(self) -> None:
        try:
            self._value = NativeTokenizer(api(), self._source())
        except (RuntimeError, ValueError, MemoryError) as exc:
            self.error = f"native llguidance tokenizer: {exc}"
        finally:
            self._done.set()

    def built(self) -> NativeTokenizer | None:
        """The tokenizer if built; starts nothing, never blocks."""
        return self._value if self._done.is_set() else None

    def get(self) -> NativeTokenizer | None:
        """The tokenizer if built (never blocks; starts the build the first time)."""
        self._start()
        return self.built()

    def wait(self, timeout: float | None = None) -> NativeTokenizer | None:
        """Start the build if needed, block until it ends (or ``timeout``); the tokenizer or
        None."""
        self._start()
        self._done.wait(timeout)
        return self.built()


def walk_tables(
    words: int, tokenizer_vocab: int, excluded: Sequence[int], stops: Sequence[int]
) -> WalkTables:
    """The :class:`WalkTables` of a vocabulary of ``words`` mask words."""
    bits = words * bm.BITS_PER_WORD
    return WalkTables(
        bm.row_from_tokens(excluded, bits).view(np.uint32),
        bm.row_from_tokens(stops, bits).view(np.uint32),
        min(bits, tokenizer_vocab),
    )
