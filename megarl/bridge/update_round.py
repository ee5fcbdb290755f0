"""One weight update's calls to the servers: one call per server, two waits, relative deadlines.

The trainer's rank 0 makes each server's whole update one call (:meth:`ServerControl.aupdate`, on the
process's control loop, :mod:`megarl.serving.control_loop`) and waits twice: until every server has
paused and begun the update (then the trainer ranks send), and until every server has committed.

Each wait has a deadline of its own, relative to the fleet: ``update_timeout`` at most, and once half
the servers have answered, ``max(straggler_floor_s, straggler_factor x`` their median answer time``)``.
A server past it (slow but alive, or its health check answering while its control route hangs) is
failed with the reason named; its call is cancelled, the others go on.
"""

from __future__ import annotations

import asyncio
import statistics

from megarl.config.bridge import WeightUpdateConfig
from megarl.serving import ServerControl
from megarl.serving.control_loop import ControlLoop, control_loop

PAUSED, COMMITTED = "paused", "committed"
"""The two stages every server reports."""


def stage_deadline(answered: list[float], servers: int, config: WeightUpdateConfig, since: float = 0.0) -> float:
    """Seconds from a stage's start (at time ``since``) by which every server must have answered it, given
    the times at which servers answered so far (``answered``, ascending; one before ``since`` counts as
    0) of ``servers`` in all. O(1): the median is read off the middle of ``answered``."""
    n = len(answered)
    if 2 * n < servers:  # half the fleet first: a median of a few says little
        return config.update_timeout
    low, high = (max(0.0, answered[i] - since) for i in ((n - 1) // 2, n // 2))
    return config.deadline_after((low + high) / 2)


DEADLINE_TICK_S = 0.1
"""How often a wait recomputes its stage's deadline from the answers so far: waking at every answer cost a
task and a timer per server and stage (2,048 wake-ups an update at 1,024 servers)."""


class UpdateRound:
    """The calls of one update to ``servers`` (rank 0 only): :meth:`start`, :meth:`wait_paused`, then the
    trainer sends, then :meth:`wait_committed`; ``failed`` names each failed server and why."""

    def __init__(
        self,
        servers: list[ServerControl],
        mode: str,
        path: str | None,
        version: int,
        config: WeightUpdateConfig,
        loop: ControlLoop | None = None,
        resume: bool = False,
    ):
        self.servers, self.mode, self.path, self.version, self.config = servers, mode, path, version, config
        self.resume = resume
        """Each server generates again once it committed (no rollout side resumes it after the update)."""
        self.loop = loop or control_loop()
        self.failed: dict[str, str] = {}
        self.answered: dict[str, list[float]] = {PAUSED: [], COMMITTED: []}
        """Per stage, the loop times at which servers reached it, in order."""
        self._open: dict[str, set[str]] = {stage: {s.address for s in servers} for stage in self.answered}
        """Per stage, the servers that have neither reached it nor failed (kept as answers come: a wait
        does not go over the whole fleet at every answer)."""
        self._began: dict[str, float] = {}
        """Per stage, the loop time its clock started: the calls' sending (paused), the transfer's start
        (committed: when :meth:`wait_paused` returned; receivers commit while the trainer sends)."""
        self._tasks: dict[str, asyncio.Task] = {}
        self._changed: asyncio.Event | None = None

    def start(self) -> None:
        """Send every server its update call (returns at once)."""
        self.loop.run(self._start())

    async def _start(self) -> None:
        self._changed = asyncio.Event()
        self._began[PAUSED] = asyncio.get_running_loop().time()
        connections = self.loop.connections()
        for server in self.servers:
            self._tasks[server.address] = asyncio.ensure_future(self._call(connections, server))

    async def _call(self, connections, server: ServerControl) -> None:
        loop, address = asyncio.get_running_loop(), server.address

        def reached(stage: str) -> None:
            if address in self._open[stage]:
                self._open[stage].discard(address)
                self.answered[stage].append(loop.time())
                if not self._open[stage]:  # the stage is over (the wait looks at its deadline by the clock)
                    self._changed.set()

        try:
            await server.aupdate(connections, self.mode, self.path, self.version, lambda: reached(PAUSED), self.resume)
            reached(PAUSED)  # a reply without its "paused" line still passed the stage
            reached(COMMITTED)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 (each server's failure is its own, named in the report)
            self._fail(address, f"{type(e).__name__}: {e}")

    def _fail(self, address: str, why: str) -> None:
        self.failed.setdefault(address, why)
        for waiting in self._open.values():
            waiting.discard(address)
        self._changed.set()

    def wait_paused(self) -> dict[str, str]:
        """Block until every server has paused and begun the update, failed, or passed its deadline; the
        failed servers so far."""
        return self.loop.run(self._wait(PAUSED))

    def wait_committed(self) -> dict[str, str]:
        """Block until every server has committed the version, failed, or passed its deadline; the failed
        servers (a server past its deadline has its call cancelled)."""
        return self.loop.run(self._wait(COMMITTED))

    async def _wait(self, stage: str) -> dict[str, str]:
        loop = asyncio.get_running_loop()
        begun = self._began.setdefault(stage, loop.time())
        while self._open[stage]:
            limit = stage_deadline(self.answered[stage], len(self.servers), self.config, since=begun)
            left = begun + limit - loop.time()
            if left <= 0:
                self._expire(stage, limit, begun)
                break
            self._changed.clear()
            try:  # woken when the stage ends or a server fails; else it looks again at the deadline
                await asyncio.wait_for(self._changed.wait(), min(left, DEADLINE_TICK_S))
            except TimeoutError:
                pass
        if stage == PAUSED:
            self._began[COMMITTED] = loop.time()  # the transfer starts now
        return dict(self.failed)

    def _expire(self, stage: str, limit: float, begun: float) -> None:
        times = [max(0.0, t - begun) for t in self.answered[stage]]
        median = f", {self.config.straggler_factor:g}x the median {statistics.median(times):.2f}s" if times else ""
        for address in sorted(self._open[stage]):
            self._fail(
                address,
                f"not {stage} within {limit:.1f}s of the {'update' if stage == PAUSED else 'transfer'}'s start "
                f"(weight_update.update_timeout={self.config.update_timeout:g}s, straggler_floor_s="
                f"{self.config.straggler_floor_s:g}s{median}): evicted while alive and slow, or its control "
                "route hangs",
            )
            self._tasks[address].cancel()
