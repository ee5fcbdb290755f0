"""megarl.utils.gc_pauses: what exists at start-up is out of every later collection."""

import gc

from megarl.utils.gc_pauses import freeze_startup_objects


def test_startup_objects_are_frozen_and_later_cycles_still_collected():
    class Node:
        pass

    before = gc.get_freeze_count()
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > before  # the start-up objects: no full collection walks them
        tracked = len(gc.get_objects())
        cycle = Node()
        cycle.self = cycle
        del cycle
        assert gc.collect() >= 1  # a cycle made after start-up is still found
        assert len(gc.get_objects()) <= tracked + 1
    finally:
        gc.unfreeze()
