"""``server/gc_freeze.py``: the startup heap goes to the collector's permanent generation, and
young objects are collected after ``YOUNG_THRESHOLD`` allocations, not CPython's 700.

Run in a fresh interpreter: in the test session, other threads (pools left idle by earlier
tests) may free frozen objects between two reads of the freeze count."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import gc

from espalier.server.gc_freeze import YOUNG_THRESHOLD, freeze_startup_heap

default = gc.get_threshold()
before = [object() for _ in range(10)], {"startup": [1, 2, 3]}
frozen = freeze_startup_heap()
assert frozen == gc.get_freeze_count() > 0, (frozen, gc.get_freeze_count())
assert not any(obj is before[1] for obj in gc.get_objects())  # frozen: not tracked
later = {"made": ["after"]}  # a container of containers: tracked
assert any(obj is later for obj in gc.get_objects())  # new objects are collected as usual
assert gc.get_threshold() == (YOUNG_THRESHOLD, default[1], default[2]), gc.get_threshold()
assert YOUNG_THRESHOLD > 20 * default[0]
collections = gc.get_stats()[0]["collections"]
for _ in range(10 * default[0]):  # cycles: only the collector frees them
    cycle = []
    cycle.append(cycle)
# ten default thresholds' worth of net allocations: no young collection in between
assert gc.get_stats()[0]["collections"] == collections, gc.get_stats()
print("ok", frozen)
"""


def test_freeze_moves_live_objects_out_of_collection_and_later_ones_stay_collectable() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok ")
