"""The consistency probe runs on the first update of a trainer and then every ``probe_every`` updates."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megarl.bridge import update as update_mod
from megarl.bridge.update import WeightSync
from megarl.config.bridge import WeightUpdateConfig


def _sync(probe_every: int, monkeypatch) -> tuple[WeightSync, list[int]]:
    """A WeightSync whose transfer always succeeds, recording the versions it probed after."""
    sync = WeightSync.__new__(WeightSync)
    sync.engine, sync.config, sync.servers, sync.rollout = SimpleNamespace(set_version=lambda v: None), \
        WeightUpdateConfig(probe_every=probe_every), [], None  # fmt: skip
    sync.probe, sync.unhealthy, sync.n_updates = [[1, 2, 3]], set(), 0
    report = SimpleNamespace(seconds=0.0, bytes_sent=0, ok=True, failed={}, updated=["s"], sender_errors={})
    sync.bridge = SimpleNamespace(connected=True, update=lambda *args: report)
    monkeypatch.setattr(update_mod.ShardSource, "from_engine", staticmethod(lambda engine: None))
    probed: list[int] = []
    sync.check_consistency = lambda: probed.append(sync.n_updates) or {"logprob_diff_max": 0.0}
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
