"""megarl.utils.gc_pauses: what exists at start-up is out of every later collection, and objects that
live a while and die by reference count (a pool's episodes in flight) bring no full collection."""

import collections
import gc

import pytest

from megarl.utils.gc_pauses import freeze_startup_objects


@pytest.fixture
def restore_gc():
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)
    gc.unfreeze()


def test_startup_objects_are_frozen_and_later_cycles_still_collected(restore_gc):
    class Node:
        pass

    before = gc.get_freeze_count()
    freeze_startup_objects()
    assert gc.get_freeze_count() > before  # the start-up objects: no full collection walks them
    tracked = len(gc.get_objects())
    cycle = Node()
    cycle.self = cycle
    del cycle
    assert gc.collect() >= 1  # a cycle made after start-up is still found
    assert len(gc.get_objects()) <= tracked + 1


def test_objects_in_flight_bring_no_full_collection(restore_gc):
    """20,000 objects alive at a time, a million made in bursts of 1,000 and dropped in turn (each
    outlives the young collections, as an episode's objects do): CPython's default thresholds ran
    seven full collections over this, each walking every object in flight."""
    collections_by_generation = collections.Counter()

    def count(phase, info):
        if phase == "start":
            collections_by_generation[info["generation"]] += 1

    freeze_startup_objects()
    gc.callbacks.append(count)
    try:
        in_flight = collections.deque([i] for i in range(20_000))
        for burst in range(1_000):
            in_flight.extend([burst, i] for i in range(1_000))
            for _ in range(1_000):
                in_flight.popleft()
    finally:
        gc.callbacks.remove(count)
    assert collections_by_generation[2] <= 1
    assert collections_by_generation[0] >= 500  # the young generations are collected as before
