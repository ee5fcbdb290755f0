"""Before each update the weight sync asks rank 0's rollout engine for restarted servers: those answering
again join a freshly connected bridge (they get this update's weights), those still down are left out."""

from __future__ import annotations

from types import SimpleNamespace

from megarl.run.weight_sync import WeightSync


class _Bridge:
    def __init__(self, addresses):
        self.servers = [SimpleNamespace(address=a) for a in addresses]
        self.connected, self.is_driver = True, True

    def broadcast_object(self, value):
        return value

    def close(self):
        self.connected = False


def _sync(connected: list[str], back: list[str], down: list[str], unhealthy=()) -> WeightSync:
    sync = WeightSync.__new__(WeightSync)  # only what _restarted reads
    sync.servers = [SimpleNamespace(address=a) for a in ("a:1", "b:1")]
    sync.bridge = _Bridge(connected)
    sync.unhealthy = set(unhealthy)
    sync.rollout = SimpleNamespace(servers_to_readmit=lambda: (list(back), list(down)))
    return sync


def test_a_restarted_server_back_reconnects_the_bridge():
    sync = _sync(connected=["a:1", "b:1"], back=["a:1"], down=[], unhealthy={"a:1"})
    assert sync._restarted() == ["a:1"]
    assert not sync.bridge.connected, "its workers must join new groups"
    assert sync.unhealthy == set()


def test_a_restarted_server_still_down_is_left_out_of_the_bridge():
    sync = _sync(connected=["a:1", "b:1"], back=[], down=["b:1"])
    assert sync._restarted() == []
    assert sync.unhealthy == {"b:1"} and not sync.bridge.connected


def test_no_restart_keeps_the_bridge():
    sync = _sync(connected=["a:1", "b:1"], back=[], down=[])
    assert sync._restarted() == [] and sync.bridge.connected


def test_with_every_server_restarting_the_version_moves_on_without_a_transfer():
    """The only server is restarting during the update: nothing to send to; the version goes up (the
    restarted server gets it once it answers) instead of the update failing the run."""
    sync = _sync(connected=["a:1", "b:1"], back=[], down=["a:1", "b:1"])
    versions = []
    sync.engine = SimpleNamespace(set_version=versions.append)
    sync.rollout.set_version = versions.append
    sync.n_updates, sync.config = 1, SimpleNamespace(probe_every=1)
    stats = sync.update(5)
    assert versions == [5, 5] and stats["bytes_sent"] == 0 and stats["servers_readmitted"] == 0
    assert not sync.bridge.connected


def test_an_update_failing_only_on_dead_servers_is_not_a_failure_of_the_run():
    from megarl.bridge.bridge import UpdateReport

    sync = _sync(connected=["a:1", "b:1"], back=[], down=[])
    report = UpdateReport(3, "sharded", failed={"a:1": "connection refused"}, sender_errors=["gloo: peer closed"])
    sync.rollout.answering = lambda addresses: [False for _ in addresses]
    assert sync._died(report), "a dead server: the launcher restarts it, the trainer readmits it"
    sync.rollout.answering = lambda addresses: [True for _ in addresses]
    assert not sync._died(report), "a live server that failed the transfer is an error, as before"
