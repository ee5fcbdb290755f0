"""The trainer side of the weight bridge: connect once, then send an update per training step.

Every trainer rank builds a :class:`WeightBridge` and calls :meth:`~WeightBridge.connect`
and :meth:`~WeightBridge.update` together (they are collective over ``group``, the
trainer's ranks). Only global rank 0 talks to the servers (:mod:`megarl.serving`);
calls that return once data has moved run in threads while the ranks send.

An update is two-phase. All servers receive; the ones that received everything commit
(apply + new version); a server that failed keeps its old weights (vLLM, staged) or is
half-updated (SGLang, or ``stage=False``) and is reported in
:attr:`UpdateReport.failed` so the caller takes it out of rotation. After a failure the
bridge's groups are considered broken and :meth:`~WeightBridge.connect` must be called
again (with the servers still alive) before the next update.
"""

from __future__ import annotations

import logging
import shutil
import socket
import time
from pathlib import Path

import torch

from megarl.bridge.blocks import Block, BlockSenders, regroup
from megarl.bridge.drive import drive, in_background
from megarl.bridge.groups import default_backend, gather_objects, host_store, rank0_object
from megarl.bridge.interface import ServerBridge, UpdateReport
from megarl.bridge.schedule import ReceiverSpecs, broadcast_schedule, sharded_schedule
from megarl.bridge.source import ShardSource, TrainerCoords
from megarl.bridge.transfer_plan import TransferPlan, build_plan
from megarl.bridge.transport import TransferStats, TransportSender, wire_dtype
from megarl.bridge.transport_broadcast import BroadcastSender
from megarl.bridge.transport_disk import DiskSender
from megarl.bridge.transport_sharded import ShardedSender
from megarl.bridge.wiring import Wiring, make_wiring, trainer_join
from megarl.config.allocation import TrainingAllocation
from megarl.config.bridge import WeightUpdateConfig
from megarl.serving import ServerControl, ServerRef
from megarl.utils.hardware import concrete_dtype
from megarl.utils.network import gethostip

logger = logging.getLogger(__name__)


def _is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("localhost", "::1")


def _own_addresses() -> set[str]:
    """This host's IP addresses (every interface's)."""
    import psutil

    return {
        a.address.split("%")[0]
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family in (socket.AF_INET, socket.AF_INET6)
    }


class WeightBridgeError(RuntimeError):
    """The bridge could not be connected, or an update failed on the trainer side."""


class WeightBridge(ServerBridge):
    """Trainer side of the bridge (one per trainer rank).

    Args:
        config: The ``weight_update`` config.
        desc: :class:`~megarl.models.build.ModelDesc` of the trained model (built with the trainer TP).
        hf_shapes: HF tensor shapes of the checkpoint (``SafetensorsReader.shape``).
        trainer: The trainer's layout.
        coords: This rank's coordinates.
        group: Process group of all trainer ranks in global-rank order (None: the default group).
        source_dir: The HF model directory (disk mode copies its config and tokenizer).
        device: Where the trainer's weights live (chooses NCCL or gloo).
    """

    def __init__(
        self,
        config: WeightUpdateConfig,
        desc,
        hf_shapes: dict,
        trainer: TrainingAllocation,
        coords: TrainerCoords,
        group=None,
        source_dir: str | None = None,
        device="cpu",
    ):
        config.check()
        self.config, self.desc, self.hf_shapes = config, desc, hf_shapes
        self.trainer, self.coords, self.group = trainer, coords, group
        self.source_dir, self.device = source_dir, torch.device(device)
        self.dtype = wire_dtype(concrete_dtype(config.dtype, self.device.type))
        self.bucket_numel = config.bucket_bytes(self.device.type == "cuda") // self.dtype.itemsize
        self.servers: list[ServerControl | ServerRef] = []
        self.blocks: list[Block] = []
        """The servers' blocks, each with its groups (:mod:`megarl.bridge.blocks`)."""
        self._plans: dict = {}
        """(TP sizes, modes) of a block -> its plan and schedules (blocks alike share them)."""
        self._specs: dict = {}
        """(plan, sender ranks) -> the receive specs of a connect's blocks alike (computed once)."""
        self.plan: TransferPlan | None = None
        """The first block's plan (the model's sources are the same in every block's)."""
        self.senders: dict[str, TransportSender] = {}
        self.connected = False

    @property
    def is_driver(self) -> bool:
        return self.coords.rank == 0

    # ------------------------------------------------------------------ connect

    def connect(self, servers: list[ServerControl | ServerRef]) -> None:
        """Form the groups with ``servers`` (collective); raises WeightBridgeError naming what failed.

        The groups of blocks that are intact and whose servers are all still wanted are kept (their
        servers are not called); the other servers are cut into blocks whose groups form now
        (:mod:`megarl.bridge.blocks`)."""
        modes = self.config.modes
        if not servers:
            raise ValueError("the weight bridge has no inference servers to connect to")
        backend = servers[0].name
        if backend == "sglang" and "sharded" in modes:
            raise ValueError("weight_update.mode 'sharded' needs vLLM servers (SGLang has no sharded receive API)")
        self.servers = list(servers)
        kept, runs = regroup(self.blocks, self.servers, self.config.group_servers(len(servers)))
        for block in self.blocks:
            if block not in kept:
                block.close()
        forming, self._specs = [self._block(run, modes) for run in runs], {}
        self.blocks = kept + forming
        self.plan = self.blocks[0].plan
        stores = self._wire(forming)
        errors: dict[str, str] = {}
        joining = None
        if self.is_driver and set(modes) != {"disk"}:  # servers join (in the background) the groups: disk mode has none
            infos = {s.address: info for block in forming for s, info in zip(block.servers, self._init_infos(block))}
            calls = {s.address: (lambda s=s: s.init_group(infos[s.address])) for b in forming for s in b.servers}
            joining = in_background(calls, self.config.init_timeout, errors)
        for i, block in enumerate(forming):  # in block order on every rank: no rendezvous waits in a cycle
            try:
                block.broadcast_groups, block.sharded_group = trainer_join(
                    block.wiring, self.coords.rank, self.config.init_timeout, stores
                )
            except RuntimeError as e:
                errors[f"trainer rank {self.coords.rank}, group {i + 1} of {len(forming)}"] = str(e)
        if joining is not None:
            joining.join()
        self._agree(errors, "connecting the weight bridge")
        self._build_senders(backend)
        self.connected = True
        logger.info(
            "weight bridge connected to %d server(s) (%s), modes %s: %d group(s) formed, %d kept",
            len(servers),
            backend,
            modes,
            len(forming),
            len(kept),
        )

    def release(self, addresses) -> None:
        """The groups of the blocks holding ``addresses`` (restarted, failed, leaving) re-form at the next
        :meth:`connect`; the other blocks keep theirs. Not connected until then."""
        addresses = set(addresses)
        for block in self.blocks:
            block.release(addresses)
        self.connected = False

    def _block(self, servers: list[ServerControl | ServerRef], modes) -> Block:
        """A block of ``servers`` with its plan and schedules (shared by blocks of the same TP sizes)."""
        key = (tuple(s.tp for s in servers), modes)
        if key not in self._plans:
            plan = build_plan(self.desc, self.hf_shapes, self.trainer, key[0], sharded="sharded" in modes)
            sharded = sharded_schedule(plan, self.bucket_numel) if "sharded" in modes else None
            self._plans[key] = (plan, broadcast_schedule(plan, self.bucket_numel), sharded)
        return Block(list(servers), *self._plans[key])

    def _wire(self, blocks: list[Block]) -> dict:
        """Each block's wiring: its groups, their hosts and rendezvous ports (one gather of every rank's
        ports for all ``blocks``). Returns the stores this rank hosts, by port, already listening."""
        if not blocks:
            return {}
        modes = self.config.modes
        table = self._all_gather(self.coords)
        backend = default_backend(self.device)

        def wiring(block: Block, address_of, prefix: str) -> Wiring:
            bowners = block.broadcast_schedule.senders if "broadcast" in modes else []
            sowners = block.sharded_schedule.senders if block.sharded_schedule is not None else []
            rank_of = {o: next(c.rank for c in table if c.holds(o)) for o in [*bowners, *sowners]}
            return make_wiring(
                backend, len(block.plan.workers), bowners, sowners, rank_of.__getitem__, address_of, prefix
            )

        counted = [wiring(b, lambda r, k: ("", 0), "count") for b in blocks]
        mine = sum(w.groups_hosted_by(self.coords.rank) for w in counted)
        host = self.config.master_address or gethostip()
        stores = {s.port: s for s in (host_store(host, self.config.init_timeout) for _ in range(mine))}
        addresses = self._all_gather((host, list(stores), _own_addresses()))
        self._check_reachable(addresses)
        prefix = f"megarl-bridge-{int(time.time() * 1000) % 10**9}"
        prefix = self._all_gather(prefix)[0]  # every rank names the groups alike
        hosted: dict[int, int] = {}  # trainer rank -> ports of it handed out so far

        def address_of(rank: int, _k: int) -> tuple[str, int]:
            k = hosted[rank] = hosted.get(rank, -1) + 1
            return addresses[rank][0], addresses[rank][1][k]

        for i, block in enumerate(blocks):
            block.wiring = wiring(block, address_of, f"{prefix}-{i}")
        return stores

    def _check_reachable(self, addresses: list[tuple[str, list[int], set[str]]]) -> None:
        """Fail (on every rank alike) when a trainer rank would host groups on a loopback address that
        servers on other hosts cannot reach: a host without a default route and no interface named."""
        hosts = {s.address: s.address.rsplit(":", 1)[0].strip("[]") for s in self.servers}
        for rank, (host, ports, own) in enumerate(addresses):
            elsewhere = sorted(a for a, h in hosts.items() if not _is_loopback(h) and h not in own)
            if ports and _is_loopback(host) and elsewhere:
                raise WeightBridgeError(
                    f"the weight bridge's trainer rank {rank} would announce {host} to servers on other hosts "
                    f"({', '.join(elsewhere)}), which cannot reach it: set launcher.slurm.network_interface (or "
                    "$MEGARL_NETWORK_INTERFACE, weight_update.master_address or $MEGARL_HOST_IP) to the cluster "
                    "interface's"
                )

    def _init_infos(self, block: Block) -> list[dict]:
        """The init body of each server of ``block``."""
        modes = self.config.modes
        key = (id(block.plan), tuple(block.wiring.sender_ranks))
        if key not in self._specs:  # each distinct part computed once for the blocks alike
            self._specs[key] = ReceiverSpecs(
                block.plan, block.broadcast_schedule, block.sharded_schedule, block.wiring.sender_ranks
            )
        specs = self._specs[key]
        wired = block.wiring.to_json()
        return [self._init_info(block.plan, i, wired, modes, specs) for i in range(len(block.servers))]

    def _init_info(self, plan: TransferPlan, server: int, wiring: dict, modes, specs: ReceiverSpecs) -> dict:
        """Server ``server``'s (of ``plan``) init body: the wiring (``Wiring.to_json``) and its workers'
        packed receive specs (:class:`~megarl.bridge.schedule.ReceiverSpecs`; each packed part once per body)."""
        packed, shared = specs.server(server, [m for m in modes if m != "disk"])
        return {
            "wiring": wiring,
            "worker_offset": plan.worker_index(server, 0),
            "specs": packed,
            "shared": shared,
            "dtype": str(self.dtype).removeprefix("torch."),
            "timeout": self.config.update_timeout,
            "stage": self.config.stage,
        }

    def _build_senders(self, backend: str) -> None:
        first = self.blocks[0]
        self.senders = {
            "disk": DiskSender(
                first.plan, first.broadcast_schedule, self.coords, self.dtype, self.source_dir, self.group
            )
        }
        if first.wiring.broadcast:  # broadcast mode: one block
            self.senders["broadcast"] = BroadcastSender(
                first.plan,
                first.broadcast_schedule,
                self.coords,
                first.broadcast_groups,
                self.dtype,
                as_bytes=backend == "sglang",
            )
        if first.sharded_schedule is not None:
            self.senders["sharded"] = BlockSenders(
                [
                    (
                        b,
                        ShardedSender(
                            b.sharded_schedule,
                            self.coords,
                            b.sharded_group,
                            len(b.wiring.sharded_members),
                            self.dtype,
                            self.config,
                        ),
                    )
                    for b in self.blocks
                ]
            )

    # ------------------------------------------------------------------ update

    def update(
        self, source: ShardSource, version: int, mode: str | None = None, path: str | None = None
    ) -> UpdateReport:
        """Send the weights of ``source`` as ``version`` (collective). Failures are in the report."""
        mode = mode or self.config.mode
        if not self.connected:
            raise WeightBridgeError("the weight bridge is not connected (connect() first, again after a failure)")
        if mode not in self.senders:
            raise ValueError(f"update mode {mode!r} was not wired at connect(); wired: {sorted(self.senders)}")
        start = time.perf_counter()
        report = UpdateReport(version, mode)
        if mode == "disk":
            stats, send = self._send_disk(source, path, version), None
        else:
            stats = TransferStats()
            send = lambda: stats.__dict__.update(self.senders[mode].send(source).__dict__)
        disk_dir = str(self.senders["disk"].path) if mode == "disk" else None
        failed, commit_seconds = drive(self.servers, mode, disk_dir, version, self.config, send, self.is_driver)
        errors = [e for e in self._all_gather(stats.error) if e]
        report.bytes_sent = sum(self._all_gather(stats.bytes_sent))
        report.send_seconds = max(self._all_gather(stats.seconds))
        report.failed = self.broadcast_object(failed)
        report.commit_seconds = self.broadcast_object(commit_seconds)
        report.sender_errors = errors
        report.updated = [s.address for s in self.servers if s.address not in report.failed]
        report.seconds = time.perf_counter() - start
        if not report.ok:  # a group with a dead or lagging member is unusable: connect() again
            self.release(report.failed if not errors else [s.address for s in self.servers])
            logger.error("weight update to version %d (%s) failed: %s %s", version, mode, report.failed, errors)
        return report

    def _send_disk(self, source: ShardSource, path: str | None, version: int) -> TransferStats:
        sender = self.senders["disk"]
        root = _path(path or self.config.disk_path)
        sender.path = root if path else root / f"v{version}"
        stats = sender.send(source)
        if self.is_driver and not path:
            prune_versions(root, self.config.keep_disk_versions)
        return stats

    # ------------------------------------------------------------------ helpers

    def _all_gather(self, value) -> list:
        return gather_objects(value, self.group)

    def broadcast_object(self, value):
        """Rank 0's ``value`` on every trainer rank."""
        return rank0_object(value, self.group)

    def _agree(self, errors: dict, what: str) -> None:
        merged = {k: v for part in self._all_gather(errors) for k, v in part.items()}
        if merged:
            self.close()
            raise WeightBridgeError(f"{what} failed: " + "; ".join(f"{k}: {v}" for k, v in merged.items()))

    def close(self) -> None:
        """Leave every group (the servers' ends are replaced at the next connect)."""
        for block in self.blocks:
            block.close()
        self.blocks, self.senders, self.connected = [], {}, False


def _path(path: str) -> Path:
    if not path:
        raise ValueError("disk mode needs weight_update.disk_path (storage shared with the servers)")
    return Path(path)


def prune_versions(root: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` version directories (``v<N>``) under ``root``."""
    versions = sorted(
        (p for p in root.glob("v*") if p.is_dir() and p.name[1:].isdigit()), key=lambda p: int(p.name[1:])
    )
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
