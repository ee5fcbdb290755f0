"""Fewer and shorter garbage-collector pauses in the trainer process.

The trainer process holds the model, the optimizer and every imported module: millions of Python
objects that live as long as the process. CPython's full collection walks all of them, and it runs
in whichever thread allocates, holding the interpreter lock: with the rollout pool's event loop in
that process, each full collection stalls every episode for its length (0.6 s at 64 servers of the
scale simulation, ``docs/guides/scale-simulation.md``). :func:`freeze_startup_objects` moves what
exists once the trainer is built into CPython's permanent generation (``gc.freeze``), which no
collection walks, as vLLM and SGLang do in their servers after start-up; cycles made later are
still collected.

What a full collection still walks then is the pool's episodes in flight (their tasks, coroutines,
requests and token lists: about 170,000 objects at 2,048 episodes), which live for seconds, so that
nearly all of them reach the oldest generation, and die by reference count, not in cycles: at 256
simulated servers every full collection after start-up found nothing to free, and each took 0.15 to
0.5 s, one every 3 s. So full collections are also made rarer (:data:`YOUNG_COLLECTIONS_PER_FULL`);
the young generations, where short-lived cycles are found, are collected as often as before.
"""

from __future__ import annotations

import gc
import time

YOUNG_COLLECTIONS_PER_FULL = 1000
"""Collections of the middle generation between two full collections (CPython's default: 10). A
cycle that reached the oldest generation waits for the next full collection: minutes at a pool's
rate of allocation, instead of seconds."""


def freeze_startup_objects() -> float:
    """Collect once, exempt every object alive now from later collections and make full collections
    rarer (:data:`YOUNG_COLLECTIONS_PER_FULL`); returns the seconds taken."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, YOUNG_COLLECTIONS_PER_FULL)
    return time.perf_counter() - start
