"""ctypes binding of ``keys.c``: per-tokenizer tables, per-schema places and per-request trackers.

The extension ``_keys`` is built with the package (``setup.py``); it is loaded on first use and
its ABI number checked (:data:`ABI`). ctypes releases the GIL for every call, so row and tree
filters run without it. Bitmask rows follow ``constrained/bitmask.py`` (int32 words, token t =
bit t%32 of word t//32).
"""

from __future__ import annotations

import array
import ctypes
import importlib.machinery
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from espalier.constrained.keys.frames import ScanAutomaton
    from espalier.constrained.schema.unique_places import Places

ABI = 11
"""``espalier_keys_abi()`` of the ``keys.c`` this binding was written for."""

EXPORT_BYTES = 4096


class KeysBuildError(RuntimeError):
    """The key tracker's extension is missing or was built from another ``keys.c``."""


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def lib() -> ctypes.CDLL:
    """The extension, loaded and checked on first call; raises :class:`KeysBuildError`."""
    global _lib
    with _lib_lock:
        if _lib is None:
            _lib = _load()
        return _lib


def _load() -> ctypes.CDLL:
    folder = Path(__file__).parent
    paths = [folder / f"_keys{s}" for s in importlib.machinery.EXTENSION_SUFFIXES]
    path = next((p for p in paths if p.exists()), None)
    if path is None:
        raise KeysBuildError(
            f"espalier's key tracker (_keys) is not built in {folder}: reinstall espalier "
            "(pip install -e . builds it with the system C compiler)"
        )
    so = ctypes.CDLL(str(path))
    vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    sig: dict[str, tuple[Any, list[Any]]] = {
        "espalier_keys_abi": (i64, []),
        "espalier_keys_tables_new": (vp, [vp, vp, i64]),
        "espalier_keys_tables_free": (None, [vp]),
        "espalier_keys_new": (vp, [vp]),
        "espalier_keys_places_new": (
            vp,
            [i32, vp, vp, i32, vp, vp, vp, vp, i64, i32, vp, i32, vp, vp, vp, i64],
        ),
        "espalier_keys_places_free": (None, [vp]),
        "espalier_keys_set_places": (None, [vp, vp]),
        "espalier_keys_frames_new": (vp, [i32, i32, vp, vp, vp, i32]),
        "espalier_keys_frames_free": (None, [vp]),
        "espalier_keys_set_frames": (None, [vp, vp]),
        "espalier_keys_free": (None, [vp]),
        "espalier_keys_fork": (vp, [vp]),
        "espalier_keys_reset": (None, [vp]),
        "espalier_keys_accepted": (i64, [vp]),
        "espalier_keys_refused": (i32, [vp]),
        "espalier_keys_accept": (i32, [vp, i64, i32]),
        "espalier_keys_accept_tokens": (i64, [vp, vp, i64]),
        "espalier_keys_rollback": (None, [vp, i64]),
        "espalier_keys_clean_prefix": (i64, [vp, vp, i64]),
        "espalier_keys_filter_row": (i32, [vp, vp, i64]),
        "espalier_keys_filter_rows": (None, [vp, vp, i64, i64, i64, vp]),
        "espalier_keys_filter_tree": (i32, [vp, i64, vp, vp, vp, vp, i64, vp, vp, vp]),
        "espalier_keys_export": (i64, [vp, vp, i64]),
    }
    so.espalier_keys_abi.restype, so.espalier_keys_abi.argtypes = i64, []
    built = int(so.espalier_keys_abi())  # first: another build may lack a symbol below
    if built != ABI:
        raise KeysBuildError(
            f"espalier's key tracker was built from keys.c ABI {built}, this binding expects "
            f"{ABI}: reinstall espalier (pip install -e .)"
        )
    for name, (restype, argtypes) in sig.items():
        fn = getattr(so, name)
        fn.restype, fn.argtypes = restype, argtypes
    return so


_filter_tree_address = 0


def filter_tree_address() -> int:
    """The address of ``espalier_keys_filter_tree``, for native callers that filter a tree's
    rows in their own call (an ``EspTreeFilterFn`` of ``llg_walk.c``, the tracker its state)."""
    global _filter_tree_address
    if not _filter_tree_address:
        address = ctypes.cast(lib().espalier_keys_filter_tree, ctypes.c_void_p).value
        assert address is not None  # a symbol ctypes found has an address
        _filter_tree_address = address
    return _filter_tree_address


class _Owned:
    """A C object this Python object frees (``handle``, freed by ``_free``)."""

    handle: int
    _free: Any

    def __del__(self) -> None:
        handle = getattr(self, "handle", None)
        if handle:
            self._free(handle)


class KeyTables(_Owned):
    """Per-tokenizer candidate index of ``keys.c`` (built once per tokenizer, shared by every
    tracker and thread; read-only). token_bytes: each token id's bytes."""

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        so = lib()
        offs = np.zeros(len(token_bytes) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in token_bytes], out=offs[1:])
        data = np.frombuffer(b"".join(token_bytes) or b"\0", dtype=np.uint8)
        self.vocab = len(token_bytes)
        self.handle = so.espalier_keys_tables_new(data.ctypes.data, offs.ctypes.data, self.vocab)
        if not self.handle:
            raise MemoryError("key tables")
        self._free = so.espalier_keys_tables_free


class PlaceTable(_Owned):
    """One schema's :class:`~espalier.constrained.schema.unique_places.Places` in ``keys.c``
    (``EspPlaces``: read-only, shared by every tracker of the schema and their forks)."""

    def __init__(self, places: Places) -> None:
        so = lib()
        n = len(places.unique)
        unique = np.array(places.unique, dtype=np.uint8)
        per_state = np.zeros((n, 9), dtype=np.int32)
        names: list[bytes] = []
        targets: list[int] = []
        prefix: list[int] = []
        words: list[bytes] = []  # tagged as the tracker stores a string item
        for s in range(n):
            keys = places.keys[s]
            per_state[s] = (
                len(names),
                len(keys),
                places.key_default[s],
                len(prefix),
                len(places.prefix[s]),
                places.item_default[s],
                places.item_chars[s],
                len(words),
                len(places.item_words[s] or ()),
            )
            # sorted bytewise: keys.c finds the words an item's text starts by binary search
            words += sorted(b"s" + w.encode() for w in places.item_words[s] or ())
            names += [name for name, _ in keys]
            targets += [target for _, target in keys]
            prefix += places.prefix[s]
        lengths, offsets, blob = _blob(names)
        key_target = np.array(targets, dtype=np.int32)
        word_len, word_off, word_blob = _blob(words)
        prefix_target = np.array(prefix, dtype=np.int32)
        self.handle = so.espalier_keys_places_new(
            n,
            unique.ctypes.data,
            per_state.ctypes.data,
            len(names),
            offsets.ctypes.data,
            lengths.ctypes.data,
            key_target.ctypes.data,
            blob.ctypes.data,
            int(lengths.sum()),
            len(prefix),
            prefix_target.ctypes.data,
            len(words),
            word_off.ctypes.data,
            word_len.ctypes.data,
            word_blob.ctypes.data,
            int(word_len.sum()),
        )
        if not self.handle:
            raise MemoryError("places")
        self._free = so.espalier_keys_places_free


class FrameTable(_Owned):
    """A scan automaton (``frames.py``) in C (``EspFrames``), shared by the trackers of one
    structural tag; read-only."""

    def __init__(self, scan: ScanAutomaton) -> None:
        so = lib()
        byte_class = np.ascontiguousarray(scan.byte_class, dtype=np.uint8)
        table = np.ascontiguousarray(scan.next, dtype=np.int32)
        found = np.ascontiguousarray(scan.found, dtype=np.uint8)
        self.handle = so.espalier_keys_frames_new(
            table.shape[0],
            table.shape[1],
            byte_class.ctypes.data,
            table.ctypes.data,
            found.ctypes.data,
            scan.rearm,
        )
        if not self.handle:
            raise ValueError("an inconsistent scan automaton, or out of memory")
        self._free = so.espalier_keys_frames_free


class KeyTracker:
    """One request's key state and rollback history (``keys.c``: the lexer over accepted token
    bytes), following ``places`` (unique items) when given. ``frames``: the JSON values are
    those the scan finds (``keys.c``'s top comment); None: the whole output is the value.
    Driven by one thread at a time; :meth:`fork` gives an independent copy."""

    __slots__ = ("_h", "_lib", "frames", "places", "tables")

    def __init__(
        self,
        tables: KeyTables,
        places: PlaceTable | None = None,
        frames: FrameTable | None = None,
    ) -> None:
        self._lib = lib()
        self.tables = tables  # keeps the tables alive while a tracker points into them
        self.places = places  # likewise
        self.frames = frames  # likewise
        self._h = self._lib.espalier_keys_new(tables.handle)
        if not self._h:
            raise MemoryError("key tracker")
        if places is not None:
            self._lib.espalier_keys_set_places(self._h, places.handle)
        if frames is not None:
            self._lib.espalier_keys_set_frames(self._h, frames.handle)

    def __del__(self) -> None:
        handle = getattr(self, "_h", None)
        if handle:
            self._lib.espalier_keys_free(handle)

    @property
    def handle(self) -> int:
        """The C tracker (``EspKeys *``) for batch calls."""
        return self._h

    @property
    def accepted(self) -> int:
        """Tokens accepted (rollback can undo that many)."""
        return int(self._lib.espalier_keys_accepted(self._h))

    @property
    def refused_key(self) -> bool:
        """The last token refused would have completed a key (not an item, nor a needless
        escape)."""
        return int(self._lib.espalier_keys_refused(self._h)) == 1

    def accept(self, token: int, *, strict: bool = True) -> bool:
        """Advance by ``token``'s bytes; False (state unchanged) when they complete a key
        already in its object, or an item already in its unique array, or (``strict``) write an
        escape a key does not need. ``strict=False``: such an escape goes through (a duplicate
        never does)."""
        done = int(self._lib.espalier_keys_accept(self._h, token, int(strict)))
        if done < 0:
            raise MemoryError("key tracker")
        return done == 1

    def accept_tokens(self, tokens: Sequence[int]) -> int:
        """Accept in order up to the first token that completes a duplicate; how many were."""
        if not tokens:
            return 0
        ids = array.array("i", tokens)  # C int32; ~5x cheaper to make than a numpy array
        address = ids.buffer_info()[0]
        done = int(self._lib.espalier_keys_accept_tokens(self._h, address, len(ids)))
        if done < 0:
            raise MemoryError("key tracker")
        return done

    def clean_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` :meth:`accept_tokens` would accept; the state is unchanged
        (one native call where ``accept_tokens`` and ``rollback`` are two)."""
        if not tokens:
            return 0
        ids = array.array("i", tokens)
        address = ids.buffer_info()[0]
        done = int(self._lib.espalier_keys_clean_prefix(self._h, address, len(ids)))
        if done < 0:
            raise MemoryError("key tracker")
        return done

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (all of them when fewer)."""
        if n > 0:
            self._lib.espalier_keys_rollback(self._h, n)

    def fork(self) -> KeyTracker:
        handle = self._lib.espalier_keys_fork(self._h)
        if not handle:
            raise MemoryError("key tracker")
        clone = KeyTracker.__new__(KeyTracker)  # as __init__, without loading the library again
        clone._lib, clone.tables, clone.places, clone.frames, clone._h = (
            self._lib,
            self.tables,
            self.places,
            self.frames,
            handle,
        )
        return clone

    def reset(self) -> None:
        self._lib.espalier_keys_reset(self._h)

    def filter_row(self, row: np.ndarray) -> bool:
        """Clear from ``row`` (int32 ``[W]``, C-contiguous, writable) the allowed tokens that
        complete a duplicate key from here, unless that would empty it: True when cleared (or
        none allowed), False when left as it was (a dead end: every way on repeats a key)."""
        assert row.dtype == np.int32 and row.flags.c_contiguous and row.ndim == 1
        done = int(self._lib.espalier_keys_filter_row(self._h, row.ctypes.data, row.shape[0]))
        if done < 0:
            raise MemoryError("key filter")
        return done == 1

    def filter_tree(
        self,
        tokens: np.ndarray,
        first_child: np.ndarray,
        next_sibling: np.ndarray,
        rows: np.ndarray,
        flags: Sequence[np.ndarray],
    ) -> None:
        """Filter a draft tree's rows in place, from this tracker's state (unchanged after).

        tokens, first_child, next_sibling: int64 ``[n]`` (``DraftTree``); rows: int32
        ``[>= n, W]`` C-contiguous, filled by the backend's walk; flags: the walk's valid,
        filled, terminated (bool ``[n]`` each, C-contiguous), updated (``keys.c``)."""
        n = int(tokens.shape[0])
        arrays = [
            np.ascontiguousarray(a, dtype=np.int64) for a in (tokens, first_child, next_sibling)
        ]
        assert rows.dtype == np.int32 and rows.flags.c_contiguous and rows.shape[0] >= n
        assert all(f.dtype == np.bool_ and f.flags.c_contiguous and f.shape == (n,) for f in flags)
        done = self._lib.espalier_keys_filter_tree(
            self._h,
            n,
            *(a.ctypes.data for a in arrays),
            rows.ctypes.data,
            rows.shape[1],
            *(f.ctypes.data for f in flags),
        )
        if done < 0:
            raise MemoryError("key filter")

    def export(self) -> bytes:
        """The state in ``espalier_keys_export``'s layout (tests compare it with the twin)."""
        size = EXPORT_BYTES
        while True:
            buf = ctypes.create_string_buffer(size)
            need = int(self._lib.espalier_keys_export(self._h, buf, size))
            if need <= size:
                return buf.raw[:need]
            size = need


def filter_rows(
    trackers: Sequence[KeyTracker], rows: np.ndarray, index: Sequence[int], threads: int
) -> np.ndarray:
    """:meth:`KeyTracker.filter_row` for ``rows[index[j]]`` with ``trackers[j]`` (distinct) in
    one call on up to ``threads`` native threads; rows: int32 ``[B, W]`` C-contiguous. Returns
    int8 ``[len(trackers)]``: 1 cleared, 0 a dead end left as it was, -1 out of memory."""
    n = len(trackers)
    assert rows.dtype == np.int32 and rows.flags.c_contiguous and n == len(index)
    handles = np.array([t.handle for t in trackers], dtype=np.uint64)
    stride = rows.shape[1] * rows.itemsize
    pointers = rows.ctypes.data + np.asarray(index, dtype=np.uint64) * np.uint64(stride)
    results = np.zeros(n, dtype=np.int8)
    lib().espalier_keys_filter_rows(
        handles.ctypes.data, pointers.ctypes.data, n, rows.shape[1], threads, results.ctypes.data
    )
    return results


def _blob(parts: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``parts`` as (int32 lengths, int64 offsets, one uint8 buffer), for ``keys.c``."""
    lengths = np.array([len(b) for b in parts], dtype=np.int32)
    offsets = np.zeros(len(parts), dtype=np.int64)
    if parts:
        np.cumsum(lengths[:-1], out=offsets[1:])
    return lengths, offsets, np.frombuffer(b"".join(parts) or b"\0", dtype=np.uint8)
