"""Fewer and shorter garbage-collector pauses in the trainer process.

The trainer process holds the model, the optimizer and every imported module: millions of Python
objects that live as long as the process. CPython's full collection walks all of them, and it runs
in whichever thread allocates, holding the interpreter lock: with the rollout pool's event loop in
that process, each full collection stalls every episode for its length (0.6 s at 64 servers of the
scale simulation, ``docs/guides/scale-simulation.md``). :func:`freeze_startup_objects` moves what
exists once the trainer is built into CPython's permanent generation (``gc.freeze``), which no
collection walks, as vLLM and SGLang do in their servers after start-up; cycles made later are
still collected.
"""

from __future__ import annotations

import gc
import time


def freeze_startup_objects() -> float:
    """Collect once, then exempt every object alive now from later collections; returns the seconds taken."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - start
