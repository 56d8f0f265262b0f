"""The scan that finds where a structural tag's JSON values start (``keys.c``'s frames).

A :class:`~espalier.constrained.structural_tag.Framing` says where its values are: after the
first occurrence of a gate (the reasoning end marker), then after each occurrence of a begin
(a tag's), found again after each value of a tag list. :func:`scan_automaton` makes that one
deterministic automaton over bytes: the gate's string-matching automaton (Knuth-Morris-Pratt),
whose last state is the root of the begins' (Aho-Corasick, failure links folded into the
table). A found state is where a value starts; after a value the scan goes on from the
begins' root (``rearm``). Why one table: the tracker's state stays one int32 that its marks
save and restore, and a byte costs one lookup.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

MAX_FRAME_BYTES = 4096
"""The gate's and the begins' bytes together; a longer framing is not followed (the table is
one row per byte)."""


@dataclass(frozen=True)
class ScanAutomaton:
    """``next[s, byte_class[b]]``: the state after byte ``b`` in state ``s`` (state 0: the
    start). ``found[s]``: a value starts right after. ``rearm``: the state after a value (-1:
    nothing more is read). byte_class: uint8 ``[256]`` (class 0: bytes in no frame); next:
    int32 ``[n_states, n_classes]``; found: uint8 ``[n_states]``."""

    byte_class: np.ndarray
    next: np.ndarray
    found: np.ndarray
    rearm: int


def scan_automaton(gate: bytes, begins: tuple[bytes, ...], rearm: bool) -> ScanAutomaton:
    """The scan for ``gate`` (b"": none), then ``begins`` (none: the value follows the gate;
    then ``gate`` must be non-empty), found again after each value when ``rearm``. Raises
    ValueError past :data:`MAX_FRAME_BYTES`, for an empty begin, or for nothing to find."""
    if not gate and not begins:
        raise ValueError("a framing needs a gate or a begin")
    if any(not b for b in begins):
        raise ValueError("an empty begin")
    if len(gate) + sum(len(b) for b in begins) > MAX_FRAME_BYTES:
        raise ValueError(f"frames of more than {MAX_FRAME_BYTES} bytes")
    alphabet = sorted(set(gate).union(*begins))
    byte_class = np.zeros(256, dtype=np.uint8)
    for i, b in enumerate(alphabet, 1):
        byte_class[b] = i
    classes = len(alphabet) + 1
    # the begins' trie, its states after the gate's len(gate) states
    root = len(gate)
    children: list[dict[int, int]] = [{}]
    ends = [False]
    for begin in begins:
        at = 0
        for b in begin:
            if b not in children[at]:
                children[at][b] = len(children)
                children.append({})
                ends.append(False)
            at = children[at][b]
        ends[at] = True
    n = root + len(children)
    table = np.zeros((n, classes), dtype=np.int32)
    found = np.zeros(n, dtype=np.uint8)
    _gate_rows(gate, table, byte_class)
    _begin_rows(children, ends, root, table, found, byte_class)
    if not begins:
        found[root] = 1
    return ScanAutomaton(byte_class, table, found, root if rearm and begins else -1)


def _gate_rows(gate: bytes, table: np.ndarray, byte_class: np.ndarray) -> None:
    """Rows ``0 .. len(gate) - 1``: bytes of ``gate`` matched so far (state ``len(gate)``: all
    of it, the begins' root)."""
    border = 0  # the state the matched prefix's longest proper border reaches
    for j, b in enumerate(gate):
        if j:
            table[j] = table[border]
        table[j, byte_class[b]] = j + 1
        if j:
            border = int(table[border, byte_class[b]])


def _begin_rows(
    children: list[dict[int, int]],
    ends: list[bool],
    root: int,
    table: np.ndarray,
    found: np.ndarray,
    byte_class: np.ndarray,
) -> None:
    """Rows ``root ..``: the begins' trie with its failure links folded in (breadth first)."""
    fail = [0] * len(children)
    done = list(ends)
    queue: deque[int] = deque()
    table[root] = root  # a byte that starts no begin: back to the root
    for b, child in children[0].items():
        table[root, byte_class[b]] = root + child
        queue.append(child)
    while queue:
        at = queue.popleft()
        table[root + at] = table[root + fail[at]]
        done[at] = done[at] or done[fail[at]]
        for b, child in children[at].items():
            fail[child] = int(table[root + fail[at], byte_class[b]]) - root if at else 0
            table[root + at, byte_class[b]] = root + child
            queue.append(child)
    for at, flag in enumerate(done):
        found[root + at] = flag
