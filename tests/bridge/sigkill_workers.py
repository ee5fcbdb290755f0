"""The trainer of ``test_receiver_sigkill.py``: one rank driving fake vLLM servers through :class:`WeightSync`.

The run's real weight-sync phase (:class:`~megarl.run.weight_sync.WeightSync`, its
:class:`~megarl.bridge.bridge.WeightBridge` and the run's :class:`~megarl.serving.servers.ServerSet`)
over a stand-in for the Megatron engine: its shards are the HF checkpoint's times the version being
sent (``tests.bridge.workers.trainer_source``), so every update carries different bytes and a
server's dump says which version it holds.
"""

from __future__ import annotations

import time
import traceback
from types import SimpleNamespace

import torch

from megarl.api.rollout_control import RolloutControl
from megarl.bridge.source import TrainerCoords
from megarl.config.allocation import TrainingAllocation
from megarl.models.build import describe
from megarl.serving import ServerSet
from tests.bridge.workers import trainer_source


class _Engine:
    """What :class:`WeightSync` reads of a one-rank :class:`~megarl.actor.engine.MegatronEngine`."""

    def __init__(self, model_dir: str):
        self.model_path, self.desc = model_dir, describe(model_dir, 1)
        layout = TrainingAllocation()
        self.parallel = SimpleNamespace(
            alloc=layout, rank=0, pp_rank=0, tp_rank=0, dp_rank=0, replica_rank=0, ep_rank=0, etp_rank=0, edp_rank=0
        )
        self.model = [torch.nn.Linear(1, 1)]  # where the weights live: the CPU
        self.config = SimpleNamespace(lora=SimpleNamespace(enabled=False))
        self.version, self.sending = 0, 0

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version

    def source(self):
        """The shards of the version being sent."""
        coords = TrainerCoords.from_parallel(self.parallel)
        return trainer_source(self.model_path, self.parallel.alloc, coords, None, None, scale=float(self.sending))


class _Rollout(RolloutControl):
    """The rank-0 rollout side, reduced to what the weight sync calls: the run's server set and a version."""

    def __init__(self, addresses: list[str]):
        self.server_set, self.version = ServerSet.of(addresses), 0

    def pause(self, servers=True):
        pass

    def resume(self, start_episodes=True, servers=True):
        pass

    def start_episodes(self):
        pass

    def sleep(self):
        pass

    def wake(self):
        pass

    def set_version(self, version):
        self.version = version

    def use_adapter(self, name):
        pass

    def get_version(self):
        return self.version

    @property
    def servers(self):
        return self.server_set


def sync_through_a_kill(
    model_dir: str, addresses: list[str], dump_dir: str, update_timeout: float, servers_per_group: int
) -> tuple[float, list[dict]]:
    """Three sharded updates through ``WeightSync`` (versions 1, 2, 3); a receiver is killed from outside
    during the second. Returns the seconds this process waited for the servers to be up and, per update,
    what it returned or raised, how long it took, the bridge's report, whom the server set holds out,
    which workers the sender lost, and each answering server's dump."""
    import megarl.run.weight_sync as weight_sync
    from megarl.bridge.blocks import BlockSenders
    from megarl.config.bridge import WeightUpdateConfig
    from megarl.serving.http import http_json, http_ok_all
    from megarl.serving.vllm import VLLMControl

    class _Source:
        @staticmethod
        def from_engine(engine: _Engine):
            return engine.source()

    begun = time.monotonic()
    deadline = begun + 120  # the servers start while this process does
    while not all(http_ok_all(addresses, "/health")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"fake servers not healthy within 120s: {addresses}")
        time.sleep(0.5)
    waited = time.monotonic() - begun
    weight_sync.ShardSource = _Source  # the engine's shards: the stand-in's (the rest is the run's code)
    sent = []  # each sharded send's stats (which workers it lost)
    send = BlockSenders.send
    BlockSenders.send = lambda self, source: sent.append(send(self, source)) or sent[-1]
    config = WeightUpdateConfig(
        mode="sharded",
        bucket_mb=0.1,
        dtype="bfloat16",
        init_timeout=60,
        update_timeout=update_timeout,
        straggler_floor_s=10,
        probe_sequences=0,
        servers_per_group=servers_per_group,
    )
    engine, rollout = _Engine(model_dir), _Rollout(addresses)
    controls = [VLLMControl(a, 1, timeout=update_timeout) for a in addresses]
    sync = weight_sync.connect_engine(engine, rollout, weight_sync.WeightUpdateMeta(config), servers=controls)
    reports = []
    bridge_update = sync.bridge.update
    sync.bridge.update = lambda *a, **k: reports.append(bridge_update(*a, **k)) or reports[-1]
    out = []
    for version in (1, 2, 3):
        engine.sending, sent[:] = version, []
        start, error, stats = time.perf_counter(), None, None
        try:
            stats = sync.update_weights(weight_sync.WeightUpdateMeta(config, version=version))
        except Exception as e:  # noqa: BLE001 (recorded: the test says what today's code did)
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        seconds = time.perf_counter() - start
        report = reports[-1] if reports and reports[-1].version == version else None
        dumped = []
        for address in addresses:
            if VLLMControl(address, 1, timeout=5).healthy():
                http_json(address, "/fake/dump", {"path": f"{dump_dir}/v{version}-{address.replace(':', '_')}.pt"})
                dumped.append(address)
        out.append(
            {
                "version": version,
                "seconds": seconds,
                "error": error,
                "lost_workers": {w: why for st in sent for w, why in st.extra.get("lost_workers", {}).items()},
                "stats": stats,
                "report": None
                if report is None
                else {
                    "ok": report.ok,
                    "updated": report.updated,
                    "failed": report.failed,
                    "sender_errors": report.sender_errors,
                    "seconds": report.seconds,
                },
                "held_out": sorted(sync.server_set.held_out()),
                "bridge_servers": [s.address for s in sync.bridge.servers],
                "engine_version": engine.get_version(),
                "rollout_version": rollout.get_version(),
                "dumped": dumped,
            }
        )
    return waited, out
