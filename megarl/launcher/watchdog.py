"""The hang watchdog: names a stalled process, with what it waits for, and writes every stack.

The launcher calls :meth:`Watchdog.check` from its watch loop. It reads the heartbeats of
``{run_dir}/heartbeat/`` (:mod:`megarl.utils.heartbeat`) and finds a process that is

* **overdue**: in one phase longer than its budget (``watchdog.budget_s`` until the phase has a
  median, then ``median_factor`` x its median, within ``[min_budget_s, budget_s]``), or
* **silent**: its heartbeat not refreshed for ``silent_s`` (dead, or stuck holding the GIL).

Then it prints one line naming the process(es), the phase, how long and what they wait for
(the detail their heartbeat carries: the rollout pool's outstanding requests by server and
task, the reward calls still running; for ranks, which ranks are elsewhere: those a collective
waits for), appends the event to ``{run_dir}/watchdog.jsonl``, asks every process for its Python
stacks (``SIGUSR1``: ``{run_dir}/stacks/{name}.txt``; ``py-spy dump`` beside them when py-spy is
installed), and returns the event so that the launcher can warn, abort or restart.
A phase is reported once; it is reported again only once it has ended and overruns anew.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megarl.config.run import WatchdogConfig
from megarl.utils.heartbeat import HEARTBEAT_DIR, STACKS_DIR

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

    def line(self) -> str:
        what = "has not sent a heartbeat" if self.kind == "silent" else f"in phase {self.phase!r}"
        line = (f"megarl watchdog: {', '.join(self.names)} {what} for {self.seconds:.0f} s "
                f"(budget {self.budget_s:.0f} s)")  # fmt: skip
        if self.waits_for:
            line += f"; waiting on {self.waits_for}"
        if self.others:
            line += f"; elsewhere: {self.others}"
        return line + f"; stacks in {STACKS_DIR}/"


class Watchdog:
    """Watches the heartbeats of one run directory (see the module doc)."""

    def __init__(self, run_dir: str | Path, config: WatchdogConfig):
        self.run_dir, self.config = Path(run_dir), config
        self._reported: set[tuple[str, str, float]] = set()  # (name, phase, since)

    def reset(self) -> None:
        """Forget the heartbeats and reports of earlier trainer processes (before starting new ones)."""
        shutil.rmtree(self.run_dir / HEARTBEAT_DIR, ignore_errors=True)
        self._reported.clear()

    def budget(self, phase: str, medians: dict[str, float]) -> float:
        """Seconds ``phase`` may take, given the medians of the process's phases so far."""
        cfg = self.config
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
        stalled = [(b, kind) for b, kind in stalled if kind and (b["name"], b["phase"], b["since"]) not in self._reported]
        if not stalled:
            return None
        # the process longest in its phase is the likeliest cause: the others wait for it (a collective)
        stalled.sort(key=lambda item: item[0]["since"])
        first, kind = stalled[0]
        group = [b for b, k in stalled if k == kind and b["phase"] == first["phase"]]
        names = {b["name"] for b in group}
        others = "; ".join(f"{b['name']} in {b['phase']!r} for {now - b['since']:.0f} s" for b in beats if b["name"] not in names)
        waits = "; ".join(dict.fromkeys(b["detail"] for b in group if b.get("detail")))
        seconds = now - (first["beat"] if kind == "silent" else first["since"])
        budget = self.config.silent_s if kind == "silent" else self._budget_of(first)
        event = StallEvent(now, kind, sorted(names), first["phase"], seconds, budget, waits, others)
        for b, _ in stalled:  # one report per incident: those waiting on the first are in its line
            self._reported.add((b["name"], b["phase"], b["since"]))
        self._record(event, beats)
        return event

    def _budget_of(self, beat: dict) -> float:
        runs = beat.get("runs", {})
        medians = {k: v for k, v in beat.get("medians", {}).items() if runs.get(k, 0) >= _MIN_RUNS_FOR_MEDIAN}
        return self.budget(beat["phase"], medians)

    def _overdue(self, beat: dict, now: float) -> str | None:
        if now - beat["beat"] > self.config.silent_s:
            return "silent"
        if beat["phase"] != "idle" and now - beat["since"] > self._budget_of(beat):
            return "overdue"
        return None

    def _record(self, event: StallEvent, beats: list[dict]) -> None:
        logger.error(event.line())
        with open(self.run_dir / EVENTS_FILE, "a") as f:
            f.write(json.dumps(asdict(event)) + "\n")
        dump_stacks(self.run_dir, {b["name"]: b["pid"] for b in beats})


def dump_stacks(run_dir: Path, pids: dict[str, int], wait_s: float = 3.0) -> None:
    """Every process's Python stacks into ``{run_dir}/stacks/`` (faulthandler; py-spy's native ones too).

    Waits up to ``wait_s`` for the stacks to be written: an abort may follow at once.
    """
    folder = run_dir / STACKS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    py_spy = shutil.which("py-spy")
    sizes = {}
    for name, pid in pids.items():
        if pid == os.getpid():
            continue  # this process has no stack-dump handler: the signal would end it
        path = folder / f"{name}.txt"
        sizes[path] = path.stat().st_size if path.exists() else 0
        try:
            os.kill(pid, signal.SIGUSR1)  # its heartbeat registered faulthandler on SIGUSR1
        except ProcessLookupError:
            sizes.pop(path)
            continue
        if py_spy is not None:
            with open(folder / f"{name}.py-spy.txt", "w") as out:
                subprocess.run([py_spy, "dump", "--native", "--pid", str(pid)], stdout=out, stderr=subprocess.STDOUT,
                               timeout=60, check=False)  # fmt: skip
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any((p.stat().st_size if p.exists() else 0) <= n for p, n in sizes.items()):
        time.sleep(0.05)
