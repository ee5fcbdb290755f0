"""The interface the weight-sync phase drives: one per way of moving the trainer's weights to the servers.

:class:`~megarl.bridge.bridge.WeightBridge` sends the whole model (broadcast, sharded or disk);
:class:`~megarl.bridge.adapter.AdapterBridge` sends the LoRA adapters alone (the servers load them as
an adapter). Both declare :class:`ServerBridge`; :mod:`megarl.run.weight_sync` holds one and knows
nothing else of it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megarl.serving import ServerControl, ServerRef


@dataclass
class UpdateReport:
    """The outcome of one update, the same on every trainer rank."""

    version: int
    mode: str
    seconds: float = 0.0
    bytes_sent: int = 0
    """Summed over trainer ranks."""
    send_seconds: float = 0.0
    """Longest time a trainer rank spent sending (gather / pack / wire, pipelined)."""
    commit_seconds: float = 0.0
    """Time the servers took to apply the received weights and record the version."""
    updated: list[str] = field(default_factory=list)
    """Addresses of the servers now on ``version``."""
    failed: dict[str, str] = field(default_factory=dict)
    """Address -> why, for servers that did not commit (old weights, or unhealthy)."""
    sender_errors: list[str] = field(default_factory=list)
    adapter: str | None = None
    """Adapter weight sync: the LoRA adapter the updated servers serve ``version`` under."""

    @property
    def ok(self) -> bool:
        return not self.failed and not self.sender_errors


class ServerBridge(abc.ABC):
    """The trainer side of a weight transfer to the inference servers (one per trainer rank; every method
    but :attr:`is_driver` is collective over the trainer ranks)."""

    connected: bool
    """Whether :meth:`connect` succeeded and no failure has closed it since."""
    servers: list[ServerControl | ServerRef]
    """The servers of the last :meth:`connect`: their control handles on rank 0, which calls them; on the
    other ranks what they know of each (:class:`~megarl.serving.control.ServerRef`)."""

    @property
    @abc.abstractmethod
    def is_driver(self) -> bool:
        """Whether this rank drives the servers' HTTP calls (global rank 0)."""

    @abc.abstractmethod
    def connect(self, servers: list[ServerControl | ServerRef]) -> None:
        """Get ready to send to ``servers`` (form groups, adopt them); raises naming what failed."""

    @abc.abstractmethod
    def update(self, source, version: int, mode: str | None = None, path: str | None = None) -> UpdateReport:
        """Send the trainer's weights as ``version``; a server's failure is in the report, not raised."""

    @abc.abstractmethod
    def broadcast_object(self, value):
        """Rank 0's ``value`` on every trainer rank."""

    @abc.abstractmethod
    def close(self) -> None:
        """Let go of the servers (the next :meth:`connect` adopts them again)."""

    def release(self, addresses: list[str]) -> None:
        """``addresses`` changed (restarted, joined, failed, left): the next :meth:`connect` adopts them
        anew (default: lets go of every server)."""
        self.close()
