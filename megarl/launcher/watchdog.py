"""The hang watchdog: names a stalled process, with what it waits for, and writes every stack.

The launcher calls :meth:`Watchdog.check` from its watch loop. It reads the heartbeats of
``{run_dir}/heartbeat/`` (:mod:`megarl.utils.heartbeat`) and finds a process that is

* **overdue**: in one phase longer than its budget (``watchdog.budget_s`` until the phase has a
  median, then ``median_factor`` x its median, within ``[min_budget_s, budget_s]``), or
* **silent**: its heartbeat not refreshed for ``silent_s`` (dead, or stuck holding the GIL; for
  the rollout pool, its event loop blocked; for a server, not answering its health check).
  Parts that run all along (``watch: "silence"``: the pool, the servers) are only checked for this.

A rank waiting in a collective for a rank of its group that is still at work outside it is not
the cause: the one it waits for is named when its own phase runs over (whichever entered its
phase first). A rank waiting for one that is idle, silent, gone or in another call is named itself.

Then it prints one line naming the process(es), the phase (and the step inside it: the
micro-batch, the weight-sync stage), how long and what they wait for (the detail their heartbeat
carries: the rollout pool's outstanding requests by server and task, the reward calls still
running; for ranks in a collective, the call and the ranks of its group that have not arrived,
with where those are), appends the event to ``{run_dir}/watchdog.jsonl``, asks every process for its Python
stacks (``SIGUSR1``: ``{run_dir}/stacks/{name}.txt``; ``py-spy dump`` beside them when py-spy is
installed) and, on CUDA, every rank for NCCL's flight recorder (``{run_dir}/nccl_trace/``), and returns the event so that the launcher can warn, abort or restart.
A phase is reported once; it is reported again only once it has ended and overruns anew.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from megarl.config.run import WatchdogConfig
from megarl.serving.http import http_ok
from megarl.utils.collectives import describe as describe_collective
from megarl.utils.collectives import same_call
from megarl.utils.heartbeat import HEARTBEAT_DIR, STACKS_DIR, Heartbeat, request_dumps

logger = logging.getLogger(__name__)

_MIN_RUNS_FOR_MEDIAN = 3  # heartbeats keep medians of every phase; a budget uses one of 3+ runs
EVENTS_FILE = "watchdog.jsonl"


@dataclass
class StallEvent:
    """One report: who stalls, in what phase, for how long, and what they wait for."""

    time: float
    kind: str  # "overdue" or "silent"
    names: list[str]
    phase: str
    seconds: float
    budget_s: float
    waits_for: str
    others: str
    step: str = ""
    collectives: str = ""

    def line(self) -> str:
        what = "has not sent a heartbeat" if self.kind == "silent" else f"in phase {self.phase!r}"
        if self.step and self.kind != "silent":
            what += f" ({self.step})"
        line = (
            f"megarl watchdog: {', '.join(self.names)} {what} for {self.seconds:.0f} s (budget {self.budget_s:.0f} s)"
        )
        if self.collectives:
            line += f"; {self.collectives}"
        if self.waits_for:
            line += f"; {self.waits_for}" if self.kind == "silent" else f"; waiting on {self.waits_for}"
        if self.others:
            line += f"; elsewhere: {self.others}"
        return line + f"; stacks in {STACKS_DIR}/"


class Watchdog:
    """Watches the heartbeats of one run directory (see the module doc)."""

    def __init__(self, run_dir: str | Path, config: WatchdogConfig, host: str | None = None):
        self.run_dir, self.config = Path(run_dir), config
        self.host = host or socket.gethostname()  # processes elsewhere are asked for their stacks by file
        self._reported: set[tuple[str, str, float]] = set()  # (name, phase, since)

    def reset(self) -> None:
        """Forget the heartbeats and reports of earlier trainer processes (before starting new ones)."""
        shutil.rmtree(self.run_dir / HEARTBEAT_DIR, ignore_errors=True)
        self._reported.clear()

    def budget(self, phase: str, medians: dict[str, float]) -> float:
        """Seconds ``phase`` may take, given the medians of the process's phases so far."""
        cfg = self.config
        if phase in cfg.phase_budget_s:
            return cfg.phase_budget_s[phase]
        median = medians.get(phase)
        if median is None:
            return cfg.budget_s
        return min(cfg.budget_s, max(cfg.min_budget_s, cfg.median_factor * median))

    def heartbeats(self) -> list[dict]:
        beats = []
        for path in sorted((self.run_dir / HEARTBEAT_DIR).glob("*.json")):
            try:
                beats.append(json.loads(path.read_text()))
            except (OSError, json.JSONDecodeError):
                continue  # being replaced right now: the next check reads it
        return beats

    def check(self, now: float | None = None) -> StallEvent | None:
        """The new stall, if there is one (reported, logged and stacks requested), else None."""
        now = time.time() if now is None else now
        beats = self.heartbeats()
        stalled = [(b, self._overdue(b, now)) for b in beats]
        stalled = [(b, kind) for b, kind in stalled if kind and _key(b) not in self._reported]
        by_name = {b["name"]: b for b in beats}
        # a rank waiting in a collective for one still at work (or already reported) is not the cause
        stalled = [(b, kind) for b, kind in stalled if kind == "silent" or not self._waits_on_peer(b, by_name)]
        if not stalled:
            return None
        # the process longest in its phase is the likeliest cause: the others wait for it (a collective)
        stalled.sort(key=lambda item: item[0]["since"])
        first, kind = stalled[0]
        group = [b for b, k in stalled if k == kind and b["phase"] == first["phase"]]
        names = {b["name"] for b in group}
        others = "; ".join(
            f"{b['name']} in {b['phase']!r} for {now - b['since']:.0f} s" for b in beats if b["name"] not in names
        )
        waits = "; ".join(dict.fromkeys(b["detail"] for b in group if b.get("detail")))
        if kind == "silent":  # what the last beat said, and what silence means for this kind of process
            waits = "; ".join(x for x in (first.get("silent_means", ""), waits and f"last beat: {waits}") if x)
        seconds = now - (first["beat"] if kind == "silent" else first["since"])
        budget = self.config.silent_s if kind == "silent" else self._budget_of(first)
        event = StallEvent(
            now,
            kind,
            sorted(names),
            first["phase"],
            seconds,
            budget,
            waits,
            others,
            first.get("step", ""),
            collective_waits(beats, now),
        )
        for b, _ in stalled:  # one report per incident: those waiting on the first are in its line
            self._reported.add(_key(b))
        self._record(event, beats)
        return event

    def _waits_on_peer(self, beat: dict, by_name: dict[str, dict]) -> bool:
        """Whether ``beat``'s rank waits in a collective for a rank of its group that has not arrived
        because it is still at work outside any collective (it is named when its own phase runs over)
        or was reported already. A peer that is idle, silent, gone or in another collective is not
        waited on: the waiting rank is the one to name."""
        collective = beat.get("collective")
        if not collective:
            return False
        for rank in collective["ranks"]:
            peer = by_name.get(f"trainer-{rank}")
            if peer is None or same_call(collective, peer.get("collective")):
                continue
            if _key(peer) in self._reported:
                return True
            at_work = peer["phase"] != "idle" and peer.get("watch", "phase") == "phase"
            if at_work and not peer.get("collective"):
                return True
        return False

    def _budget_of(self, beat: dict) -> float:
        runs = beat.get("runs", {})
        medians = {k: v for k, v in beat.get("medians", {}).items() if runs.get(k, 0) >= _MIN_RUNS_FOR_MEDIAN}
        return self.budget(beat["phase"], medians)

    def _overdue(self, beat: dict, now: float) -> str | None:
        if now - beat["beat"] > self.config.silent_s:
            return "silent"
        if beat.get("watch", "phase") == "silence":
            return None
        if beat["phase"] != "idle" and now - beat["since"] > self._budget_of(beat):
            return "overdue"
        return None

    def _record(self, event: StallEvent, beats: list[dict]) -> None:
        logger.error(event.line())
        with open(self.run_dir / EVENTS_FILE, "a") as f:
            f.write(json.dumps({**asdict(event), "line": event.line()}) + "\n")
        # a process here is signalled (faulthandler on SIGUSR1 answers even with the GIL held); one on
        # another host (a Slurm job's ranks) writes its stacks from its beat thread on request
        here = [b for b in beats if b.get("host", self.host) == self.host]
        remote = [b["name"] for b in beats if b.get("host", self.host) != self.host and b.get("signal_stacks", True)]
        request_dumps(self.run_dir, remote)  # CUDA ranks also answer with NCCL's flight recorder
        signalled = {b["pid"] for b in here if b.get("signal_stacks", True)}
        owners: dict[int, str] = {}  # the pool beats inside trainer-0's process: its stacks are trainer-0's
        for beat in sorted(here, key=lambda b: b["pid"] not in signalled or not b.get("signal_stacks", True)):
            owners.setdefault(beat["pid"], beat["name"])
        dump_stacks(self.run_dir, {name: pid for pid, name in owners.items()}, signalled)


@dataclass
class HealthTarget:
    """A server the launcher health-checks and beats for: ``server-{i}`` at ``address``."""

    name: str
    address: str
    health_endpoint: str = "/health"
    pid: int | None = None  # None: on another host (a Slurm job's server step), no stacks from here
    log: str = ""

    @classmethod
    def of(cls, server) -> HealthTarget:
        """Of a local :class:`~megarl.serving.launch.InferenceServer`."""
        return cls(server.name, server.address, server.spec.health_endpoint, server.pid, str(server.log_path))

    def healthy(self, timeout: float) -> bool:
        return http_ok(self.address, self.health_endpoint, timeout)


def job_servers(addresses: list[str], health_endpoint: str) -> list[HealthTarget]:
    """The servers of a job, ``server-{i}`` at the i-th of ``addresses`` (``$MEGARL_LLM_SERVER_ADDRS``,
    in slot order: the sbatch script's slot i, ``servers/{i}.addr``)."""
    return [HealthTarget(f"server-{i}", address, health_endpoint) for i, address in enumerate(addresses)]


class ServerBeats:
    """The servers' heartbeats: ``server-{i}`` beats whenever that server answers its health check.

    A thread probes every server each ``interval`` seconds, all at once (``timeout`` per probe: a round
    takes one timeout however many servers hang, so a healthy server is never late for its beat
    because others are); a server that stops answering (hung, overloaded, its host gone) goes silent and the watchdog names it with
    its address and log. Its stacks come from py-spy only (a server has no ``SIGUSR1`` handler).
    """

    def __init__(self, run_dir: str | Path, servers: list[HealthTarget], interval: float, timeout: float = 5.0):
        self.servers, self.interval, self.timeout = servers, interval, min(timeout, interval)
        self.beats = [
            Heartbeat(
                run_dir,
                server.name,
                interval,
                watch="silence",
                thread=False,
                stacks=False,
                pid=server.pid or 0,
                silent_means=_silent_server(server),
            )
            for server in servers
        ]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megarl-server-beats", daemon=True)

    def __enter__(self) -> ServerBeats:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(self.timeout + self.interval + 1.0)
        for beat in self.beats:
            beat.close()

    def _run(self) -> None:
        with ThreadPoolExecutor(max(1, len(self.servers)), thread_name_prefix="megarl-server-probe") as probes:
            while True:
                answered = list(probes.map(lambda server: server.healthy(timeout=self.timeout), self.servers))
                for server, beat, ok in zip(self.servers, self.beats, answered):
                    if ok:
                        beat.set_detail_fn(lambda server=server: f"serving at {server.address}")
                        beat.set_phase("serving")
                        beat.beat()
                if self._stop.wait(self.interval):
                    return


def _silent_server(server: HealthTarget) -> str:
    log = f"; its log: {server.log}" if server.log else ""
    return f"{server.address} does not answer its health check ({server.health_endpoint}){log}"


def _key(beat: dict) -> tuple[str, str, float]:
    """One phase of one process: reported once."""
    return beat["name"], beat["phase"], beat["since"]


def collective_waits(beats: list[dict], now: float) -> str:
    """Each collective call that ranks wait in, and the ranks of its group that have not arrived.

    ``"trainer-0, trainer-2 wait in all_reduce #17 (gloo, ranks 0,1,2) for 12 s; not arrived: trainer-1
    (in phase 'compute' for 13 s)"``; "" when no rank is in a collective.
    """
    by_name = {b["name"]: b for b in beats}
    calls: dict[str, list[dict]] = {}
    for beat in beats:
        if beat.get("collective"):
            calls.setdefault(describe_collective(beat["collective"]), []).append(beat)
    parts = []
    for call, waiting in calls.items():
        collective = waiting[0]["collective"]
        names = ", ".join(b["name"] for b in waiting)
        text = f"{names} wait in {call} for {now - min(b['collective']['since'] for b in waiting):.0f} s"
        missing = [
            _where(f"trainer-{rank}", by_name, now)
            for rank in collective["ranks"]
            if not same_call(collective, by_name.get(f"trainer-{rank}", {}).get("collective"))
        ]
        parts.append(text + (f"; not arrived: {', '.join(missing)}" if missing else ""))
    return "; ".join(parts)


def _where(name: str, by_name: dict[str, dict], now: float) -> str:
    beat = by_name.get(name)
    if beat is None:
        return f"{name} (no heartbeat)"
    where = f"in phase {beat['phase']!r}" + (f" ({beat['step']})" if beat.get("step") else "")
    if beat.get("collective"):
        where += f", in {describe_collective(beat['collective'])}"
    return f"{name} ({where} for {now - beat['since']:.0f} s)"


def dump_stacks(run_dir: Path, pids: dict[str, int], signalled: set[int] | None = None, wait_s: float = 3.0) -> None:
    """Every process's Python stacks into ``{run_dir}/stacks/`` (faulthandler; py-spy's native ones too).

    ``signalled``: the pids that registered faulthandler on ``SIGUSR1`` (default: all); the others
    (a server the launcher beats for) only get py-spy's dump. Waits up to ``wait_s`` for the stacks
    to be written: an abort may follow at once.
    """
    folder = run_dir / STACKS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    py_spy = shutil.which("py-spy")
    signalled = set(pids.values()) if signalled is None else signalled
    sizes = {}
    for name, pid in pids.items():
        if pid == os.getpid() or not pid:
            continue  # this process has no stack-dump handler: the signal would end it; 0: not on this host
        path = folder / f"{name}.txt"
        if pid in signalled:
            sizes[path] = path.stat().st_size if path.exists() else 0
            try:
                os.kill(pid, signal.SIGUSR1)  # its heartbeat registered faulthandler on SIGUSR1
            except ProcessLookupError:
                sizes.pop(path)
                continue
        if py_spy is not None:
            with open(folder / f"{name}.py-spy.txt", "w") as out:
                subprocess.run(
                    [py_spy, "dump", "--native", "--pid", str(pid)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=60,
                    check=False,
                )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any((p.stat().st_size if p.exists() else 0) <= n for p, n in sizes.items()):
        time.sleep(0.05)


STOPPED_MARK = "watchdog.stopped"  # in the run directory: the watchdog stopped the trainer; holds the action
_JOB_POLL_S = 1.0


def watch_job(config, trainer_pid: int, servers: list[HealthTarget]) -> int:
    """The watchdog beside a Slurm job's trainer step (``megarl watchdog``, started by the sbatch script).

    Beats for the servers, prints each stall's line to the job's output and, under ``abort`` or
    ``restart``, stops the trainer step (SIGTERM to its ``srun``) and writes ``{run_dir}/watchdog.stopped``
    (the action) so that the script exits 3, or requeues the job for ``restart``. Returns when the
    trainer step ends: 0, or 3 when it stopped it.
    """
    watchdog = Watchdog(config.run_dir, config.watchdog)
    action = config.watchdog.action
    with ServerBeats(config.run_dir, servers, config.watchdog.interval_s):
        while _alive(trainer_pid):
            event = watchdog.check()
            if event is not None:  # its line is logged to the job's output by Watchdog.check
                if action != "warn":
                    (config.run_dir / STOPPED_MARK).write_text(action)
                    print(f"megarl watchdog: stopping the trainer (watchdog.action={action})", flush=True)
                    os.kill(trainer_pid, signal.SIGTERM)
                    return 3
            time.sleep(_JOB_POLL_S)
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
