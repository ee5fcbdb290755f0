"""The inference servers of a run and their lifecycle: routing, health, restart, join, leave, readmission.

:class:`ServerSet` is the one owner of what the rollout side knows about its servers:

* **routing**: requests sharing a ``rid`` stick to one server; others go to the least-loaded (or
  next, round-robin) server in rotation;
* **health**: a server unreachable after all retries is out of rotation for
  ``rollout.unhealthy_retry_interval`` seconds (:meth:`ServerSet.mark_failed`); one that failed a
  weight update is out until :meth:`ServerSet.mark_healthy`;
* **restart**: a server the launcher restarted (:mod:`megarl.serving.restarts`) is out of rotation
  until the trainer has pushed its weights to it (:meth:`ServerSet.to_readmit`, then
  :meth:`ServerSet.mark_healthy`);
* **join / leave**: a server started with ``megarl serve --join`` enters out of rotation the same
  way; one that leaves is drained (no new request; those running there finish) and never comes back;
* **control**: pause, resume, sleep and wake calls go to every server at once, on the trainer's control
  loop (:meth:`ServerSet.control_all`);
* **weight updates**: the trainer's weight sync asks whom to send the next update to
  (:meth:`ServerSet.update_plan`), takes each server's control handle from here
  (:meth:`ServerSet.controls`) and reports where the update landed (:meth:`ServerSet.record_update`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import operator
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from megarl.config.rollout import InferenceEngineConfig
from megarl.serving.backend import HttpCall, InferenceBackend
from megarl.serving.control import ServerControl
from megarl.serving.control_loop import control_loop
from megarl.serving.families import make_backend, make_control
from megarl.serving.http import (
    InferenceServerError,
    RetryPolicy,
    ServerUnavailableError,
    arequest_with_retry,
    http_ok_all,
)
from megarl.serving.kept_http import KeptConnections
from megarl.serving.restarts import JOINS_FILE, RestartLog

logger = logging.getLogger(__name__)

_IN_FLIGHT = operator.attrgetter("in_flight")
_STICKY_CAPACITY = 100_000  # rids remembered for sticky routing (LRU)
_CONTROL_POLICY = RetryPolicy(timeout=120.0, retries=3, backoff=0.5)


class NoHealthyServerError(InferenceServerError):
    """Every server is marked unhealthy."""


@dataclass
class Server:
    """One server as the rollout side sees it."""

    address: str
    in_flight: int = 0
    unhealthy_until: float = 0.0
    why_unhealthy: str = ""
    awaiting_push: bool = False  # restarted or joined: the trainer's weights are not on it yet
    control: ServerControl | None = None  # the trainer's handle (weight updates, probes), made on first use

    def usable(self, now: float) -> bool:
        return now >= self.unhealthy_until


@dataclass(frozen=True)
class UpdatePlan:
    """Whom one weight update goes to, as the trainer's rank 0 learns it from the :class:`ServerSet` (and
    broadcasts to the other ranks)."""

    order: list[str]
    """Every server's address, in the run's order (under Slurm the slot order): a server's number in the
    metrics (``weight_sync/server{i}/...``)."""
    targets: list[str]
    """The servers to send the update to, in that order: all but those out of rotation until new weights
    reach them, plus the restarted or joined ones that answer again."""
    readmit: list[str]
    """The restarted or joined servers among the targets: back in rotation once the update lands there."""

    def number(self) -> dict[str, int]:
        """Address -> its number in :attr:`order`."""
        return {address: i for i, address in enumerate(self.order)}


class ServerSet:
    """The servers of one engine: which one serves a request, which are out of rotation and why.

    Args:
        config: The ``rollout`` section (routing policy, unhealthy interval).
        backend: Which health endpoint to probe.
        addresses: Every server's ``host:port``.
        run_dir: Where the launcher records restarts and joins; None: no launcher restarts servers.
    """

    def __init__(
        self,
        config: InferenceEngineConfig,
        backend: InferenceBackend,
        addresses: list[str],
        run_dir: str | Path | None = None,
    ):
        self.config = config
        self.backend = backend
        self._servers = [Server(a) for a in addresses]
        self._addresses = list(addresses)  # kept beside _servers (asked per episode: not rebuilt)
        self._restarts = RestartLog(run_dir) if run_dir is not None else None
        self._joins = RestartLog(run_dir, name=JOINS_FILE) if run_dir is not None else None
        self._sticky: collections.OrderedDict[str, Server] = collections.OrderedDict()
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._left: set[str] = set()  # servers that left the run: drained, never back in rotation
        self._next_readmit_probe = 0.0
        self._rotation: list[Server] = []
        self._rotation_until = -math.inf
        """The usable servers, kept until a server's health changes or a marked one's interval ends (a
        request's choice does not go over the whole fleet)."""
        self._why_none: str | None = None  # why no server is usable, kept the same way
        self.adapter: str | None = None
        """The LoRA adapter the servers serve the trainer's policy under (adapter weight sync sets it once
        every server loaded it): what every generation request and probe asks for; None: the base model."""
        self.restarts_seen = 0
        """Server restarts the launcher recorded since this set was made."""
        self.servers_joined = 0
        """Servers that joined the run (``megarl serve --join``) since this set was made."""

    @classmethod
    def of(cls, addresses: list[str], backend: str = "vllm") -> ServerSet:
        """The servers at ``addresses`` of the family ``backend``, routed with the ``rollout`` defaults and
        restarted by no launcher (a trainer driving servers without a rollout side of its own)."""
        return cls(InferenceEngineConfig(), make_backend(backend), addresses)

    @property
    def addresses(self) -> list[str]:
        """Every server's ``host:port``, in rotation or not."""
        return list(self._addresses)

    @property
    def restartable(self) -> bool:
        """Whether a launcher may restart these servers (a run directory was given): then no episode
        keeps samples from before a server's death beside samples from after it."""
        return self._restarts is not None

    # ------------------------------------------------------------------ routing

    def choose(self, rid: str | None = None) -> Server:
        """The sticky server of ``rid`` if usable, else the least-loaded (or next) usable one."""
        self._note_changes()
        now = time.monotonic()
        with self._lock:
            server = self._sticky.get(rid) if rid is not None else None
            if server is not None and server.usable(now):
                self._sticky.move_to_end(rid)
                return server
            usable = self._usable(now)
            if not usable:
                if self._why_none is None:  # each request waiting out a fleet-wide restart asks again
                    self._why_none = _why_none_usable(self._servers)
                raise NoHealthyServerError(_some(self._addresses), "", self._why_none, 0, kind="no_server")
            if self.config.schedule_policy == "round_robin":
                server = usable[next(self._rr) % len(usable)]
            else:
                server = min(usable, key=_IN_FLIGHT)
            if rid is not None:
                self._sticky[rid] = server
                if len(self._sticky) > _STICKY_CAPACITY:
                    self._sticky.popitem(last=False)
            return server

    def _usable(self, now: float) -> list[Server]:
        """The servers in rotation at ``now`` (call holding the lock)."""
        if now >= self._rotation_until:
            self._rotation = [s for s in self._servers if s.usable(now)]
            self._rotation_until = min(
                (s.unhealthy_until for s in self._servers if not s.usable(now)), default=math.inf
            )
        return self._rotation

    def _health_changed(self) -> None:
        """A server's ``unhealthy_until`` changed, or one was added (call holding the lock)."""
        self._rotation_until = -math.inf
        self._why_none = None

    def awaiting_push(self) -> bool:
        """Whether some server waits for the trainer's weights (restarted or joined)."""
        return any(s.awaiting_push for s in self._servers)

    async def wait_for_a_server(self) -> bool:
        """Sleep until the first server marked unhealthy for a while is tried again; False when every
        server is out of rotation for good (:meth:`mark_unhealthy`)."""
        with self._lock:
            back = min(s.unhealthy_until for s in self._servers)
        if math.isinf(back):
            return False
        await asyncio.sleep(max(0.0, back - time.monotonic()))
        return True

    # ------------------------------------------------------------------ health

    def mark_failed(self, server: Server, error: Exception) -> None:
        """``server`` did not answer after all retries: out of rotation for ``unhealthy_retry_interval`` s."""
        with self._lock:
            if math.isinf(server.unhealthy_until):
                return  # out of rotation until mark_healthy
            if server.usable(time.monotonic()):
                logger.warning(
                    "marking %s unhealthy for %.0fs: %s", server.address, self.config.unhealthy_retry_interval, error
                )
            server.unhealthy_until = time.monotonic() + self.config.unhealthy_retry_interval
            server.why_unhealthy = str(error)
            self._health_changed()

    def mark_unhealthy(self, address: str, reason: str) -> None:
        """Take ``address`` out of rotation until :meth:`mark_healthy` (e.g. it failed a weight update)."""
        with self._lock:
            server = next((s for s in self._servers if s.address == address), None)
            if server is None:
                raise ValueError(f"mark_unhealthy: {address} is not one of the servers {self.addresses}")
            logger.warning("taking %s out of rotation: %s", address, reason)
            server.unhealthy_until = math.inf
            server.why_unhealthy = reason
            self._health_changed()

    def mark_healthy(self, address: str) -> None:
        """Put ``address`` back into rotation (its weights are current again), unless it left the run."""
        if address in self._left:
            return
        with self._lock:
            for server in self._servers:
                if server.address == address:
                    server.unhealthy_until = 0.0
                    server.awaiting_push = False
            self._health_changed()

    def wait_healthy(self, timeout: float) -> None:
        """Block until every server answers its health check; :class:`InferenceServerError` after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            healthy = self.answering(self.addresses)
            if all(healthy):
                return
            if time.monotonic() > deadline:
                down = [a for a, ok in zip(self.addresses, healthy) if not ok]
                raise InferenceServerError(
                    ",".join(down), self.backend.health_endpoint, f"not healthy within setup_timeout={timeout:g}s", 0
                )
            time.sleep(1.0)

    def answering(self, addresses: list[str]) -> list[bool]:
        """One health probe of each of ``addresses``, all at once (blocking: not from an event loop's thread)."""
        return http_ok_all(addresses, self.backend.health_endpoint)

    # ------------------------------------------------------------------ restart, join, leave, readmission

    def _note_changes(self) -> None:
        """Take the servers the launcher restarted out of rotation until the trainer pushes its weights; add
        the servers that joined the run (out of rotation the same way) and drain those that left."""
        for address in self._restarts.new_addresses() if self._restarts is not None else []:
            for server in self._servers:
                if server.address == address:
                    self.restarts_seen += 1
                    self.mark_unhealthy(
                        address, "restarted by the launcher; back once the trainer has pushed its weights"
                    )
                    server.awaiting_push = True
        for record in self._joins.new_records() if self._joins is not None else []:
            if record.get("event") == "leave":
                self._drain(record["address"])
            elif record.get("event") == "join" and record["address"] not in self.addresses:
                self._join(record["address"])  # (a "reserve" line only holds a joining server's index)

    def _join(self, address: str) -> None:
        """A server started with ``megarl serve --join``: in the set, out of rotation until the trainer's
        weight sync has pushed the current weights and version to it."""
        why = "joined the run; in rotation once it holds the current weights"
        with self._lock:
            self._servers.append(Server(address, unhealthy_until=math.inf, awaiting_push=True, why_unhealthy=why))
            self._addresses.append(address)
            self._health_changed()
        self.servers_joined += 1
        logger.info("server %s joined the run; it serves once the next weight sync reaches it", address)

    def _drain(self, address: str) -> None:
        """A joined server leaves: no new request goes to it (requests running there finish); the bridge lets it go."""
        if address in self.addresses and address not in self._left:
            self.mark_unhealthy(address, "left the run (megarl serve --join stopped): drained")
            self._left.add(address)

    def to_readmit(self) -> tuple[list[str], list[str]]:
        """Servers awaiting the trainer's weights (restarted or joined): (those answering their health check,
        the others and those that left the run)."""
        self._note_changes()
        waiting = [s.address for s in self._servers if s.awaiting_push and s.address not in self._left]
        healthy = self.answering(waiting)
        back = [a for a, ok in zip(waiting, healthy) if ok]
        return back, [a for a, ok in zip(waiting, healthy) if not ok] + sorted(self._left)

    def readmit_due(self) -> bool:
        """Whether no server can take requests while a restarted one answers again and waits for the
        trainer's weights (probed at most once a second)."""
        self._note_changes()
        now = time.monotonic()
        with self._lock:
            if any(s.usable(now) for s in self._servers) or not self.awaiting_push():
                return False
            if now < self._next_readmit_probe:
                return False
            self._next_readmit_probe = now + 1.0
        return bool(self.to_readmit()[0])

    # ------------------------------------------------------------------ control

    def control_all(self, calls: list[HttpCall]) -> None:
        """Send ``calls`` in order to every server (concurrently across servers), on the process's control
        loop over its kept-alive connections; a dead server is marked failed and skipped, any other error
        is raised."""
        control_loop().run(self.control(calls))

    async def control(self, calls: list[HttpCall]) -> None:
        """:meth:`control_all` on the control loop (its coroutine)."""

        async def run_on(connections: KeptConnections, server: Server) -> None:
            for call in calls:
                await arequest_with_retry(
                    connections,
                    server.address,
                    call.endpoint,
                    call.payload,
                    method=call.method,
                    params=call.params or None,
                    policy=_CONTROL_POLICY,
                    expect_json=False,
                )

        servers = list(self._servers)
        connections = control_loop().connections()
        results = await asyncio.gather(*(run_on(connections, s) for s in servers), return_exceptions=True)
        for server, result in zip(servers, results):
            if isinstance(result, ServerUnavailableError):
                self.mark_failed(server, result)
            elif isinstance(result, BaseException):
                raise result

    # ------------------------------------------------------------------ weight updates (the trainer's side)

    def update_plan(self) -> UpdatePlan:
        """Whom the next weight update goes to: every server but those out of rotation until new weights
        reach them (a failed update, a restart still down, a server that left), plus the restarted or
        joined servers that answer their health check again."""
        readmit, _ = self.to_readmit()
        held = self.held_out() - set(readmit)
        return UpdatePlan(self.addresses, [a for a in self.addresses if a not in held], readmit)

    def held_out(self) -> set[str]:
        """Servers out of rotation until :meth:`mark_healthy`: they failed an update, were restarted or joined
        and wait for the trainer's weights, or left the run."""
        with self._lock:
            return {s.address for s in self._servers if math.isinf(s.unhealthy_until)}

    def record_update(self, updated: list[str], failed: dict[str, str]) -> None:
        """An update landed on ``updated`` and failed on ``failed`` (address -> why): the failed servers leave
        rotation until new weights reach them; the restarted or joined ones it reached come back."""
        held = self.held_out()
        for address, reason in failed.items():
            self.mark_unhealthy(address, reason)
        for address in (a for a in updated if a in held):
            self.mark_healthy(address)

    def controls(self, addresses: list[str], tps: list[int], timeout: float) -> list[ServerControl]:
        """The trainer's control handle on each of ``addresses`` (of TP size ``tps[i]``, calls bounded by
        ``timeout`` s), made once per server: a handle keeps what it learned (the model's name, its update groups)."""
        by_address = {s.address: s for s in self._servers}
        for address, tp in zip(addresses, tps, strict=True):
            server = by_address[address]
            if server.control is None:
                server.control = make_control(self.backend.name, address, tp, timeout)
        return [by_address[a].control for a in addresses]


def _why_none_usable(servers: list[Server]) -> str:
    """Why none of ``servers`` is in rotation: each reason once, with a few of its servers."""
    by_reason: dict[str, list[str]] = collections.defaultdict(list)
    for server in servers:
        by_reason[server.why_unhealthy].append(server.address)
    return f"all {len(servers)} inference servers are marked unhealthy: " + "; ".join(
        f"[{_some(addresses)}] {why}" for why, addresses in by_reason.items()
    )


def _some(addresses: list[str], shown: int = 3) -> str:
    """``addresses`` for an error message: all of a few, else the first ``shown`` and a count of the rest."""
    if len(addresses) <= shown:
        return ", ".join(addresses)
    return ", ".join(addresses[:shown]) + f" and {len(addresses) - shown} more"
