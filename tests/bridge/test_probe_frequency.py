"""The consistency probe runs on the first update of a trainer and then every ``probe_every`` updates."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megarl.config.bridge import WeightUpdateConfig
from megarl.run import weight_sync as update_mod
from megarl.run.weight_sync import WeightSync
from megarl.serving import ServerSet


def _sync(probe_every: int, monkeypatch) -> tuple[WeightSync, list[int]]:
    """A WeightSync whose transfer always succeeds, recording the versions it probed after."""
    sync = WeightSync.__new__(WeightSync)
    sync.engine, sync.config, sync.server_set, sync.rollout = (
        SimpleNamespace(set_version=lambda v: None),
        WeightUpdateConfig(probe_every=probe_every),
        ServerSet.of(["s:1"]),
        None,
    )
    sync.probe, sync.plan, sync.n_updates = [[1, 2, 3]], None, 0
    sync.servers_pause_themselves = True
    report = SimpleNamespace(
        seconds=0.0,
        send_seconds=0.0,
        commit_seconds=0.0,
        bytes_sent=0,
        ok=True,
        failed={},
        updated=["s:1"],
        sender_errors={},
        adapter=None,
    )
    sync.bridge = SimpleNamespace(
        connected=True,
        update=lambda *args: report,
        is_driver=True,
        servers=[SimpleNamespace(address="s:1")],
        broadcast_object=lambda obj: obj,
    )  # one rank: a broadcast returns its input
    monkeypatch.setattr(update_mod.ShardSource, "from_engine", staticmethod(lambda engine: None))
    probed: list[int] = []
    sync.check_consistency = lambda release=False: probed.append(sync.n_updates) or {"logprob_diff_max": 0.0}
    return sync, probed


@pytest.mark.parametrize(("every", "want"), [(1, [0, 1, 2, 3, 4, 5, 6, 7, 8]), (4, [0, 4, 8]), (100, [0])])
def test_probe_every(monkeypatch, every, want):
    sync, probed = _sync(every, monkeypatch)
    stats = [sync.update(version) for version in range(9)]
    assert probed == want
    assert [i for i, s in enumerate(stats) if "logprob_diff_max" in s and "probe_seconds" in s] == want


def test_probe_every_must_be_positive():
    with pytest.raises(ValueError, match="probe_every"):
        WeightUpdateConfig(probe_every=0).check()


class _Rollout:
    """Records what the weight sync asks of the rollout, and whether episodes run during the probe."""

    def __init__(self):
        self.calls: list[str] = []
        self.episodes = True

    def pause(self, servers: bool = True):
        self.calls.append("pause")
        self.episodes = False

    def resume(self, start_episodes: bool = True, servers: bool = True):
        self.calls.append(f"resume(episodes={start_episodes})")
        self.episodes = start_episodes

    def start_episodes(self):
        self.calls.append("start_episodes")
        self.episodes = True

    def set_version(self, version):
        pass


def test_probe_runs_before_new_episodes_start(monkeypatch):
    sync, probed = _sync(2, monkeypatch)
    sync.rollout = rollout = _Rollout()
    during_probe = []
    sync.check_consistency = lambda release=False: during_probe.append(rollout.episodes) or {}
    sync.update(1)  # probed
    sync.update(2)  # not probed
    assert during_probe == [False], "servers score the probe with no episode generating"
    assert rollout.calls == ["pause", "resume(episodes=False)", "start_episodes", "pause", "resume(episodes=True)"]


def test_episodes_start_again_when_the_probe_fails(monkeypatch):
    sync, _ = _sync(1, monkeypatch)
    sync.rollout = rollout = _Rollout()

    def broken(release=False):
        raise RuntimeError("server gone")

    sync.check_consistency = broken
    with pytest.raises(RuntimeError, match="server gone"):
        sync.update(1)
    assert rollout.episodes and rollout.calls[-1] == "start_episodes"
