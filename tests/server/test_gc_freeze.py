"""``server/gc_freeze.py``: the startup heap goes to the collector's permanent generation."""

from __future__ import annotations

import gc

from espalier.server.gc_freeze import freeze_startup_heap


def test_freeze_moves_live_objects_out_of_collection_and_later_ones_stay_collectable() -> None:
    before = [object() for _ in range(10)], {"startup": [1, 2, 3]}
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > 0
        assert not any(obj is before[1] for obj in gc.get_objects())  # frozen: not tracked
        later = {"made": ["after"]}  # a container of containers: tracked
        assert any(obj is later for obj in gc.get_objects())  # new objects are collected as usual
    finally:
        gc.unfreeze()  # the rest of the test session keeps its normal collector
