"""The trainer's CPU threads, phase by phase (``cluster.cpu_threads``).

On a CPU machine the launcher binds each inference server to its cores and gives the
trainer ranks the rest (``OMP_NUM_THREADS``). That static split leaves the servers' cores
idle whenever they have no work: during the weight sync (paused), and during a PPO update
that starts once every episode the staleness bound allows is done. The elastic policy
lends the trainer every core in those phases and gives them back when the phase ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator

import torch

logger = logging.getLogger(__name__)


class TrainerThreads:
    """Switches ``torch``'s intra-op threads between the trainer's share and the machine's.

    Args:
        policy: ``elastic``, ``shared`` or ``static`` (``cluster.cpu_threads``).
        share: Threads while servers generate (``OMP_NUM_THREADS`` of the launcher).
        machine: Threads when the servers idle: this rank's share of every core.
        servers_idle: Whether the servers have no work now (this rank's view; None: never known).
    """

    def __init__(self, policy: str, share: int, machine: int, servers_idle: Callable[[], bool] | None = None):
        self.policy, self.share, self.machine = policy, share, max(share, machine)
        self.servers_idle = servers_idle

    @classmethod
    def for_this_rank(cls, policy: str, on_cpu: bool, servers_idle: Callable[[], bool] | None) -> TrainerThreads:
        """This rank's threads: its share now, and its share of every core of the machine."""
        share = torch.get_num_threads()
        if not on_cpu:
            return cls("static", share, share)
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        machine = max(1, len(os.sched_getaffinity(0)) // local_ranks)
        return cls(policy, share, machine, servers_idle)

    def describe(self) -> str:
        if self.policy == "static" or self.machine == self.share:
            return f"{self.share} threads"
        return f"{self.share} threads, {self.machine} while the servers idle (cluster.cpu_threads={self.policy})"

    @contextlib.contextmanager
    def phase(self, servers_paused: bool = False) -> Iterator[None]:
        """Run a trainer phase on every core if the servers are paused or idle at its start."""
        idle = servers_paused or (self.servers_idle is not None and self.servers_idle())
        boost = self.policy != "static" and self.machine > self.share and idle
        if not boost:
            yield
            return
        torch.set_num_threads(self.machine)
        try:
            yield
        finally:
            torch.set_num_threads(self.share)
