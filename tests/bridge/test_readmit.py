"""Before each update the weight sync asks the run's servers (rank 0's :class:`ServerSet`) whom to send to:
restarted servers answering again join a freshly connected bridge (they get this update's weights), those
still down are left out."""

from __future__ import annotations

from types import SimpleNamespace

from megarl.run.weight_sync import WeightSync
from megarl.serving import ServerSet


class _Bridge:
    def __init__(self, addresses):
        self.servers = [SimpleNamespace(address=a) for a in addresses]
        self.connected, self.is_driver = True, True

    def broadcast_object(self, value):
        return value

    def release(self, addresses):
        self.released, self.connected = list(addresses), False


def _sync(connected: list[str], back: list[str], down: list[str], unhealthy=()) -> WeightSync:
    """Servers a:1 and b:1; ``back`` and ``down`` were restarted (answering again, or not), ``unhealthy``
    failed an update."""
    servers = ServerSet.of(["a:1", "b:1"])
    for address in [*back, *down, *unhealthy]:
        servers.mark_unhealthy(address, "restarted or failed")
    servers.to_readmit = lambda: (list(back), list(down))  # what the launcher's records and health checks say
    sync = WeightSync.__new__(WeightSync)  # only what planning an update reads
    sync.bridge, sync.server_set, sync.plan = _Bridge(connected), servers, None
    sync.rollout = SimpleNamespace()
    return sync


def test_a_restarted_server_back_reconnects_the_bridge():
    sync = _sync(connected=["a:1", "b:1"], back=["a:1"], down=[])
    plan = sync._next_plan()
    assert plan.readmit == ["a:1"] and plan.targets == ["a:1", "b:1"]
    assert not sync.bridge.connected, "its workers must join new groups"
    assert sync.bridge.released == ["a:1"], "only its group re-forms"


def test_a_restarted_server_still_down_is_left_out_of_the_bridge():
    sync = _sync(connected=["a:1", "b:1"], back=[], down=["b:1"])
    plan = sync._next_plan()
    assert plan.readmit == [] and plan.targets == ["a:1"] and not sync.bridge.connected


def test_no_restart_keeps_the_bridge():
    sync = _sync(connected=["a:1", "b:1"], back=[], down=[])
    assert sync._next_plan().readmit == [] and sync.bridge.connected


def test_a_server_that_failed_an_update_stays_out_until_restarted():
    sync = _sync(connected=["a:1", "b:1"], back=[], down=[], unhealthy=["b:1"])
    assert sync._next_plan().targets == ["a:1"]


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


def test_an_update_landing_readmits_the_restarted_servers_it_reached():
    sync = _sync(connected=["a:1", "b:1"], back=["a:1"], down=[])
    sync.plan = sync._next_plan()
    sync.engine = SimpleNamespace(set_version=lambda v: None)
    sync.rollout.set_version = lambda v: None
    from megarl.bridge.bridge import UpdateReport

    assert sync._after(UpdateReport(3, "sharded", updated=["a:1"], failed={"b:1": "reset"}), 3) == ["a:1"]
    assert sync.server_set.held_out() == {"b:1"}


def test_an_update_failing_only_on_dead_servers_is_not_a_failure_of_the_run():
    from megarl.bridge.bridge import UpdateReport

    sync = _sync(connected=["a:1", "b:1"], back=[], down=[])
    report = UpdateReport(3, "sharded", failed={"a:1": "connection refused"}, sender_errors=["gloo: peer closed"])
    sync.server_set.answering = lambda addresses: [False for _ in addresses]
    assert sync._died(report), "a dead server: the launcher restarts it, the trainer readmits it"
    sync.server_set.answering = lambda addresses: [True for _ in addresses]
    assert not sync._died(report), "a live server that failed the transfer is an error, as before"
