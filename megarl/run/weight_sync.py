"""The weight-sync phase of the trainer's loop: :func:`connect_engine` once, then
``WeightSync.update_weights(meta)`` after every update.

One update (every trainer rank calls it; collective)::

    rollout.pause(servers=...) # every head holds its generations (continued after resume); rank 0
                               # pauses the servers only where the update call does not (SGLang, adapters)
    bridge.update(...)         # rank 0: one call per server (pause, receive, commit, resume); ranks send
    actor.set_version(v); rollout.set_version(v)
    rollout.resume(servers=...) # every head's requests go out again, carrying v on their later tokens;
                               # rank 0 resumes the servers only where the update call does not
    probe consistency          # every weight_update.probe_every updates: trainer vs every server,
                               # before new episodes start; ConsistencyError above threshold

With LoRA adapters and ``weight_update.lora: adapter`` the transfer is
:class:`~megarl.bridge.adapter.AdapterBridge`'s: the servers load the adapters alone as a new LoRA
adapter per version, and the rollout side asks for it (``RolloutControl.use_adapter``).

The rollout side is reached through :class:`megarl.api.rollout_control.RolloutControl` (the
trainer's :class:`~megarl.rollout.RemoteInferenceEngine`), the transfer through
:class:`megarl.bridge.bridge.WeightBridge`, and whom to send to is the run's one
:class:`~megarl.serving.servers.ServerSet`'s answer (rank 0 asks it, the other ranks learn it by
broadcast). A server that failed the transfer keeps its old weights (or is half-updated) and is
taken out of rotation (:meth:`~megarl.serving.servers.ServerSet.record_update`); the bridge
reconnects to the healthy servers before the next update. A server the launcher restarted (it
holds the model's first weights) is out of rotation until an update reaches it: each update
reconnects the bridge with the restarted servers that answer again, pushes the weights and
version to them too, and puts them back (``weight_sync/servers_readmitted``);
:meth:`WeightSync.readmit` does so between updates when no other server is left to generate.
Up to ``weight_update.max_failed_fraction`` of the servers may fail an update (a hung server is
bounded by ``update_timeout``): they stay out of rotation, named in a warning, and the run goes on.
More, or a failure on the trainer's side, is raised (:class:`~megarl.bridge.bridge.WeightBridgeError`)
after the rollout has resumed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

import torch.distributed as dist

from megarl.api.rollout_control import RolloutControl
from megarl.bridge.adapter import AdapterBridge
from megarl.bridge.bridge import UpdateReport, WeightBridge, WeightBridgeError
from megarl.bridge.consistency import (
    ConsistencyError,
    TopKReport,
    compare,
    compare_topk,
    sample_probe,
    topk_ids,
    topk_warning,
    trainer_probe_scores,
)
from megarl.bridge.interface import ServerBridge
from megarl.bridge.source import ShardSource, TrainerCoords
from megarl.bridge.transport import wire_dtype
from megarl.config.bridge import WeightUpdateConfig
from megarl.serving import ServerControl, ServerRef, ServerSet, server_ref
from megarl.serving.control_loop import control_loop
from megarl.serving.families import SERVER_FAMILIES
from megarl.serving.servers import UpdatePlan
from megarl.utils import heartbeat
from megarl.utils.hardware import concrete_dtype

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class WeightUpdateMeta:
    """What one ``update_weights(meta)`` does (AReaL's ``WeightUpdateMeta``)."""

    config: WeightUpdateConfig
    """How to transfer."""
    version: int | None = None
    """Version of the new weights; None: the actor's version + 1."""
    mode: str | None = None
    """Override ``config.mode`` for one update."""
    path: str | None = None
    """Disk mode: exact directory for this update (default ``config.disk_path/v<version>``)."""
    inference_tp: int = 1
    """Tensor-parallel size of every inference server (the allocation's ``vllm:d?t<N>``)."""

    @classmethod
    def from_allocation(cls, config: WeightUpdateConfig, allocation_mode) -> WeightUpdateMeta:
        """From the experiment's ``weight_update`` config and allocation mode (string or AllocationMode)."""
        from megarl.config.allocation import AllocationMode

        alloc = AllocationMode.from_str(allocation_mode) if isinstance(allocation_mode, str) else allocation_mode
        if not isinstance(alloc, AllocationMode):  # e.g. AReaL's from_disk(config.saver)
            raise TypeError(
                f"WeightUpdateMeta takes the allocation mode (config.allocation_mode, or its string), "
                f"not {type(allocation_mode).__name__}: e.g. WeightUpdateMeta.from_disk(config.allocation_mode)"
            )
        if alloc.inference is None:
            raise ValueError(f"allocation mode '{alloc}' has no inference part to send weights to")
        return cls(config, inference_tp=alloc.inference.tp)

    @classmethod
    def from_megatron_xccl(cls, allocation_mode, config: WeightUpdateConfig | None = None) -> WeightUpdateMeta:
        """AReaL's name: the weights streamed from the Megatron layout over the collective backend (NCCL on
        GPUs, gloo on CPUs) into the servers of ``allocation_mode``; ``config`` None: the ``weight_update``
        defaults."""
        return cls.from_allocation(config if config is not None else WeightUpdateConfig(), allocation_mode)

    from_fsdp_xccl = from_megatron_xccl
    """AReaL's FSDP spelling of :meth:`from_megatron_xccl`: the same update (megarl's trainer is Megatron)."""

    @classmethod
    def from_disk(
        cls, allocation_mode, config: WeightUpdateConfig | None = None, path: str | None = None
    ) -> WeightUpdateMeta:
        """AReaL's name: every update written as an HF checkpoint that the servers load
        (``weight_update.mode: disk``); ``path`` the directory of each update (default
        ``config.disk_path/v<version>``)."""
        config = replace(config if config is not None else WeightUpdateConfig(), mode="disk")
        meta = cls.from_allocation(config, allocation_mode)
        meta.path = path
        return meta


class WeightSync:
    """The trainer's connection to the servers: bridge, rollout hooks, probe.

    Args:
        engine: The :class:`~megarl.actor.engine.MegatronEngine` (initialised).
        config: The ``weight_update`` config.
        servers: The run's servers (:class:`~megarl.serving.servers.ServerSet`) on rank 0, which says
            whom each update goes to; None on the other ranks (they learn it from rank 0).
        rollout: This rank's rollout side, if it has one (paused / resumed / versioned here).
        backend: The servers' family (``vllm``, ``sglang``).
        tp: Every server's tensor-parallel size.
    """

    def __init__(
        self,
        engine,
        config: WeightUpdateConfig,
        servers: ServerSet | None,
        rollout: RolloutControl | None = None,
        *,
        backend: str = "vllm",
        tp: int = 1,
        server_tp: dict[str, int] | None = None,
    ):
        from megarl.models.hf_io import SafetensorsReader

        self.engine, self.config, self.server_set, self.rollout = engine, config, servers, rollout
        self.backend, self.tp = backend, tp
        self.server_tp = server_tp or {}
        """The TP size of each server named at connect (``connect_engine(..., servers=...)``, which may differ
        from server to server); the others (the rollout side's, restarted or joined) have ``tp``."""
        coords = TrainerCoords.from_parallel(engine.parallel)
        device = next(p for chunk in engine.model for p in chunk.parameters()).device
        self.adapters = engine.config.lora.enabled and config.lora == "adapter"
        """Adapter weight sync: the servers serve the policy as a LoRA adapter, updated alone."""
        self.bridge: ServerBridge
        if self.adapters:
            dtype = wire_dtype(concrete_dtype(config.dtype, device.type))
            export = partial(engine.export_adapters, for_servers=True)  # the scale as every server reads it
            self.bridge = AdapterBridge(config, export, dtype, coords.rank)
        else:
            reader = SafetensorsReader(engine.model_path)
            self.bridge = WeightBridge(
                config,
                engine.desc,
                {n: reader.shape(n) for n in reader.keys()},  # noqa: SIM118 (the reader is not iterable)
                engine.parallel.alloc,
                coords,
                source_dir=engine.model_path,
                device=device,
            )
        self.servers_pause_themselves = not self.adapters and SERVER_FAMILIES[backend].one_call_update
        """Each server pauses and resumes itself in its update call (vLLM, full weights): no head sends
        ``/pause`` or ``/resume``. A server generates again once it committed; the heads' requests wait
        for their own version to move (``_resume``), so none stamped with the old version reaches it."""
        self.probe: list[list[int]] = []
        self.plan: UpdatePlan | None = None
        """Whom the last update went to (the same on every rank)."""
        self.n_updates = 0

    def _plan(self) -> UpdatePlan:
        """Whom the next update goes to: rank 0 asks the servers' owner, every rank gets its answer (collective)."""
        plan = self.server_set.update_plan() if self.bridge.is_driver else None
        return self.bridge.broadcast_object(plan)

    def _servers(self, addresses: list[str]) -> list[ServerControl] | list[ServerRef]:
        """The servers at ``addresses`` for the bridge: rank 0's control handles from the server set (it
        calls the servers), the other ranks' family, address and TP size (they form groups and send)."""
        tps = [self.server_tp.get(a, self.tp) for a in addresses]
        if self.bridge.is_driver:
            return self.server_set.controls(addresses, tps, self.config.update_timeout)
        return [server_ref(self.backend, a, tp) for a, tp in zip(addresses, tps)]

    def connect(self, plan: UpdatePlan | None = None) -> None:
        """Form the groups with ``plan``'s targets (None: ask for a plan) (collective), then sample the
        consistency probe from the first server."""
        self.plan = plan = plan if plan is not None else self._plan()
        self.bridge.connect(self._servers(plan.targets))
        if self.config.probe_sequences and not self.probe:
            probe = None
            if self.bridge.is_driver:
                probe = sample_probe(
                    self.bridge.servers[0],
                    self.config.probe_sequences,
                    self.config.probe_tokens,
                    self.engine.desc.dims.vocab_size,
                )
            self.probe = self.bridge.broadcast_object(probe)

    def readmit(self) -> dict[str, float]:
        """Push the current weights and version to the restarted servers that answer again (collective),
        so that they take requests; for when no other server is left to generate."""
        logger.info("weight sync: pushing version %d to restarted servers", self.engine.get_version())
        return self.update(self.engine.get_version())

    def _next_plan(self) -> UpdatePlan:
        """Whom this update goes to; the bridge's groups of the servers that changed (restarted, joined,
        failed, left) are released, to re-form before the transfer (the others are kept)."""
        known = set(self.plan.order) if self.plan is not None else set()
        plan = self._plan()
        for address in (a for a in plan.readmit if a not in known):  # joined the run (megarl serve --join)
            logger.info("weight sync: server %s joined; this update pushes it the weights", address)
        changed = set(plan.readmit) | set(plan.targets).symmetric_difference(s.address for s in self.bridge.servers)
        if changed:
            self.bridge.release(sorted(changed))  # a restarted server's workers join anew
        return plan

    def update_weights(self, meta: WeightUpdateMeta) -> dict[str, float]:
        """Pause, transfer, bump versions, resume, check consistency (collective); ``meta.version``
        None: the actor's version + 1."""
        version = meta.version if meta.version is not None else self.engine.get_version() + 1
        return self.update(version, meta.mode, meta.path)

    def update(self, version: int, mode: str | None = None, path: str | None = None) -> dict[str, float]:
        """One weight-sync phase (collective); returns timings, bytes and the consistency metric."""
        start = time.perf_counter()
        probing = self.n_updates % self.config.probe_every == 0
        self.plan = self._next_plan()
        if not self.plan.targets:
            return self._nothing_to_send(version, start)
        self._pause()
        paused = time.perf_counter()
        connect_seconds = 0.0  # groups form at the first update, and a block's again after a server of it changed
        try:
            if not self.bridge.connected:
                heartbeat.step("weight sync: connecting the bridge to the servers")
                connecting = time.perf_counter()
                self.connect(self.plan)
                connect_seconds = time.perf_counter() - connecting
            report = self.bridge.update(ShardSource.from_engine(self.engine), version, mode, path)
            readmitted = self._after(report, version)
            died = self._died(report)
            if died and not report.updated:  # as with no server at all: the version moves on without them
                self._nothing_to_send(version, start)
        except BaseException:
            self._resume()
            raise
        # the probe is scored by servers with no episodes yet (a fraction of a second, not behind a batch's
        # decoding); a served LoRA adapter's before the interrupted generations go on too: vLLM scores a LoRA's
        # prompt logprobs right only for a request alone in its batch (vllm-project/vllm#16668)
        alone = probing and report.ok and report.adapter is not None
        resuming = time.perf_counter()
        self._resume(episodes=not (probing and report.ok), generations=not alone)
        try:
            stats = {
                "pause_seconds": paused - start,
                "connect_seconds": connect_seconds,
                "resume_seconds": time.perf_counter() - resuming,
                "update_seconds": report.seconds,
                "send_seconds": report.send_seconds,
                "commit_seconds": report.commit_seconds,
                "bytes_sent": float(report.bytes_sent),
                "sync_seconds": time.perf_counter() - start,
                "servers_readmitted": float(len(readmitted)),
            }
            if not report.ok and not died:
                stats["servers_evicted"] = float(evict_or_raise(report, self.config))
            if probing:
                heartbeat.step("weight sync: consistency probe")
                probe_start = time.perf_counter()
                stats.update(self.check_consistency(release=alone))
                stats["probe_seconds"] = time.perf_counter() - probe_start
        finally:
            if probing and report.ok and self.rollout is not None:
                if alone:  # the generations were held for the probe too
                    self.rollout.resume(start_episodes=True, servers=False)
                else:
                    self.rollout.start_episodes()
        self.n_updates += 1
        return stats

    def _died(self, report: UpdateReport) -> bool:
        """Whether the update failed only on servers that died meanwhile (none answers its health check; the
        launcher restarts them and they are readmitted): not a failure of the run. The same on every rank."""
        died = False
        if report.failed and self.rollout is not None and self.bridge.is_driver:
            died = not any(self.server_set.answering(list(report.failed)))
            if died:
                logger.warning(
                    "weight update to version %d: %s died during the transfer; out of rotation until "
                    "restarted and readmitted",
                    report.version,
                    sorted(report.failed),
                )
        return bool(self.bridge.broadcast_object(died))

    def _nothing_to_send(self, version: int, start: float) -> dict[str, float]:
        """Every server is out (the restarted ones not up yet): the version moves on without them; a
        restarted server gets it once it answers (:meth:`readmit`, or the next update)."""
        logger.warning(
            "weight sync: no server to send version %d to (%s out of rotation); a restarted one gets it "
            "once it answers",
            version,
            sorted(set(self.plan.order) - set(self.plan.targets)),
        )
        self.engine.set_version(version)
        if self.rollout is not None:
            self.rollout.set_version(version)
        return {
            "update_seconds": 0.0,
            "bytes_sent": 0.0,
            "sync_seconds": time.perf_counter() - start,
            "servers_readmitted": 0.0,
        }

    def _pause(self) -> None:
        """Every head holds its own generations; rank 0 pauses the servers unless each update call does."""
        heartbeat.step("weight sync: pausing the rollout")
        if self.rollout is not None:
            self.rollout.pause(servers=self.bridge.is_driver and not self.servers_pause_themselves)
        if dist.is_initialized():
            dist.barrier()  # no head sends a request stamped with the old version once a server pauses

    def _resume(self, episodes: bool = True, generations: bool = True) -> None:
        """Once every head has the new version: rank 0 resumes the servers, every head its generations (unless
        ``generations`` is False: the probe runs alone first) and new episodes (unless ``episodes`` is False)."""
        heartbeat.step("weight sync: resuming the servers")
        if dist.is_initialized():
            dist.barrier()
        if self.rollout is None:
            return
        servers = self.bridge.is_driver and not self.servers_pause_themselves
        if generations:
            self.rollout.resume(start_episodes=episodes, servers=servers)
        elif servers:
            self.server_set.control_all(self.server_set.backend.resume_calls())

    def _after(self, report: UpdateReport, version: int) -> list[str]:
        """Version bump where the update landed; failed servers out of rotation, the restarted or joined
        servers it reached back in (returned; the same on every rank)."""
        if self.bridge.is_driver:
            self.server_set.record_update(report.updated, report.failed)
        readmitted = [a for a in self.plan.readmit if a in report.updated]
        if report.updated:
            self.engine.set_version(version)
            if report.adapter is not None:
                self._serve_adapter(report.adapter)
            if self.rollout is not None:
                self.rollout.set_version(version)
        return readmitted

    def _serve_adapter(self, name: str) -> None:
        """The servers serve the policy as the LoRA adapter ``name`` from now on: the rollout side's requests
        ask for it (rank 0's rollout side owns :attr:`server_set`), and so do the probes."""
        if self.rollout is not None:
            self.rollout.use_adapter(name)
        if self.server_set is not None:
            self.server_set.adapter = name

    def check_consistency(self, release: bool = False) -> dict[str, float]:
        """Probe logprobs: trainer vs every updated server; ConsistencyError above the threshold. With
        ``probe_topk``, each server's top-k logprobs too, against the trainer's of the same tokens (a
        warning above the gap threshold). One request per server, one trainer forward (collective).
        ``release``: the heads' generations were held for the servers' scoring and go on once it is done."""
        if not self.probe:
            return {}
        k = self.config.probe_topk
        theirs = None
        if self.bridge.is_driver:
            adapter = self.server_set.adapter
            futures = score_all(self._in_rotation(), lambda s: s.aprobe(self.probe, k, adapter))
            theirs = {address: f.result() for address, f in futures.items()}
        theirs = self.bridge.broadcast_object(theirs)
        if release and self.rollout is not None:
            self.rollout.resume(start_episodes=False, servers=False)
        scores = {address: scored for address, (scored, _) in theirs.items()}
        topk = {address: top for address, (_, top) in theirs.items() if top is not None}
        ids = topk_ids(topk, self.probe, k) if topk else None
        ours, our_topk = trainer_probe_scores(self.engine, self.probe, ids)
        report = compare(ours, scores, self.config.consistency_threshold)
        logger.info("weight sync consistency: max |dlogp| %.4g, mean %.4g", report.max_abs, report.mean_abs)
        if not report.ok:
            raise ConsistencyError(
                f"servers' probe logprobs differ from the trainer's by {report.worst_mean:.4g} on "
                f"average (> weight_update.consistency_threshold={report.threshold}); "
                f"(max, mean) per server: {report.per_server}"
            )
        stats = report.as_dict(self._numbers())
        if topk:
            stats.update(self._topk_stats(compare_topk(our_topk, topk, k)))
        return stats

    def _topk_stats(self, report: TopKReport) -> dict[str, float]:
        """The full-distribution probe's figures (``probe_topk``), logged; a warning above the gap threshold."""
        logger.info("weight sync full-distribution probe: %s", report.as_dict(self._numbers()))
        threshold = self.config.gap_threshold
        message = topk_warning(report, self.config.consistency_threshold if threshold is None else threshold)
        if message is not None:
            logger.warning(message)
        return report.as_dict(self._numbers())

    def _in_rotation(self) -> list[ServerControl]:
        """Rank 0: the bridge's servers that took the last update (those that failed it are held out)."""
        held = self.server_set.held_out()
        return [s for s in self.bridge.servers if s.address not in held]

    def _numbers(self) -> dict[str, int]:
        """Each server's number in the run's server list (``weight_sync/server{i}/...``): the rollout's
        order, which under Slurm is the slot order; a server out of rotation keeps its number free."""
        return self.plan.number()


def evict_or_raise(report: UpdateReport, config: WeightUpdateConfig) -> int:
    """Servers that failed the update while the others took it stay out of rotation (``WeightSync._after``
    took them out) and the run goes on, up to ``max_failed_fraction`` of the servers; returns how many.
    A failure on the trainer's side, or more failed servers, raises :class:`WeightBridgeError`."""
    total = len(report.updated) + len(report.failed)
    tolerated = report.updated and len(report.failed) <= config.max_failed_fraction * total
    if report.sender_errors or not tolerated:
        raise WeightBridgeError(
            f"weight update to version {report.version} failed on {report.failed or 'the trainer'}: "
            f"{report.sender_errors}; failed servers keep their old weights or are out of rotation "
            f"(weight_update.max_failed_fraction={config.max_failed_fraction} of {total} servers "
            "may fail while the run goes on)"
        )
    logger.warning(
        "weight update to version %d: %d of %d servers failed and are out of rotation until the launcher "
        "restarts them (weight_update.max_failed_fraction=%g): %s",
        report.version,
        len(report.failed),
        total,
        config.max_failed_fraction,
        "; ".join(f"{address}: {why}" for address, why in sorted(report.failed.items())),
    )
    return len(report.failed)


def score_all(
    servers: list[ServerControl], score: Callable[[ServerControl], Coroutine[Any, Any, T]]
) -> dict[str, Future[T]]:
    """``score(server)`` (a coroutine) on every server at once, on the control loop over its kept
    connections: address -> its future. The caller goes on (the trainer scores the probe meanwhile).
    (A fan-out thread per server, as before, had 256 threads parse their replies at once at 256 servers,
    seconds of the interpreter taken from the rollout pool's loop.)"""
    loop = control_loop()
    return {s.address: loop.submit(score(s)) for s in servers}


def connect_engine(
    engine, rollout: RolloutControl | None, meta: WeightUpdateMeta, servers: list[ServerControl] | None = None
) -> WeightSync:
    """Build the trainer's connection to the servers once (collective) and return it.

    Rank 0 asks its rollout side's servers (:attr:`RolloutControl.servers`), each of TP
    ``meta.inference_tp``; ``servers`` (rank 0, without a rollout side) names them instead, each with its
    own TP size. Every rank learns the servers' family and TP sizes from rank 0.
    """
    server_set, family = None, None
    if _rank() == 0:
        server_set = _server_set(rollout, servers)
        family = (server_set.backend.name, meta.inference_tp, {s.address: s.tp for s in servers or []})
    if dist.is_initialized():
        box = [family]
        dist.broadcast_object_list(box, src=0)
        family = box[0]
    backend, tp, server_tp = family
    sync = WeightSync(engine, meta.config, server_set, rollout, backend=backend, tp=tp, server_tp=server_tp)
    sync.connect()
    return sync


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _server_set(rollout: RolloutControl | None, servers: list[ServerControl] | None) -> ServerSet:
    """Rank 0's owner of the servers: the rollout side's, else one of ``servers`` alone (no rollout side here)."""
    if rollout is not None:
        return rollout.servers
    if not servers:
        raise ValueError("connect_engine: rank 0 needs a rollout engine or servers=")
    return ServerSet.of([s.address for s in servers], servers[0].name)
