"""Closing-path searches in C (``llg_close.c``) for llguidance matchers, several in one call.

``espalier_llg_close_batch`` runs ``ClosingPaths.search`` (``engine/closing/``) choice for
choice on C-API matchers, on native threads with the GIL released: per search, a clone of the
request's *closing base* (a C-API matcher at a prefix of its history, never advanced itself, so
any thread may clone it) consumes the rest of the history and the decided token, then the
greedy search runs with the adapter's rules and, for a matcher wrapped by the duplicate-key
tracker, the wrapper's (``keys.c`` through function pointers). A search that hits an llguidance
error comes back as ``base.FALLBACK``: the caller runs the Python search, which raises it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from espalier.constrained import bitmask as bm
from espalier.constrained.backends.llguidance.native import capi
from espalier.constrained.base import FALLBACK

if TYPE_CHECKING:
    from espalier.constrained.base import ClosingPolicy, ClosingRules, ClosingTree, NodeDecision

CLOSE_ABI = 2
"""``espalier_llg_close_abi()`` of the ``llg_close.c`` this binding was written for."""

CLOSE_FOUND, CLOSE_NONE, CLOSE_REJECTED = 0, 1, 2
TREE_DONE = 0
TREE_FIELDS = 8
REBASE_AFTER = 8
"""History tokens past the closing base after which a search hands back a new base."""
PATH_CAP = 4096
"""Longest path a native search returns (a longer limit is capped here; FALLBACK past it)."""


REJECTED = False
"""The matcher does not accept the decided token."""

SearchOutcome = list[int] | None | bool | object
"""A path, None (none within the limit), REJECTED, or ``base.FALLBACK``."""


class _CloseApi(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "consume",
            "validate",
            "ff_tokens",
            "is_accepting",
            "mask_into",
            "is_error",
            "clone",
            "free_matcher",
        )
    ]


class _KeysApi(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_void_p)
        for name in ("fork", "free_keys", "accept", "accept_tokens", "rollback", "filter_row")
    ]


class _Tables(ctypes.Structure):
    _fields_ = [
        ("candidates", ctypes.c_void_p),
        ("n_candidates", ctypes.c_int64),
        ("closers_first", ctypes.c_void_p),
        ("n_closers_first", ctypes.c_int64),
        ("quote", ctypes.c_int64),
        ("closers", ctypes.c_void_p),
        ("blank", ctypes.c_void_p),
        ("stops", ctypes.c_void_p),
        ("excluded", ctypes.c_void_p),
        ("words", ctypes.c_int64),
        ("tokenizer_vocab", ctypes.c_int64),
        ("vocab_size", ctypes.c_int64),
        ("repeat_limit", ctypes.c_int64),
        ("lowest", ctypes.c_int64),
    ]


class _Job(ctypes.Structure):
    _fields_ = [
        ("base", ctypes.c_void_p),
        ("sync", ctypes.c_void_p),
        ("n_sync", ctypes.c_int64),
        ("token", ctypes.c_int64),
        ("limit", ctypes.c_int64),
        ("stop_depth", ctypes.c_int64),
        ("keys", ctypes.c_void_p),
        ("rebase", ctypes.c_int64),
        ("path", ctypes.c_void_p),
        ("path_cap", ctypes.c_int64),
        ("status", ctypes.c_int64),
        ("path_len", ctypes.c_int64),
        ("new_base", ctypes.c_void_p),
    ]


class _TreePolicy(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int64)
        for name in ("search_limit", "margin", "growth_per_token", "every_token")
    ]


_TREE_JOB = np.dtype(
    [
        (name, np.int64)
        for name in (
            "base",
            "sync",
            "n_sync",
            "stop_depth",
            "keys",
            "eos",
            "tokens",
            "parents",
            "filled",
            "n",
            "stops",
            "n_stops",
            "here",
            "max_tokens",
            "room",
            "known_here",
            "known",
            "known_len",
            "next_check",
            "unclosable",
            "rebase",
            "out",
            "buf",
            "buf_cap",
            "status",
            "new_base",
        )
    ]
)
"""``EspTreeJob`` (``llg_close.c``: every field 8 bytes, pointers as addresses), one row a
tree: the jobs of a call are filled column by column."""
_TREE_SCALARS = (
    "base",
    "stop_depth",
    "keys",
    "eos",
    "here",
    "max_tokens",
    "room",
    "known_here",
    "next_check",
    "unclosable",
    "rebase",
)
"""The :data:`_TREE_JOB` fields filled from each job's own values (the rest point into arrays)."""


class CloseLib:
    """The search function and the tables of the functions it calls."""

    def __init__(self, lib: capi.Api) -> None:
        walk = lib.walk
        built = 0  # built before llg_close.c was part of the extension
        if hasattr(walk, "espalier_llg_close_abi"):
            walk.espalier_llg_close_abi.restype = ctypes.c_int64
            built = int(walk.espalier_llg_close_abi())
        if built != CLOSE_ABI:
            raise capi.NativeBuildError(
                f"espalier's native closing search was built from llg_close.c ABI {built}, this "
                f"binding expects {CLOSE_ABI}: reinstall espalier (pip install -e .)"
            )
        vp = ctypes.c_void_p
        self.batch = walk.espalier_llg_close_batch
        self.batch.restype = ctypes.c_int64
        self.batch.argtypes = [vp, vp, vp, vp, ctypes.c_int64, ctypes.c_int64]
        self.trees = walk.espalier_llg_close_trees
        self.trees.restype = ctypes.c_int64
        self.trees.argtypes = [vp, vp, vp, vp, vp, ctypes.c_int64, ctypes.c_int64]
        names = (
            "llg_matcher_consume_token",
            "llg_matcher_validate_tokens",
            "llg_matcher_compute_ff_tokens",
            "llg_matcher_is_accepting",
            "llg_matcher_compute_mask_into",
            "llg_matcher_is_error",
            "llg_clone_matcher",
            "llg_free_matcher",
        )
        self.llg_fns = _CloseApi(*(capi._address(lib.llg, name) for name in names))
        self.keys_fns: _KeysApi | None = None
        self.api = lib

    def keys_api(self) -> _KeysApi:
        """``keys.c``'s functions (loaded on the first keyed search)."""
        if self.keys_fns is None:
            from espalier.constrained.keys.native import lib as keys_lib

            so = keys_lib()
            names = ("fork", "free", "accept", "accept_tokens", "rollback", "filter_row")
            self.keys_fns = _KeysApi(
                *(capi._address(so, f"espalier_keys_{name}") for name in names)
            )
        return self.keys_fns


_close_lib: CloseLib | None = None


def close_lib() -> CloseLib:
    """The binding, checked on first call (raises ``NativeBuildError`` like ``capi.api``)."""
    global _close_lib
    if _close_lib is None:
        _close_lib = CloseLib(capi.api())
    return _close_lib


class CloseTables:
    """``EspCloseTables`` for one tokenizer and one set of :class:`ClosingRules` (kept alive
    with their arrays)."""

    def __init__(
        self, rules: ClosingRules, tables: capi.WalkTables, tokenizer_vocab: int, vocab_size: int
    ) -> None:
        bits = tables.words * bm.BITS_PER_WORD
        candidates = np.array(rules.candidates or [0], dtype=np.int64)
        closers_first = np.array(rules.closers_first or [0], dtype=np.int64)
        closers = bm.row_from_tokens(sorted(rules.closers), bits).view(np.uint32)
        blank = bm.row_from_tokens(sorted(rules.blank), bits).view(np.uint32)
        self._arrays = (candidates, closers_first, closers, blank)  # pointed to by the struct
        self.struct = _Tables(
            candidates.ctypes.data,
            len(rules.candidates),
            closers_first.ctypes.data,
            len(rules.closers_first),
            -1 if rules.quote is None else rules.quote,
            closers.ctypes.data,
            blank.ctypes.data,
            tables.stops.ctypes.data,
            tables.excluded.ctypes.data,
            tables.words,
            tokenizer_vocab,
            vocab_size,
            rules.repeat_limit,
            rules.lowest,
        )
        self._walk_tables = tables  # its stops / excluded arrays are pointed to


@dataclass(frozen=True)
class CloseJob:
    """One search: from ``base`` (a C-API matcher at a prefix of the matcher's history), the
    rest of the history (``sync``; ``length`` tokens in all), then ``token`` (None: none), at
    most ``limit`` tokens; ``stop_depth`` the matcher's; ``keys``: its key tracker's handle (0:
    none; the caller keeps it alive); ``rebase``: hand back a base at the history's end."""

    base: capi.NativeMatcher
    sync: Sequence[int]
    length: int
    token: int | None
    limit: int
    stop_depth: int
    keys: int
    rebase: bool


def run_jobs(
    tables: CloseTables, jobs: Sequence[CloseJob], threads: int
) -> tuple[list[SearchOutcome], list[capi.NativeMatcher | None]]:
    """Every job in one ``espalier_llg_close_batch`` call on up to ``threads`` threads: the
    outcome of each and, where asked, its new base (a :class:`capi.NativeMatcher`)."""
    lib = close_lib()
    n = len(jobs)
    arrays: list[Any] = []
    structs = (_Job * max(n, 1))()
    caps = [min(max(job.limit, 0), PATH_CAP) + 1 for job in jobs]
    paths = np.zeros(max(sum(caps), 1), dtype=np.int64)
    offset = 0
    keyed = False
    for j, job in enumerate(jobs):
        sync = np.asarray(job.sync, dtype=np.uint32)
        arrays.append(sync)
        keyed = keyed or bool(job.keys)
        s = structs[j]
        s.base = job.base.pointer
        s.sync = sync.ctypes.data
        s.n_sync = sync.shape[0]
        s.token = -1 if job.token is None else job.token
        s.limit = job.limit
        s.stop_depth = job.stop_depth
        s.keys = job.keys or None
        s.rebase = int(job.rebase)
        s.path = paths.ctypes.data + 8 * offset
        s.path_cap = caps[j]
        offset += caps[j]
    keys_api = ctypes.addressof(lib.keys_api()) if keyed else None
    lib.batch(
        ctypes.addressof(lib.llg_fns),
        keys_api,
        ctypes.addressof(tables.struct),
        ctypes.addressof(structs),
        n,
        max(1, threads),
    )
    outcomes: list[SearchOutcome] = []
    bases: list[capi.NativeMatcher | None] = []
    offset = 0
    for j, job in enumerate(jobs):
        s = structs[j]
        status = int(s.status)
        if status == CLOSE_FOUND:
            outcomes.append(paths[offset : offset + int(s.path_len)].tolist())
        elif status == CLOSE_NONE:
            outcomes.append(None)
        elif status == CLOSE_REJECTED:
            outcomes.append(REJECTED)
        else:
            outcomes.append(FALLBACK)
        offset += caps[j]
        new = int(s.new_base or 0)
        bases.append(capi.NativeMatcher(job.base.tokenizer, new) if new else None)
    return outcomes, bases


def run_tree_jobs(
    tables: CloseTables,
    policy: ClosingPolicy,
    jobs: Sequence[tuple[CloseJob, int, ClosingTree]],
    threads: int,
) -> tuple[list[list[NodeDecision | None] | object], list[capi.NativeMatcher | None]]:
    """Each tree's decisions (``engine/closing/ahead.tree_decisions``'s, node for node) in one
    ``espalier_llg_close_trees`` call on up to ``threads`` threads, or ``base.FALLBACK`` for a
    tree that must be decided in Python, and where ``job.rebase`` asked, a new base at the
    root. A job: its root's search (``job.token`` and ``job.limit`` unused), the EOS id
    ``Matcher.completes`` validates after a try, the tree. The inputs of all trees go in a few
    concatenated arrays (a call's Python work is mostly per tree, so it is kept small)."""
    lib = close_lib()
    n = len(jobs)
    table = np.zeros(max(n, 1), dtype=_TREE_JOB)
    sizes = [len(tree.tokens) for _, _, tree in jobs]
    knowns = [tree.known[1] if tree.known is not None else [] for _, _, tree in jobs]
    stops = [sorted(tree.stops) for _, _, tree in jobs]
    syncs = [job.sync for job, _, _ in jobs]
    # every node adds at most two paths no longer than its budget plus a closer
    budgets = [
        max(0, min(tree.max_tokens - tree.here, tree.room - tree.here)) for _, _, tree in jobs
    ]
    caps = [
        len(k) + size * 2 * (min(b, PATH_CAP) + 2) for k, size, b in zip(knowns, sizes, budgets)
    ]
    ints = np.array(
        [
            x
            for (_, _, tree), known, stop in zip(jobs, knowns, stops)
            for part in (tree.tokens, tree.parents, stop, known)
            for x in part
        ]
        or [0],
        dtype=np.int64,
    )
    sync = np.array([t for part in syncs for t in part] or [0], dtype=np.uint32)
    filled = np.concatenate(
        [
            np.ones(size, np.uint8) if tree.filled is None else np.asarray(tree.filled, np.uint8)
            for size, (_, _, tree) in zip(sizes, jobs)
        ]
        or [np.zeros(1, np.uint8)]
    )
    out = np.zeros(max(sum(sizes), 1) * TREE_FIELDS, dtype=np.int64)
    buf = np.zeros(max(sum(caps), 1), dtype=np.int64)
    lengths = np.array([[s, s, len(st), len(k)] for s, st, k in zip(sizes, stops, knowns)])
    if n:
        starts = np.cumsum(lengths.ravel()) - lengths.ravel()  # each part's first int
        at = ints.ctypes.data + 8 * starts.reshape(n, 4)
        nodes = np.cumsum(sizes) - sizes
        table["tokens"][:n], table["parents"][:n] = at[:, 0], at[:, 1]
        table["stops"][:n], table["known"][:n] = at[:, 2], at[:, 3]
        table["n"][:n], table["n_stops"][:n], table["known_len"][:n] = (
            lengths[:, 0],
            lengths[:, 2],
            lengths[:, 3],
        )
        table["filled"][:n] = filled.ctypes.data + nodes
        table["out"][:n] = out.ctypes.data + 8 * TREE_FIELDS * nodes
        table["buf"][:n] = buf.ctypes.data + 8 * (np.cumsum(caps) - caps)
        table["buf_cap"][:n] = caps
        sync_lengths = [len(part) for part in syncs]
        table["sync"][:n] = sync.ctypes.data + 4 * (np.cumsum(sync_lengths) - sync_lengths)
        table["n_sync"][:n] = sync_lengths
        table[list(_TREE_SCALARS)][:n] = [
            (
                job.base.pointer,
                job.stop_depth,
                job.keys,
                eos,
                tree.here,
                tree.max_tokens,
                tree.room,
                -1 if tree.known is None else tree.known[0],
                tree.next_check,
                int(tree.unclosable),
                int(job.rebase),
            )
            for job, eos, tree in jobs
        ]
    rules = _TreePolicy(
        policy.search_limit, policy.margin, policy.growth_per_token, policy.every_token
    )
    keyed = any(job.keys for job, _, _ in jobs)
    keys_api = ctypes.addressof(lib.keys_api()) if keyed else None
    lib.trees(
        ctypes.addressof(lib.llg_fns),
        keys_api,
        ctypes.addressof(tables.struct),
        ctypes.addressof(rules),
        table.ctypes.data,
        n,
        max(1, threads),
    )
    rows = out.reshape(-1, TREE_FIELDS).tolist()
    results: list[list[NodeDecision | None] | object] = []
    bases: list[capi.NativeMatcher | None] = []
    first = buf_at = 0
    for j, (job, _, _) in enumerate(jobs):
        mine = buf[buf_at : buf_at + caps[j]]  # a job's offsets are into its own part
        buf_at += caps[j]
        new = int(table["new_base"][j])
        bases.append(capi.NativeMatcher(job.base.tokenizer, new) if new else None)
        if int(table["status"][j]) != TREE_DONE:
            results.append(FALLBACK)
        else:
            results.append(_decisions(rows[first : first + sizes[j]], mine))
        first += sizes[j]
    return results, bases


def _decisions(rows: list[list[int]], buf: np.ndarray) -> list[NodeDecision | None]:
    """The out rows of one tree as :data:`NodeDecision`s (paths sliced from ``buf``, one list
    for each distinct span)."""
    spans: dict[tuple[int, int], list[int]] = {}

    def span(at: int, length: int) -> list[int]:
        found = spans.get((at, length))
        if found is None:
            found = spans[(at, length)] = buf[at : at + length].tolist()
        return found

    decisions: list[NodeDecision | None] = []
    for decided, close_at, close_len, known_here, known_at, known_len, check, unclosable in rows:
        if not decided:
            decisions.append(None)
            continue
        close = span(close_at, close_len) if close_len >= 0 else None
        known = (known_here, span(known_at, known_len)) if known_here >= 0 else None
        decisions.append((close, known, check, bool(unclosable)))
    return decisions
