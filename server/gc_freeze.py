"""Keep the cyclic garbage collector off the serving path: freeze the startup heap, and collect
young objects rarely.

After loading, the process holds a few hundred thousand long-lived container objects (the
tokenizer's tables, compiled grammars, model modules). A full collection walks all of them:
several milliseconds during which no Python thread runs, so a grammar mask due within its
2 ms budget or a decode step waits for it. Freezing moves what exists into a permanent
generation the collector skips; objects made later are collected as usual. Measured with
``bench/tree.py`` trees (llguidance, 64 nodes, 2 ms budget): the slowest budgeted fill
went from 5.0 to 2.9 ms and the share within the budget from 72 % to 88 %.

A step's objects (requests' token lists, closing memos, tree drafts, futures) die by reference
counting within the step. CPython's default young-generation threshold (700 net container
allocations) still starts a collection every few hundred of them, and each one walks whatever
is alive at that moment, from any thread, while every other Python thread waits. At batch 32 a
constrained speculative step ran one such collection every step or two, and each timed run one
full collection. :data:`YOUNG_THRESHOLD` makes them ~70 times rarer; the objects a collection
would find are still found, later (SGLang's ``--gc-threshold`` and lmdeploy make the same
trade). The numbers: ``docs/decisions/gc-young-threshold.md``.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000
"""Net container allocations between two young-generation collections (CPython's default:
700); the older generations keep their defaults (each after 10 collections of the one below)."""


def freeze_startup_heap() -> int:
    """Collect once, freeze every surviving object, and raise the young generation's threshold
    to :data:`YOUNG_THRESHOLD`; returns how many objects were frozen. Call it once the process
    has loaded what it serves with (the server, the engine process, benchmarks that mirror
    them)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
    return gc.get_freeze_count()
