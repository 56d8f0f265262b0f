"""llguidance's C API through ctypes, and the native draft-tree walk (``llg_walk.c``).

The llguidance wheel's library exports the C API (``llg_new_tokenizer_v2``, ``llg_new_matcher``,
``llg_clone_matcher``, ``llg_matcher_compute_mask_into``, ...). A matcher made through it is a
different object from the Python ``LLMatcher`` but, built from the same token bytes, special ids,
stop ids and grammar text, it computes the same masks (checked by the tree oracle tests). The
walk in ``llg_walk.c`` drives such matchers for a whole tree in one ctypes call, which drops the
GIL for its whole length: trees of a batch fill in parallel on as many threads as there are
cores, with no per-node Python.

Lifetimes: a :class:`NativeMatcher` keeps its :class:`NativeTokenizer` alive and frees its C
matcher when collected; the tokenizer keeps its token buffers and tokenize callback alive.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from espalier.constrained import bitmask as bm
from espalier.constrained.native.build import build_library, last_error

WALK_SOURCE = "llg_walk.c"
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


class _TokenizerInitV2(ctypes.Structure):
    """``LlgTokenizerInitV2`` (llguidance.h); the library reads ``struct_size`` bytes of it."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("vocab_size", ctypes.c_uint32),
        ("tok_eos", ctypes.c_uint32),
        ("token_lens", ctypes.POINTER(ctypes.c_uint32)),
        ("token_bytes", ctypes.POINTER(ctypes.c_uint8)),
        ("tokenizer_json", ctypes.c_char_p),
        ("tokenize_assumes_string", ctypes.c_bool),
        ("tokenize_fn", _TokenizeFn),
        ("use_approximate_greedy_tokenize_fn", ctypes.c_bool),
        ("tokenize_user_data", ctypes.c_void_p),
        ("slices", ctypes.c_void_p),
        ("tok_eos_extra", ctypes.POINTER(ctypes.c_uint32)),
        ("tok_eos_extra_count", ctypes.c_uint32),
    ]


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


class _WalkArgs(ctypes.Structure):
    """``EspWalkArgs`` of ``llg_walk.c``: one walk's inputs and outputs."""

    _fields_ = [
        ("root", ctypes.c_void_p),
        ("sync", ctypes.c_void_p),
        ("n_sync", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("tokens", ctypes.c_void_p),
        ("first_child", ctypes.c_void_p),
        ("next_sibling", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("words", ctypes.c_int64),
        ("limit", ctypes.c_int64),
        ("excluded", ctypes.c_void_p),
        ("stops", ctypes.c_void_p),
        ("root_mode", ctypes.c_int64),
        ("budget_s", ctypes.c_double),
        ("valid", ctypes.c_void_p),
        ("filled", ctypes.c_void_p),
        ("terminated", ctypes.c_void_p),
        ("err", ctypes.c_void_p),
        ("err_len", ctypes.c_int64),
        ("threads", ctypes.c_int64),
        ("n_filled", ctypes.c_int64),
        ("helper_filled", ctypes.c_int64),
    ]


TOKENIZE_CACHE_ENTRIES = 8192
"""Slots of the C tokenize cache (texts remembered: up to half of it; cleared when full)."""

CONSTRAINT_INIT_BYTES = 256
"""Room for ``LlgConstraintInit`` (about 80 bytes in llguidance 1.9), filled by
``llg_constraint_init_set_defaults``; generous so a larger future struct still fits."""
LOG_STDERR_LEVEL_OFFSET = 12
"""Byte offset of ``log_stderr_level`` in ``LlgConstraintInit`` (after the tokenizer pointer and
``log_buffer_level``): set to 0 so grammar warnings do not go to stderr (the Python side uses
``log_level=0`` too)."""


class Api:
    """The llguidance library and the compiled walk, with their ctypes signatures."""

    def __init__(self, llg: ctypes.CDLL, walk: ctypes.CDLL) -> None:
        self.llg = llg
        self.walk = walk
        vp, sz, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32
        sig: dict[str, tuple[Any, list[Any]]] = {
            "llg_new_tokenizer_v2": (vp, [vp, ctypes.c_char_p, sz]),
            "llg_free_tokenizer": (None, [vp]),
            "llg_constraint_init_set_defaults": (None, [vp, vp]),
            "llg_new_matcher": (vp, [vp, ctypes.c_char_p, ctypes.c_char_p]),
            "llg_matcher_get_error": (ctypes.c_char_p, [vp]),
            "llg_matcher_is_error": (ctypes.c_bool, [vp]),
            "llg_clone_matcher": (vp, [vp]),
            "llg_free_matcher": (None, [vp]),
            "llg_matcher_consume_tokens": (i32, [vp, vp, sz]),
            "llg_matcher_rollback": (i32, [vp, sz]),
            "llg_matcher_compute_mask_into": (i32, [vp, vp, sz]),
        }
        for name, (restype, argtypes) in sig.items():
            fn = getattr(llg, name)
            fn.restype, fn.argtypes = restype, argtypes
        self.fns = _WalkApi(
            *(
                ctypes.cast(getattr(llg, name), ctypes.c_void_p).value
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
        walk_fn = walk.espalier_llg_walk
        walk_fn.restype = ctypes.c_int64
        walk_fn.argtypes = [vp, vp]
        cache_new = walk.espalier_tokenize_cache_new
        cache_new.restype, cache_new.argtypes = vp, [vp, vp, sz]
        self.tokenize_cache_new = cache_new
        self.tokenize_cached: int = ctypes.cast(walk.espalier_tokenize_cached, vp).value or 0
        self.walk_fn = walk_fn
        self.fns_address = ctypes.addressof(self.fns)


_api: Api | None = None
_api_error: str | None = None
_api_lock = threading.Lock()
_api_tried = False


def api() -> Api | None:
    """The native API, loaded (and the walk compiled) on first call; None if unavailable."""
    global _api, _api_error, _api_tried
    with _api_lock:
        if _api_tried:
            return _api
        _api_tried = True
        try:
            import llguidance._lib as llg_module

            llg = ctypes.CDLL(llg_module.__file__)
            path = build_library(WALK_SOURCE)
            if path is None:
                raise RuntimeError(last_error(WALK_SOURCE) or "build failed")
            _api = Api(llg, ctypes.CDLL(str(path)))
        except (OSError, AttributeError, ImportError, RuntimeError) as exc:
            _api_error = f"native llguidance walk unavailable: {exc}"
        return _api


def unavailable_reason() -> str | None:
    """Why :func:`api` returned None (None while it has not, or if it did not)."""
    return _api_error


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
        stops = [int(s) for s in source.stop_ids]
        extra = np.array(stops[1:] or [0], dtype=np.uint32)
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
        init = _TokenizerInitV2(
            ctypes.sizeof(_TokenizerInitV2),
            len(tokens),
            stops[0],
            lens.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)),
            blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
            None,
            True,  # the callback wants valid UTF-8 text
            ctypes.cast(lib.tokenize_cached, _TokenizeFn),
            False,
            cache,
            None,
            extra.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)),
            len(stops) - 1,
        )
        error = ctypes.create_string_buffer(ERROR_BYTES)
        pointer = lib.llg.llg_new_tokenizer_v2(ctypes.byref(init), error, ERROR_BYTES)
        if not pointer:
            raise RuntimeError(f"llg_new_tokenizer_v2: {error.value.decode(errors='replace')}")
        self.pointer: int = pointer
        self._init = ctypes.create_string_buffer(CONSTRAINT_INIT_BYTES)
        lib.llg.llg_constraint_init_set_defaults(self._init, pointer)
        ctypes.c_uint32.from_buffer(self._init, LOG_STDERR_LEVEL_OFFSET).value = 0
        weakref.finalize(self, lib.llg.llg_free_tokenizer, pointer)

    def matcher(self, grammar: str) -> NativeMatcher:
        """A matcher at the start state of llguidance grammar text ``grammar``."""
        pointer = self.api.llg.llg_new_matcher(self._init, b"llguidance", grammar.encode())
        matcher = NativeMatcher(self, pointer)
        if self.api.llg.llg_matcher_is_error(pointer):
            raise RuntimeError(f"llg_new_matcher: {matcher.error()}")
        return matcher


class NativeMatcher:
    """One C-API matcher (freed when collected)."""

    def __init__(self, tokenizer: NativeTokenizer, pointer: int) -> None:
        if not pointer:
            raise MemoryError("llguidance returned no matcher")
        self.tokenizer = tokenizer
        self.pointer = pointer
        weakref.finalize(self, tokenizer.api.llg.llg_free_matcher, pointer)

    def clone(self) -> NativeMatcher:
        return NativeMatcher(self.tokenizer, self.tokenizer.api.llg.llg_clone_matcher(self.pointer))

    def error(self) -> str:
        message = self.tokenizer.api.llg.llg_matcher_get_error(self.pointer)
        return message.decode(errors="replace") if message else ""

    def mask_into(self, row: np.ndarray) -> None:
        """Compute the mask into int32 ``row`` (``[words]``, C-contiguous)."""
        llg = self.tokenizer.api.llg
        if llg.llg_matcher_compute_mask_into(self.pointer, row.ctypes.data, row.nbytes) != 0:
            raise RuntimeError(f"llguidance mask: {self.error()}")


@dataclass(frozen=True)
class WalkTables:
    """Per-tokenizer constants of a walk: uint32 ``[words]`` bitmaps over the vocabulary."""

    excluded: np.ndarray  # special non-stop ids: never valid
    stops: np.ndarray  # stop ids: valid where allowed, never consumed; also the stop row
    limit: int  # ids at or above are invalid (model padding)

    @property
    def words(self) -> int:
        return int(self.excluded.shape[0])


@dataclass
class WalkEnd:
    """How a walk ended: ``status`` (WALK_DONE or WALK_BUDGET_HIT), how many rows it filled, of
    which the second thread filled ``helper_filled``."""

    status: int
    filled: int
    helper_filled: int = 0


def walk(
    root: NativeMatcher,
    sync: Sequence[int],
    tree: Any,
    rows: np.ndarray,
    tables: WalkTables,
    root_mode: int,
    budget_s: float,
    flags: np.ndarray,
    threads: int = 1,
) -> WalkEnd:
    """Run ``llg_walk.c`` (see its comment) on clones of ``root`` (the request's twin), after
    ``root`` catches up by consuming ``sync`` (it never rolls back). ``flags``: zeroed uint8
    ``[3, n]`` (valid, filled, terminated), written in place; ``threads``: 1 or 2. Raises
    RuntimeError on a library error (with its message; ``root``'s state is then unknown)."""
    lib = root.tokenizer.api
    n = tree.num_nodes
    scratch = _thread_scratch(tables.words, n, len(sync))
    args = scratch.args
    args.root = root.pointer
    if sync:
        scratch.sync[: len(sync)] = sync
    args.n_sync = len(sync)
    args.n = n
    scratch.tree[0, :n] = tree.tokens
    scratch.tree[1, :n] = tree.first_child
    scratch.tree[2, :n] = tree.next_sibling
    args.rows = rows.ctypes.data
    args.root_mode = root_mode
    args.budget_s = budget_s
    args.threads = threads
    address = flags.ctypes.data
    args.valid, args.filled, args.terminated = address, address + n, address + 2 * n
    if scratch.tables is not tables:
        scratch.use(tables)
    scratch.error.value = b""
    status = int(lib.walk_fn(lib.fns_address, scratch.args_address))
    if status < 0:
        raise RuntimeError(f"llguidance tree walk: {scratch.error.value.decode(errors='replace')}")
    return WalkEnd(status, args.n_filled, args.helper_filled)


class _WalkScratch:
    """One thread's reusable walk buffers (fixed addresses, set in its :class:`_WalkArgs` once):
    the tree's links, the catch-up tokens, the error text."""

    def __init__(self, words: int, nodes: int, sync: int) -> None:
        self.words, self.nodes, self.sync_room = words, nodes, sync
        self.args = _WalkArgs()
        self.args_address = ctypes.addressof(self.args)
        self.tree = np.zeros((3, nodes), dtype=np.int64)
        self.sync = np.zeros(sync, dtype=np.uint32)
        self.error = ctypes.create_string_buffer(ERROR_BYTES)
        self.tables: WalkTables | None = None
        a = self.args
        a.tokens = self.tree.ctypes.data
        a.first_child, a.next_sibling = a.tokens + 8 * nodes, a.tokens + 16 * nodes
        a.sync = self.sync.ctypes.data
        a.words = words
        a.err = ctypes.addressof(self.error)
        a.err_len = ERROR_BYTES

    def use(self, tables: WalkTables) -> None:
        a = self.args
        a.limit = tables.limit
        a.excluded = tables.excluded.ctypes.data
        a.stops = tables.stops.ctypes.data  # also the stop row (the stop ids' bitmap)
        self.tables = tables


def _thread_scratch(words: int, nodes: int, sync: int) -> _WalkScratch:
    """This thread's :class:`_WalkScratch`, (re)made when too small for the call."""
    scratch: _WalkScratch | None = getattr(_scratch, "value", None)
    if scratch is None or (
        scratch.words != words or scratch.nodes < nodes or scratch.sync_room < sync
    ):
        scratch = _WalkScratch(
            words,
            max(nodes, 256, 0 if scratch is None else scratch.nodes),
            max(sync, 1024, 0 if scratch is None else scratch.sync_room),
        )
        _scratch.value = scratch
    return scratch


_scratch = threading.local()


class NativeTokenizerSlot:
    """A :class:`NativeTokenizer` built on a background thread (Gemma's 262k ids: ~1.5 s),
    started by the first :meth:`get` or :meth:`wait`: a process that never walks a tree (a
    compile probe, a server without speculation) never builds it.

    Until it is ready (or when the native API is unavailable) :meth:`get` returns None and
    callers use their Python paths; :attr:`error` says why it failed, if it did.
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
            lib = api()
            if lib is None:
                self.error = unavailable_reason()
                return
            self._value = NativeTokenizer(lib, self._source())
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
