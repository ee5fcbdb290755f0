"""The weight-sync phase reaches the rollout side through ``megarl.api.rollout_control.RolloutControl``.

A fake that implements the interface (and nothing else of a rollout engine) is driven through
one update: pause before the transfer, the version moved on the rollout side where the bridge
landed it, resume after; a server that failed the transfer is taken out of rotation (in the run's
one :class:`~megarl.serving.servers.ServerSet`, which the interface hands the weight sync).
"""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from megarl.api.rollout_control import RolloutControl
from megarl.bridge.bridge import UpdateReport
from megarl.rollout import RemoteInferenceEngine
from megarl.run.weight_sync import WeightSync, WeightUpdateMeta
from megarl.serving import ServerRef, ServerSet


class FakeRollout(RolloutControl):
    """Records every call the weight sync makes."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.version = 0
        self.server_set = ServerSet.of(["a:1", "b:1"])

    def pause(self, servers=True):
        self.calls.append(("pause", servers))

    def resume(self, start_episodes=True, servers=True):
        self.calls.append(("resume", start_episodes, servers))

    def start_episodes(self):
        self.calls.append(("start_episodes",))

    def sleep(self):
        self.calls.append(("sleep",))

    def wake(self):
        self.calls.append(("wake",))

    def set_version(self, version):
        self.calls.append(("set_version", version))
        self.version = version

    def use_adapter(self, name):
        self.calls.append(("use_adapter", name))

    def get_version(self):
        return self.version

    @property
    def servers(self):
        return self.server_set


class _Bridge:
    """A transfer that lands on ``updated`` and fails on ``failed``."""

    def __init__(self, updated, failed):
        self.updated, self.failed = updated, failed
        self.servers = [SimpleNamespace(address=a) for a in ("a:1", "b:1")]
        self.connected, self.is_driver = True, True

    def update(self, source, version, mode, path):
        return UpdateReport(
            version=version,
            mode=mode or "sharded",
            seconds=0.1,
            bytes_sent=10,
            updated=list(self.updated),
            failed=dict(self.failed),
        )

    def broadcast_object(self, value):
        return value

    def close(self):
        self.connected = False


def _sync(rollout: RolloutControl, updated, failed=None, driver=True, servers_pause_themselves=True) -> WeightSync:
    sync = WeightSync.__new__(WeightSync)  # no real bridge: the seam is what is tested
    engine = SimpleNamespace(version=0)
    engine.get_version = lambda: engine.version
    engine.set_version = lambda v: setattr(engine, "version", v)
    sync.engine, sync.rollout, sync.probe, sync.n_updates = engine, rollout, [], 0
    sync.server_set, sync.plan = rollout.servers, None
    sync.config = SimpleNamespace(probe_every=10**9, max_failed_fraction=0.25)
    sync.bridge = _Bridge(updated, failed or {})
    sync.bridge.is_driver = driver
    sync.servers_pause_themselves = servers_pause_themselves
    sync.server_tp = {}
    return sync


def test_the_rollout_side_is_paused_versioned_and_resumed(monkeypatch):
    monkeypatch.setattr("megarl.run.weight_sync.ShardSource.from_engine", lambda engine: None)
    rollout = FakeRollout()
    sync = _sync(rollout, updated=["a:1", "b:1"])
    sync.n_updates = 1  # not a probing update
    sync.update_weights(WeightUpdateMeta(config=None, version=3))
    # vLLM: each server pauses and resumes in its update call; the heads' requests go out once the version moved
    assert rollout.calls == [("pause", False), ("set_version", 3), ("resume", True, False)]
    assert sync.engine.get_version() == 3


@pytest.mark.parametrize(
    "driver, pause_themselves, pause_servers, resume_servers",
    [(True, True, False, False), (True, False, True, True), (False, True, False, False), (False, False, False, False)],
)
def test_only_rank_0_calls_the_servers(monkeypatch, driver, pause_themselves, pause_servers, resume_servers):
    """Every head holds its own pool; the servers get ``/pause`` and ``/resume`` (where their update call
    does not pause and resume them) from rank 0 alone, not once per head."""
    monkeypatch.setattr("megarl.run.weight_sync.ShardSource.from_engine", lambda engine: None)
    rollout = FakeRollout()
    sync = _sync(rollout, updated=["a:1", "b:1"], driver=driver, servers_pause_themselves=pause_themselves)
    sync._plan = rollout.servers.update_plan  # what rank 0 broadcasts
    sync.n_updates = 1
    sync.update_weights(WeightUpdateMeta(config=None, version=2))
    assert rollout.calls == [("pause", pause_servers), ("set_version", 2), ("resume", True, resume_servers)]


def test_an_update_that_forms_the_group_again_says_what_that_took(monkeypatch):
    """After a server left the group (the bridge closed), the next update connects first: its stats
    carry the time, so a run's metrics show what each re-formation cost; a steady update says 0."""
    monkeypatch.setattr("megarl.run.weight_sync.ShardSource.from_engine", lambda engine: None)
    sync = _sync(FakeRollout(), updated=["a:1", "b:1"])
    sync.n_updates = 1
    connects = []

    def connect(plan):
        time.sleep(0.05)
        connects.append(plan)
        sync.bridge.connected = True

    sync.connect = connect
    assert sync.update_weights(WeightUpdateMeta(config=None, version=1))["connect_seconds"] == 0.0
    sync.bridge.close()
    stats = sync.update_weights(WeightUpdateMeta(config=None, version=2))
    assert len(connects) == 1 and stats["connect_seconds"] >= 0.05


def test_a_server_that_failed_the_transfer_leaves_rotation(monkeypatch):
    monkeypatch.setattr("megarl.run.weight_sync.ShardSource.from_engine", lambda engine: None)
    rollout = FakeRollout()
    sync = _sync(rollout, updated=["a:1"], failed={"b:1": "connection reset"})
    sync.n_updates = 1
    sync._died = lambda report: False
    with pytest.raises(Exception, match="b:1"):
        sync.update_weights(WeightUpdateMeta(config=None, version=1))
    assert rollout.servers.held_out() == {"b:1"} and rollout.calls[-1] == ("resume", True, False)


def test_the_rollout_engine_implements_the_interface():
    assert issubclass(RemoteInferenceEngine, RolloutControl)
    assert not getattr(RemoteInferenceEngine, "__abstractmethods__", None)
    with pytest.raises(TypeError):

        class Partial(RolloutControl):
            def pause(self):
                pass

        Partial()


def test_pause_resume_and_versions_are_declared_once_in_the_api():
    """The engine contract AReaL's users call and the seam the weight sync drives are one declaration."""
    from megarl.api.engine_api import InferenceEngine

    assert issubclass(InferenceEngine, RolloutControl)
    for name in ("pause", "resume", "set_version"):
        owners = [c.__name__ for c in InferenceEngine.__mro__ if name in vars(c)]
        assert owners == ["RolloutControl"], (name, owners)


def test_an_adapter_update_makes_the_adapter_the_one_the_server_set_serves(monkeypatch):
    """Adapter weight sync: once the servers loaded a version's adapter, the rollout side asks for it and the
    run's :class:`ServerSet` serves it (one fact, read by every request and every probe)."""
    monkeypatch.setattr("megarl.run.weight_sync.ShardSource.from_engine", lambda engine: None)
    rollout = FakeRollout()
    sync = _sync(rollout, updated=["a:1", "b:1"])
    sync.n_updates = 1
    adapter_report = sync.bridge.update

    def update(source, version, mode, path):
        report = adapter_report(source, version, mode, path)
        report.adapter = f"megarl-lora-v{version}"
        return report

    sync.bridge.update = update
    sync.update_weights(WeightUpdateMeta(config=None, version=4))
    assert ("use_adapter", "megarl-lora-v4") in rollout.calls
    assert rollout.servers.adapter == "megarl-lora-v4"


@pytest.mark.parametrize("backend, one_call", [("vllm", True), ("sglang", False)])
def test_ranks_other_than_0_know_the_servers_without_a_control_handle(backend, one_call):
    """Rank 0 calls the servers through their control handles; the other ranks only form groups and send,
    knowing each server's family, address and TP size."""
    sync = _sync(FakeRollout(), updated=["a:1", "b:1"], driver=False)
    sync.backend, sync.tp = backend, 2
    assert sync._servers(["a:1", "b:1"]) == [ServerRef(backend, a, 2, one_call) for a in ("a:1", "b:1")]
    sync.bridge.is_driver = True
    sync.config.update_timeout = 5.0
    controls = sync._servers(["a:1", "b:1"])
    assert [type(c).__name__ for c in controls] == ["VLLMControl"] * 2  # the rollout side's family
    assert controls == sync._servers(["a:1", "b:1"])  # made once per server


def test_servers_of_different_tp_sizes_are_each_known_by_their_own():
    """Servers named at connect with their own TP sizes (one of TP 1, one of TP 2): each rank knows each
    server's size (the TP-2 server's second worker got no receive spec when the first one's size was
    taken for all); a server not named then has the run's size."""
    sync = _sync(FakeRollout(), updated=["a:1", "b:1"], driver=False)
    sync.backend, sync.tp, sync.server_tp = "vllm", 1, {"a:1": 1, "b:1": 2}
    assert [ref.tp for ref in sync._servers(["b:1", "a:1", "c:1"])] == [2, 1, 1]
    sync.bridge.is_driver = True
    sync.config.update_timeout = 5.0
    assert [control.tp for control in sync._servers(["b:1", "a:1"])] == [2, 1]


def test_a_served_adapter_is_probed_before_the_interrupted_generations_go_on(monkeypatch):
    """vLLM maps a LoRA adapter's prompt logprobs right only for a request alone in its batch (beside another
    request its worker fails): with adapter sync the servers are resumed and scored before any head lets its
    interrupted generations go on, which happens before the trainer's forward of the probe; without an
    adapter the generations go on before the probe, as they always did."""
    from concurrent.futures import Future

    monkeypatch.setattr("megarl.run.weight_sync.ShardSource.from_engine", lambda engine: None)

    def run(adapter: bool) -> list:
        rollout = FakeRollout()
        sync = _sync(rollout, updated=["a:1", "b:1"], servers_pause_themselves=False)
        sync.probe, sync.config = [[1, 2, 3]], SimpleNamespace(probe_every=1, probe_topk=0, consistency_threshold=1.0)
        report_of = sync.bridge.update
        if adapter:
            sync.bridge.update = lambda *a: replace(report_of(*a), adapter="megarl-lora-v1")
        monkeypatch.setattr(rollout.server_set, "control_all", lambda calls: rollout.calls.append(("servers on",)))

        def score_all(servers, probe):
            rollout.calls.append(("servers score",))
            done = Future()
            done.set_result(([[-1.0, -1.0]], None))
            return {s.address: done for s in servers}

        def trainer_scores(engine, probe, ids):
            rollout.calls.append(("trainer scores",))
            return [[-1.0, -1.0]], None

        monkeypatch.setattr("megarl.run.weight_sync.score_all", score_all)
        monkeypatch.setattr("megarl.run.weight_sync.trainer_probe_scores", trainer_scores)
        sync.update_weights(WeightUpdateMeta(config=None, version=1))
        return [c for c in rollout.calls if c[0] not in ("pause", "set_version", "use_adapter")]

    assert run(adapter=True) == [
        ("servers on",),
        ("servers score",),
        ("resume", False, False),  # the generations go on
        ("trainer scores",),
        ("resume", True, False),  # new episodes
    ]
    assert run(adapter=False) == [
        ("resume", False, True),  # servers and generations on, no new episodes yet
        ("servers score",),
        ("trainer scores",),
        ("start_episodes",),
    ]
