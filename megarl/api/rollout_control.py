"""What the trainer's loop drives on the rollout side around a weight update (the weight-sync seam).

:class:`megarl.run.weight_sync.WeightSync` pauses the servers, streams the new weights, moves
the version on and resumes; the trainer script puts colocated servers to sleep and wakes them.
They reach the rollout side through this interface only (and the servers through the one
:class:`~megarl.serving.servers.ServerSet` it holds), which
:class:`megarl.rollout.RemoteInferenceEngine` implements (and the tests' fakes do), so neither
the actor nor the bridge imports the rollout package.
"""

from __future__ import annotations

import abc


class RolloutControl(abc.ABC):
    """Pause / resume, sleep / wake, versions, the adapter asked for, and the run's servers."""

    @abc.abstractmethod
    def pause(self, servers: bool = True) -> None:
        """Stop new episodes and hold generations (they continue after :meth:`resume`); with ``servers``
        also pause every server, aborting its in-flight generations (without: the weight update's own
        call pauses each server, or another head's rollout side does)."""

    @abc.abstractmethod
    def resume(self, start_episodes: bool = True, servers: bool = True) -> None:
        """Generations go on (with ``servers``: every server is resumed too); new episodes start unless
        ``start_episodes`` is False (then :meth:`start_episodes` does, later)."""

    @abc.abstractmethod
    def start_episodes(self) -> None:
        """Let new episodes start again."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Colocated placement: pause and free the servers' device memory for the trainer."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Bring sleeping servers' memory back; they stay paused until :meth:`resume`."""

    @abc.abstractmethod
    def set_version(self, version: int) -> None:
        """The weights' version from now on (stamped on every token generated after)."""

    @abc.abstractmethod
    def use_adapter(self, name: str | None) -> None:
        """Ask the servers for the LoRA adapter ``name`` in every request sent from now on (adapter weight
        sync loads each version as a new adapter); None: their base model."""

    @property
    @abc.abstractmethod
    def servers(self):
        """The run's servers (:class:`megarl.serving.servers.ServerSet`): the weight sync asks it whom to
        update and tells it where each update landed."""
