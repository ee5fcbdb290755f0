"""The hang watchdog with real processes: a rank asleep while the others wait in a collective, a
server that stops answering, a reward that never returns. Each is named, with what it waits for,
within its budget; nothing else is reported; every process's stacks are written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from megarl.config.run import WatchdogConfig
from megarl.launcher.local import WATCHDOG_ABORT_STATUS, _watch
from megarl.launcher.watchdog import HealthTarget, ServerBeats, Watchdog
from megarl.utils.heartbeat import FAULT_STALL_ENV, Heartbeat
from megarl.utils.network import find_free_port
from tests.rollout.conftest import fake_servers  # noqa: F401 -- the fixture

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "launcher" / "stall_worker.py")
BUDGET_S = 4.0


def _config(**overrides) -> WatchdogConfig:
    values = {"budget_s": BUDGET_S, "min_budget_s": 1.0, "silent_s": 30.0, "interval_s": 0.2}
    return WatchdogConfig(**{**values, **overrides})


def _start(run_dir: Path, *args, env=None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen(
        [sys.executable, WORKER, args[0], str(run_dir), *map(str, args[1:])],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _first_event(watchdog: Watchdog, limit_s: float):
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        event = watchdog.check()
        if event is not None:
            return event, time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"nothing reported within {limit_s} s")


def _wait_for_heartbeats(run_dir: Path, names: set[str], limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while {p.stem for p in (run_dir / "heartbeat").glob("*.json")} < names:
        assert time.monotonic() < deadline, f"no heartbeat of {names} within {limit_s} s"
        time.sleep(0.1)


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        os.killpg(proc.pid, 9)
        proc.wait(10)


def _assert_nothing_else(watchdog: Watchdog, seconds: float = 2.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert watchdog.check() is None, "the same stall reported twice"
        time.sleep(0.1)


def test_a_rank_asleep_is_named_and_the_others_wait_in_the_collective(tmp_path):
    port = find_free_port()
    env = {FAULT_STALL_ENV: "trainer-1:compute:600"}
    procs = [_start(tmp_path, "collective", rank, 3, port, env=env) for rank in range(3)]
    try:
        _wait_for_heartbeats(tmp_path, {"trainer-0", "trainer-1", "trainer-2"})
        watchdog = Watchdog(tmp_path, _config())
        event, after = _first_event(watchdog, 3 * BUDGET_S)
        assert event.names == ["trainer-1"] and event.phase == "compute" and event.kind == "overdue", event
        assert "trainer-0 in 'sync'" in event.others and "trainer-2 in 'sync'" in event.others, event
        assert BUDGET_S <= event.seconds < BUDGET_S + 2, "named within its budget"
        assert "trainer-1" in event.line() and "compute" in event.line()
        # the collective the others wait in, and who has not arrived
        assert "trainer-0, trainer-2 wait in all_reduce #" in event.collectives, event
        assert "(gloo, ranks 0,1,2)" in event.collectives, event
        assert "not arrived: trainer-1 (in phase 'compute' for" in event.collectives, event
        assert event.collectives in event.line()
        _assert_nothing_else(watchdog)
        time.sleep(1.0)  # faulthandler writes the stacks on SIGUSR1
        waiting = (tmp_path / "stacks" / "trainer-0.txt").read_text()
        assert "all_reduce" in waiting, waiting[-2000:]
        assert "_injected_stall" in (tmp_path / "stacks" / "trainer-1.txt").read_text()
        logged = [json.loads(line) for line in (tmp_path / "watchdog.jsonl").read_text().splitlines()]
        assert len(logged) == 1 and logged[0]["names"] == ["trainer-1"]
    finally:
        _stop(*procs)


def test_ranks_on_another_host_write_their_stacks_on_request(tmp_path):
    """A watchdog on another host (a Slurm job's batch host) cannot signal the ranks: their beat threads
    answer its dump request with their stacks."""
    port = find_free_port()
    procs = [
        _start(tmp_path, "collective", rank, 2, port, env={FAULT_STALL_ENV: "trainer-1:compute:600"})
        for rank in range(2)
    ]
    try:
        _wait_for_heartbeats(tmp_path, {"trainer-0", "trainer-1"})
        watchdog = Watchdog(tmp_path, _config(), host="batch-host")
        event, _ = _first_event(watchdog, 3 * BUDGET_S)
        assert event.names == ["trainer-1"], event
        request = json.loads((tmp_path / "stacks" / "dump-request.json").read_text())
        assert request["stacks"] == ["trainer-0", "trainer-1"], request
        deadline = time.monotonic() + 5
        while not all((tmp_path / "stacks" / f"trainer-{r}.txt").stat().st_size for r in range(2)):
            assert time.monotonic() < deadline, "no stacks written within a few beats"
            time.sleep(0.1)
        assert "_injected_stall" in (tmp_path / "stacks" / "trainer-1.txt").read_text()
        assert "all_reduce" in (tmp_path / "stacks" / "trainer-0.txt").read_text()
    finally:
        _stop(*procs)


def test_a_server_that_stops_answering_is_named_with_its_requests(tmp_path, fake_servers):
    (server,) = fake_servers(1)
    body = json.dumps({"faults": ["hang"]}).encode()
    urllib.request.urlopen(urllib.request.Request(f"http://{server.address}/_faults", data=body, method="POST"))
    proc = _start(tmp_path, "server", server.address)
    try:
        _wait_for_heartbeats(tmp_path, {"trainer-0"})
        watchdog = Watchdog(tmp_path, _config())
        event, _ = _first_event(watchdog, 3 * BUDGET_S + 30)
        assert event.names == ["trainer-0"] and event.phase == "rollout", event
        assert f"{server.address}: 1 request(s) outstanding, the oldest" in event.waits_for, event
        assert event.seconds < BUDGET_S + 2
        _assert_nothing_else(watchdog)
    finally:
        _stop(proc)


def test_a_server_that_stops_answering_its_health_check_is_named(tmp_path, fake_servers):
    """A hung server process (SIGSTOP): its heartbeat, beaten by the launcher's health checks, goes silent."""
    hung, healthy = fake_servers(2)
    hung.name, healthy.name = "server-0", "server-1"  # as the launcher names them
    with ServerBeats(tmp_path, [HealthTarget.of(hung), HealthTarget.of(healthy)], interval=0.2, timeout=0.5):
        _wait_for_heartbeats(tmp_path, {hung.name, healthy.name})
        os.kill(hung.pid, signal.SIGSTOP)  # the server, not its keeper
        try:
            watchdog = Watchdog(tmp_path, _config(silent_s=2.0))
            event, _ = _first_event(watchdog, 15)
            assert event.kind == "silent" and event.names == [hung.name], event
            assert f"{hung.address} does not answer its health check (/health)" in event.line(), event
            assert f"last beat: serving at {hung.address}" in event.line(), event
            _assert_nothing_else(watchdog)  # the healthy one keeps beating
        finally:
            os.kill(hung.pid, signal.SIGCONT)
    assert not list((tmp_path / "heartbeat").glob("*.json")), "the beats end with the run"


def test_a_reward_that_never_returns_is_named(tmp_path):
    proc = _start(tmp_path, "reward")
    try:
        _wait_for_heartbeats(tmp_path, {"trainer-0"})
        watchdog = Watchdog(tmp_path, _config())
        event, _ = _first_event(watchdog, 3 * BUDGET_S + 30)
        assert event.phase == "rollout" and "1 reward call(s) running" in event.waits_for, event
        assert "never_returns" in event.waits_for, event
        _assert_nothing_else(watchdog)
    finally:
        _stop(proc)


def test_a_workflow_that_blocks_the_event_loop_silences_the_pool(tmp_path, fake_servers):
    """A synchronous call that never returns inside a workflow: the pool's own heartbeat goes silent."""
    (server,) = fake_servers(1)
    proc = _start(tmp_path, "blocked_loop", server.address)
    try:
        _wait_for_heartbeats(tmp_path, {"trainer-0", "rollout-0"})
        watchdog = Watchdog(tmp_path, _config(silent_s=1.5))
        event, after = _first_event(watchdog, 20)
        assert event.kind == "silent" and event.names == ["rollout-0"], event
        assert "its event loop is blocked" in event.waits_for and "last beat: " in event.waits_for, event
        assert "trainer-0 in 'rollout'" in event.others, event
        assert "rollout-0 has not sent a heartbeat" in event.line()
        time.sleep(1.0)
        stacks = (tmp_path / "stacks" / "trainer-0.txt").read_text()  # the pool runs in trainer-0's process
        assert "arun_episode" in stacks, stacks[-2000:]
    finally:
        _stop(proc)


def test_a_running_pool_is_not_reported(tmp_path, fake_servers):
    """The pool's heartbeat is checked for silence only: a pool generating for longer than any budget is fine."""
    beat = Heartbeat(tmp_path, "rollout-0", interval=0.1, watch="silence", thread=True, stacks=False).start()
    try:
        beat.set_phase("generating")
        time.sleep(0.5)
        assert Watchdog(tmp_path, _config(budget_s=0.2, min_budget_s=0.1)).check() is None
    finally:
        beat.close()


def test_budgets_follow_the_medians():
    watchdog = Watchdog(Path("."), WatchdogConfig(budget_s=1000, median_factor=5, min_budget_s=60))
    assert watchdog.budget("train_step", {}) == 1000  # no median yet
    assert watchdog.budget("train_step", {"train_step": 30}) == 150
    assert watchdog.budget("train_step", {"train_step": 2}) == 60  # never below min_budget_s
    assert watchdog.budget("train_step", {"train_step": 900}) == 1000
    fixed = Watchdog(Path("."), WatchdogConfig(budget_s=1000, phase_budget_s={"build": 3600, "save": 5}))
    assert fixed.budget("build", {}) == 3600 and fixed.budget("save", {"save": 900}) == 5  # fixed, median or not
    assert fixed.budget("train_step", {}) == 1000


def test_a_silent_process_is_reported(tmp_path):
    """A process that died (its heartbeat file stays, no longer refreshed)."""
    proc = _start(tmp_path, "reward")
    _wait_for_heartbeats(tmp_path, {"trainer-0"})
    _stop(proc)
    watchdog = Watchdog(tmp_path, _config(silent_s=0.5))
    time.sleep(0.7)
    event = watchdog.check()
    assert event is not None and event.kind == "silent" and "has not sent a heartbeat" in event.line()


@pytest.mark.parametrize("action", ["abort", "warn"])
def test_abort_stops_the_trainer_warn_keeps_it(tmp_path, action):
    """``_watch`` (the launcher's loop) ends the trainer on a stall under ``abort`` only."""
    beat = Heartbeat(tmp_path, "trainer-0", interval=0.1).start()
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        with beat.phase("train_step"):
            start = time.monotonic()
            code = _watch(trainer, [], None, Watchdog(tmp_path, _config(budget_s=1.0, min_budget_s=0.5, action=action)))
    finally:
        beat.close()
        trainer.kill()
    if action == "abort":
        assert code == WATCHDOG_ABORT_STATUS and time.monotonic() - start < 3
    else:
        assert code == 0 and time.monotonic() - start >= 4, "warn lets the trainer finish"


def test_a_hang_in_its_own_phase_is_named_there_and_healthy_phases_keep_long_budgets(tmp_path):
    """``MEGARL_FAULT_STALL_PHASE``: the planted hang runs in a phase of its own nested in the stalled
    one, so a test gives it alone a short budget (``phase_budget_s``) and every real phase a budget far
    beyond what a busy machine takes: only the hang can fire."""
    from megarl.utils.heartbeat import FAULT_STALL_PHASE_ENV

    port = find_free_port()
    env = {FAULT_STALL_ENV: "trainer-1:compute#3:600", FAULT_STALL_PHASE_ENV: "injected_stall"}
    procs = [_start(tmp_path, "collective", rank, 2, port, env=env) for rank in range(2)]
    try:
        _wait_for_heartbeats(tmp_path, {"trainer-0", "trainer-1"})
        config = _config(budget_s=600.0, min_budget_s=300.0, phase_budget_s={"injected_stall": BUDGET_S})
        event, after = _first_event(Watchdog(tmp_path, config), 6 * BUDGET_S)
        assert event.names == ["trainer-1"] and event.phase == "injected_stall", event
        assert BUDGET_S <= event.seconds < BUDGET_S + 2 and f"(budget {BUDGET_S:g} s)" in event.line(), event
        assert "trainer-0 in 'sync'" in event.others, "the others wait in the collective, within their budgets"
    finally:
        _stop(*procs)


class _BarrierTarget(HealthTarget):
    """A server whose health check answers only once ``barrier``'s parties are all probing at once."""

    def __init__(self, name: str, barrier, seen: list):
        super().__init__(name, f"127.0.0.1:{len(seen)}")
        self._barrier, self._seen = barrier, seen

    def healthy(self, timeout: float) -> bool:
        self._seen.append(self.name)
        try:
            self._barrier.wait(timeout=30)  # every server's probe at once, or a broken barrier
        except threading.BrokenBarrierError:
            return False
        return True


def test_the_servers_are_probed_all_at_once(tmp_path):
    """With many hung servers one round still takes one probe's timeout: 24 probes are in flight together
    (probed one after another, the barrier breaks and no server beats)."""
    barrier, seen = threading.Barrier(24), []
    targets = [_BarrierTarget(f"server-{i}", barrier, seen) for i in range(24)]
    with ServerBeats(tmp_path, targets, interval=60.0, timeout=30.0):
        deadline = time.monotonic() + 60
        while not all(_phase(tmp_path, t.name) == "serving" for t in targets):
            assert time.monotonic() < deadline, f"not every server beat: barrier broken {barrier.broken}"
            time.sleep(0.1)
    assert not barrier.broken and len(seen) >= 24


def _phase(run_dir: Path, name: str) -> str | None:
    try:
        return json.loads((run_dir / "heartbeat" / f"{name}.json").read_text()).get("phase")
    except (OSError, ValueError):
        return None


def _beat(name: str, phase: str, since: float, now: float, collective: dict | None = None) -> dict:
    beat = {"name": name, "phase": phase, "since": since, "beat": now, "collective": collective, "watch": "phase"}
    return {**beat, "host": "another-host"}  # asked for its stacks by file, not signalled


def _write_beats(run_dir: Path, beats: list[dict]) -> None:
    (run_dir / "heartbeat").mkdir(exist_ok=True)
    for beat in beats:
        (run_dir / "heartbeat" / f"{beat['name']}.json").write_text(json.dumps(beat))


@pytest.mark.parametrize("late_by_s", [0.0, 1.5])
def test_the_rank_the_collective_waits_for_is_named_whichever_phase_began_first(tmp_path, late_by_s):
    """A rank that reaches its work after its peer entered the collective (a slow start on a busy host):
    the one in the collective runs over first, yet the one it waits for is named, at its own budget."""
    call = {"op": "all_reduce", "ranks": [0, 1], "seq": 1, "backend": "gloo", "since": 100.0}
    watchdog = Watchdog(tmp_path, _config())
    for now in (104.5, 105.0):  # trainer-0 in sync 4.5 s and 5 s, trainer-1 still within its budget
        _write_beats(
            tmp_path,
            [_beat("trainer-0", "sync", 100.0, now, call), _beat("trainer-1", "compute", 100.0 + late_by_s, now)],
        )
        assert late_by_s == 0 or watchdog.check(now) is None, "the rank waiting in the collective named"
    now = 100.0 + late_by_s + BUDGET_S + 0.5
    _write_beats(
        tmp_path, [_beat("trainer-0", "sync", 100.0, now, call), _beat("trainer-1", "compute", 100.0 + late_by_s, now)]
    )
    event = watchdog.check(now)
    assert event is not None and event.names == ["trainer-1"] and event.phase == "compute", event
    assert "not arrived: trainer-1" in event.collectives, event
    assert watchdog.check(now + 1) is None, "the rank in the collective is part of the same incident"


@pytest.mark.parametrize("peer", ["idle", "other call"])
def test_a_rank_waiting_for_one_that_will_not_come_is_named(tmp_path, peer):
    """Its peer is idle (done, the collective never comes) or in another collective (mismatched calls)."""
    call = {"op": "all_reduce", "ranks": [0, 1], "seq": 1, "backend": "gloo", "since": 100.0}
    other = {"op": "broadcast", "ranks": [0, 1], "seq": 1, "backend": "gloo", "since": 100.0}
    now = 100.0 + BUDGET_S + 0.5
    waiting = _beat("trainer-0", "sync", 100.0, now, call)
    elsewhere = (
        _beat("trainer-1", "idle", 99.0, now) if peer == "idle" else _beat("trainer-1", "sync", 101.0, now, other)
    )
    _write_beats(tmp_path, [waiting, elsewhere])
    event = Watchdog(tmp_path, _config()).check(now)
    assert event is not None and event.names == ["trainer-0"] and event.phase == "sync", event
