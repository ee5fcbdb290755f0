"""The consistency probe asks every server at once (not 8 at a time: 64 servers were 8 rounds; on the control
loop, not a thread per server), and
names each server's figures by its number in the run's server list (``server{i}``: slot i under Slurm)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from megarl.config.bridge import WeightUpdateConfig
from megarl.run import weight_sync as sync_mod
from megarl.serving.control_loop import control_loop
from megarl.serving.servers import ServerSet, UpdatePlan

N = 24
PROBE = [[5, 6, 7, 8]]
TOPK = [[{1: -0.5, 2: -1.5}, {3: -0.7, 4: -1.0}, {1: -0.2, 4: -2.0}]]


class InFlight:
    """Counts the calls running at once on the control loop; each waits until all ``expected`` are in (or
    ``timeout`` passes), so a fan-out capped below ``expected`` shows as a smaller maximum, whatever the
    machine's load."""

    def __init__(self, expected: int, timeout: float = 10.0):
        self.expected, self.timeout = expected, timeout
        self.now = self.most = 0
        self._all_in: asyncio.Event | None = None

    async def __call__(self, result):
        if self._all_in is None:
            self._all_in = asyncio.Event()
        self.now += 1
        self.most = max(self.most, self.now)
        if self.now == self.expected:
            self._all_in.set()
        try:
            await asyncio.wait_for(self._all_in.wait(), self.timeout)
        except TimeoutError:
            pass  # fewer ran at once: the count says how many
        self.now -= 1
        return result


def _server(address: str, in_flight: InFlight | None = None) -> SimpleNamespace:
    async def call(result):
        return await in_flight(result) if in_flight is not None else result

    return SimpleNamespace(
        address=address,
        aprobe=lambda seqs, k, adapter: call(([[-1.0, -1.0, -1.0]], [[dict(p) for p in TOPK[0]]] if k else None)),
    )


def _sync(monkeypatch, servers, unhealthy=(), probe_topk: int = 2) -> sync_mod.WeightSync:
    """A one-rank WeightSync whose servers score the probe like the trainer."""
    sync = sync_mod.WeightSync.__new__(sync_mod.WeightSync)
    sync.config = WeightUpdateConfig(probe_topk=probe_topk)
    sync.probe, sync.engine = PROBE, None
    sync.server_set = ServerSet.of([s.address for s in servers])
    for address in unhealthy:
        sync.server_set.mark_unhealthy(address, "failed the update")
    order = [s.address for s in servers]
    sync.plan = UpdatePlan(order, [a for a in order if a not in unhealthy], [])
    connected = [s for s in servers if s.address not in unhealthy]
    sync.bridge = SimpleNamespace(is_driver=True, servers=connected, broadcast_object=lambda obj: obj)
    ours = torch.tensor([[list(p.values()) for p in TOPK[0]] + [[0.0, 0.0]]])  # [1, 4, 2]: one server's

    def trainer_probe_scores(engine, seqs, ids):
        return [[-1.0, -1.0, -1.0]], None if ids is None else ours.repeat(1, 1, len(connected))

    monkeypatch.setattr(sync_mod, "trainer_probe_scores", trainer_probe_scores)
    return sync


def test_every_server_scores_the_probe_at_once(monkeypatch):
    in_flight = InFlight(N)
    sync = _sync(monkeypatch, [_server(f"10.0.0.{i}:8000", in_flight) for i in range(N)], probe_topk=0)
    stats = sync.check_consistency()
    assert in_flight.most == N, f"{in_flight.most} of {N} servers scored the probe at once"
    assert stats["logprob_diff_max"] == 0.0 and f"server{N - 1}/logprob_diff_max" in stats


def test_every_server_scores_its_top_k_at_once(monkeypatch):
    in_flight = InFlight(N)
    sync = _sync(monkeypatch, [_server(f"10.0.0.{i}:8000", in_flight) for i in range(N)])
    stats = sync.check_consistency()
    assert in_flight.most == N, f"{in_flight.most} of {N} servers scored their top-k at once"
    assert stats["topk_logprob_diff_max"] == pytest.approx(0.0, abs=1e-6) and f"server{N - 1}/topk_kl" in stats


def test_score_all_runs_every_server_at_once_on_the_control_loop_with_no_thread_of_its_own(monkeypatch):
    """The probe asks every server at once, on the control loop: no thread per server (256 fan-out threads
    parsing their replies at once took seconds of the interpreter from the rollout pool's loop)."""
    control_loop()  # started before the count
    started = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self.name) or real_start(self))
    in_flight = InFlight(N)
    futures = sync_mod.score_all([_server(f"h{i}:1") for i in range(N)], lambda s: in_flight(s.address))
    assert [f.result(timeout=30) for f in futures.values()] == [f"h{i}:1" for i in range(N)]
    assert in_flight.most == N
    assert started == [], f"{len(started)} threads started for {N} servers"
    assert sync_mod.score_all([], lambda s: s) == {}


def test_the_updates_fan_outs_start_no_thread_once_the_pool_has_them(monkeypatch):
    """Begin, receive and commit reuse the fan-out's threads: starting a thread per server per phase cost
    ~2 s per phase at 256 servers while the rollout loop kept the interpreter busy."""
    from megarl.bridge.drive import in_threads

    together = threading.Barrier(N, timeout=10)
    calls = {f"h{i}:1": together.wait for i in range(N)}
    in_threads(calls, timeout=30)  # N at once: the pool has N threads
    started = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self.name) or real_start(self))
    assert in_threads(calls, timeout=30) == {}
    assert started == [], f"{len(started)} threads started for {N} servers"


def test_a_servers_figures_keep_its_number_when_another_is_out(monkeypatch):
    """With server 1 out of rotation, server 2's figures are still ``server2/...`` (not ``server1/...``)."""
    servers = [_server(f"10.0.0.{i}:8000") for i in range(3)]
    stats = _sync(monkeypatch, servers, unhealthy={"10.0.0.1:8000"}).check_consistency()
    per_server = sorted({key.split("/")[0] for key in stats if key.startswith("server")})
    assert per_server == ["server0", "server2"]
