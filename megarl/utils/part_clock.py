"""Wall seconds of a repeated piece of work, summed by part (the train step's forward, backward, optimizer).

On a CPU the wall clock tells what ran; on a GPU the work is asynchronous, so a clock made with
``enabled=False`` records nothing (and costs nothing) rather than timing kernel launches.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator


class PartClock:
    """``seconds[part]``: the summed wall time of every ``with clock.part(name):`` since :meth:`reset`."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def timed(self, name: str, fn: Callable) -> Callable:
        """``fn``, its calls counted in part ``name``."""

        def call(*args, **kwargs):
            with self.part(name):
                return fn(*args, **kwargs)

        return call

    def reset(self) -> None:
        self.seconds = {}
