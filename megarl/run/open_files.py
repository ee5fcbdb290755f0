"""The open files a trainer head of a run needs, and the ``RLIMIT_NOFILE`` that allows them.

A trainer head (the rank of each data-parallel replica that drives a rollout pool) holds a socket
per generation request in flight, per control call and health check to a server, per member of its
weight-bridge group, and its files. :func:`trainer_open_files` counts them from the config;
:func:`check_open_files` raises the soft limit to that and refuses a run whose hard limit is lower.
It runs with the pre-launch checks (:mod:`megarl.run.prelaunch`: ``megarl run`` and ``megarl config``
refuse there; ``megarl slurm`` on a login node only raises what it can) and in each trainer rank
before the build (:mod:`megarl.train`), on the node the connections are opened from.
"""

from __future__ import annotations

import dataclasses

from megarl.config.base import ConfigError
from megarl.config.experiment import GRPOConfig
from megarl.utils.limits import OpenFilesError, ensure_open_files

OPEN_FILES_MARGIN = 512
"""File descriptors of a trainer process besides its connections to the servers: the interpreter,
torch and CUDA's device files, Megatron's own process groups, the reward pool's and the data
loader's pipes, logs and checkpoints."""
CONTROL_FILES_PER_SERVER = 4
"""Sockets a trainer head may hold per server outside generation: two blocking control calls of the
weight update's fan-out (a call past its timeout keeps its socket while a new one starts) and two
health checks (:class:`megarl.serving.ServerSet`)."""


@dataclasses.dataclass(frozen=True)
class OpenFilesPlan:
    """The file descriptors one trainer head process of a run needs (:func:`trainer_open_files`)."""

    generation: int
    """Generation requests in flight at once: ``min(connection cap, episodes x group_size)``, episodes
    being ``min(max_concurrent_rollouts, (max_staleness + 1) x batch per head)``."""
    control: int
    """Control calls and health checks: :data:`CONTROL_FILES_PER_SERVER` per server."""
    bridge: int
    """The weight bridge's groups: a transport connection per member and each group's TCPStore socket
    (a group per block of ``weight_update.servers_per_group`` servers), both ends counted."""
    margin: int = OPEN_FILES_MARGIN

    @property
    def total(self) -> int:
        return self.generation + self.control + self.bridge + self.margin

    def describe(self) -> str:
        return (
            f"a trainer head of this run ({self.generation:,} generation connections, {self.control:,} for "
            f"control calls and health checks, {self.bridge:,} for the weight bridge, {self.margin:,} for "
            "files, torch and logs)"
        )


def trainer_open_files(config: GRPOConfig) -> OpenFilesPlan:
    """The file descriptors a trainer head of ``config`` needs (the rollout pool's, the weight sync's)."""
    rollout, alloc = config.rollout, config.allocation
    dp = alloc.train.dp if alloc.train is not None else 1
    batch = max(1, config.train_dataset.batch_size // dp)  # the pool's batch: prompts per step per head
    concurrency = rollout.max_concurrent_rollouts or batch
    episodes = min(concurrency, (rollout.max_staleness + 1) * batch)  # the staleness bound's cap
    cap = rollout.max_connections or max(64, 16 * concurrency)  # as megarl.rollout.engine opens its session
    generation = min(cap, episodes * config.group_size)
    if alloc.inference is not None:
        servers, workers = alloc.inference.dp, alloc.inference.world_size
    else:  # servers started elsewhere: the addresses the trainer will be given
        from megarl.serving.launch import env_server_addrs  # the HTTP stack only where it is needed

        addrs = rollout.server_addrs or env_server_addrs(rollout)[0]
        servers = workers = len(addrs)
    groups = -(-servers // config.weight_update.group_servers(servers)) if servers else 1
    bridge = 0 if set(config.weight_update.modes) == {"disk"} else 2 * (workers + groups)
    return OpenFilesPlan(generation, CONTROL_FILES_PER_SERVER * servers, bridge)


def check_open_files(config: GRPOConfig, refuse: bool = True) -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to what a trainer head of ``config`` needs
    (:func:`megarl.utils.limits.ensure_open_files`; a child inherits it); the soft limit now.
    With ``refuse``: a :class:`ConfigError` when the hard limit is below it, naming both."""
    plan = trainer_open_files(config)
    try:
        return ensure_open_files(plan.total, plan.describe(), refuse=refuse)
    except OpenFilesError as err:
        raise ConfigError(
            "rollout.max_connections",
            f"{err}; or plan fewer connections (rollout.max_connections caps the generation ones)",
            related=("rollout.max_concurrent_rollouts", "rollout.max_staleness", "train_dataset.batch_size"),
        ) from None
