"""Heartbeats: each trainer rank says what it is doing, so that a stall can be named.

A process with a heartbeat keeps ``{run_dir}/heartbeat/{name}.json`` current::

    {"name": "trainer-1", "pid": 4242, "phase": "train_step", "step": "micro-batch 3 of 8",
     "detail": "...", "collective": {"op": "all_reduce", "ranks": [0, 1], "seq": 17, ...},
     "since": 1732419000.5, "beat": 1732419042.1, "medians": {"rollout": 9.8, "train_step": 7.1},
     "watch": "phase", "signal_stacks": true}

``phase`` is what it does now and ``since`` when that began; ``step`` where it is inside the
phase (a micro-batch, a weight-sync stage; :func:`step`); ``detail`` says what it waits for
(a callback refreshed at every beat: the rollout pool's outstanding requests by server, the
episodes waiting for their reward); ``collective`` the ``torch.distributed`` call it is in, if
any (:mod:`megarl.utils.collectives`); ``beat`` is refreshed every ``interval`` seconds by a
thread, so a process that died or hangs with the GIL held shows as silent; ``medians`` are
the median durations of the phases done so far (``runs``: of how many, up to 20), for the watchdog's budgets
(:mod:`megarl.launcher.watchdog`). ``SIGUSR1`` makes the process write every thread's Python
stack to ``{run_dir}/stacks/{name}.txt`` (``faulthandler``).

Beside the trainer ranks' heartbeats (one per process, :func:`start`; :func:`phase` is a no-op
where none was started), two kinds watch only for silence (``watch: "silence"``): the rollout
pool's, beaten from its event loop (so a workflow or reward that blocks the loop silences it),
and each server's, beaten by the launcher whenever the server answers its health check.

Fault injection (tests only): ``MEGARL_FAULT_STALL=NAME:PHASE:SECONDS`` makes process ``NAME``
sleep ``SECONDS`` on entering ``PHASE``, e.g. ``trainer-1:train_step:600``. With
``MEGARL_FAULT_STALL_PHASE=STALL`` the sleep runs in a phase of its own, ``STALL``, nested in
``PHASE``: a test then gives the hang alone a short budget (``watchdog.phase_budget_s.STALL``) and
every real phase one far beyond what a busy machine takes, so the watchdog cannot fire on healthy work.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import json
import logging
import os
import signal
import socket
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

from megarl.utils.collectives import CollectiveTrace

logger = logging.getLogger(__name__)

FAULT_STALL_ENV = "MEGARL_FAULT_STALL"
FAULT_STALL_ONCE_ENV = "MEGARL_FAULT_STALL_ONCE"
FAULT_STALL_PHASE_ENV = "MEGARL_FAULT_STALL_PHASE"
HEARTBEAT_DIR = "heartbeat"
STACKS_DIR = "stacks"
FLIGHT_RECORDER_DIR = "nccl_trace"  # NCCL's flight recorder dumps, one per rank (CUDA only)
DUMP_REQUEST = "dump-request.json"  # in STACKS_DIR: the watchdog writes it, every rank's beat thread answers
_MEDIAN_WINDOW = 20  # durations kept per phase


class Heartbeat:
    """The heartbeat file of one process, or of one part of it (see the module doc).

    Args:
        watch: ``"phase"``: the watchdog checks the phase's budget and the beats; ``"silence"``: only
            the beats (a part that runs all along: the rollout pool, a server).
        thread: Beat from a thread of its own every ``interval``; False: the owner calls :meth:`beat`.
        stacks: Register ``SIGUSR1`` to write this process's stacks (one heartbeat per process does).
        pid: The process it speaks for (the launcher beats for the servers it health-checks).
        silent_means: What it means when this heartbeat stops, for the watchdog's line.
    """

    def __init__(
        self,
        run_dir: str | Path,
        name: str,
        interval: float = 5.0,
        *,
        watch: str = "phase",
        thread: bool = True,
        stacks: bool = True,
        pid: int | None = None,
        silent_means: str = "",
    ):
        self.run_dir, self.name, self.interval = Path(run_dir), name, interval
        self.watch, self.thread, self.stacks, self.pid = watch, thread, stacks, pid or os.getpid()
        self.silent_means = silent_means
        self.path = self.run_dir / HEARTBEAT_DIR / f"{name}.json"
        self._lock = threading.Lock()
        self._phase, self._since, self._step = "start", time.time(), ""
        self._durations: dict[str, list[float]] = defaultdict(list)
        self._detail_fn: Callable[[], str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stacks = None
        self._phase_entries: dict[str, int] = defaultdict(int)
        self.collectives: CollectiveTrace | None = None
        self._dumped_request = time.time()  # a request older than this process is not for it

    def start(self, trace_collectives: bool = False) -> Heartbeat:
        """Write the first beat and start beating; ``trace_collectives``: record the collective running."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.stacks:
            stacks = self.run_dir / STACKS_DIR / f"{self.name}.txt"
            stacks.parent.mkdir(parents=True, exist_ok=True)
            self._stacks = open(stacks, "a")  # noqa: SIM115 -- faulthandler writes to it until the process ends
            faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True, chain=False)
        if trace_collectives:
            self.collectives = CollectiveTrace().install()
        self._write()
        if self.thread:
            self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{self.name}", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval + 1)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a process that ended is not stalled
        if self._stacks is not None:
            faulthandler.unregister(signal.SIGUSR1)
            self._stacks.close()
        if self.collectives is not None:
            self.collectives.uninstall()

    def set_detail_fn(self, fn: Callable[[], str] | None) -> None:
        """What the process waits for, asked at each beat (e.g. the pool's outstanding requests)."""
        self._detail_fn = fn

    def set_phase(self, name: str) -> None:
        """The current phase of a part that has no nested phases (a pool: "generating", "paused")."""
        with self._lock:
            if name != self._phase:
                self._phase, self._since, self._step = name, time.time(), ""

    def step(self, text: str) -> None:
        """Where the process is inside its phase ("micro-batch 3 of 8", "weight sync: commit"); shown next beat."""
        self._step = text

    def beat(self) -> None:
        """Refresh the beat now (for a heartbeat started with ``thread=False``)."""
        self._write()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark the block as phase ``name``; its duration feeds the phase's median."""
        with self._lock:
            outer = (self._phase, self._since, self._step)
            self._phase, self._since, self._step = name, time.time(), ""
            self._phase_entries[name] += 1
            entry = self._phase_entries[name]
        self._write()
        try:
            if seconds := _injected_stall(self.name, name, entry):
                self._sleep_injected_stall(seconds)
            yield
        finally:
            with self._lock:
                durations = self._durations[name]
                durations.append(time.time() - self._since)
                del durations[:-_MEDIAN_WINDOW]
                top = outer[0] in ("start", "idle")  # between phases: idle from now on
                self._phase, self._since, self._step = ("idle", time.time(), "") if top else outer
            self._write()

    def _sleep_injected_stall(self, seconds: float) -> None:
        """The injected hang: a sleep, in its own phase when ``MEGARL_FAULT_STALL_PHASE`` names one."""
        stall_phase = os.environ.get(FAULT_STALL_PHASE_ENV)
        with self.phase(stall_phase) if stall_phase else contextlib.nullcontext():
            time.sleep(seconds)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            self._write()
            if self.stacks:
                self._answer_dump_request()

    def _answer_dump_request(self) -> None:
        """On a new watchdog request (:func:`request_dumps`): this process's stacks when it is named
        (a process on another host than the watchdog, which cannot signal it), and NCCL's flight
        recorder into ``{run_dir}/nccl_trace/{name}.pkl`` on CUDA.

        Runs in the beat thread: the main thread may be stuck in a collective or a CUDA sync.
        """
        path = self.run_dir / STACKS_DIR / DUMP_REQUEST
        try:
            if path.stat().st_mtime <= self._dumped_request:
                return
            request = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return  # none yet, or being replaced: the next beat reads it
        self._dumped_request = path.stat().st_mtime
        if self.name in request.get("stacks", []) and self._stacks is not None:
            faulthandler.dump_traceback(self._stacks, all_threads=True)
            self._stacks.flush()
        trace = flight_recorder_dump()
        if trace is not None:
            path = self.run_dir / FLIGHT_RECORDER_DIR / f"{self.name}.pkl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(trace)
            logger.warning("NCCL flight recorder written to %s", path)

    def _write(self) -> None:
        detail = ""
        if self._detail_fn is not None:
            try:
                detail = self._detail_fn()
            except Exception as e:  # noqa: BLE001 -- a report must not break what it reports on
                detail = f"(detail unavailable: {e!r})"
        collective = self.collectives.current if self.collectives is not None else None
        with self._lock:
            record = {
                "name": self.name,
                "pid": self.pid,
                "phase": self._phase,
                "step": self._step,
                "detail": detail,
                "collective": collective,
                "since": self._since,
                "beat": time.time(),
                "medians": {k: statistics.median(v) for k, v in self._durations.items() if v},
                "runs": {k: len(v) for k, v in self._durations.items()},
                "watch": self.watch,
                "signal_stacks": self.stacks,
                "silent_means": self.silent_means,
                "host": socket.gethostname(),
            }
        tmp = self.path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)  # a restart's watchdog.reset() removed it
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)
        except OSError as e:  # a full disk: the watchdog then sees a silent process, which it reports
            logger.debug("heartbeat %s not written: %s", self.path, e)


class InFlight:
    """Work this process waits on (requests to a server, reward calls), for its heartbeat's detail.

    ``noun`` names one unit as it reads in :meth:`describe`, e.g. ``"request(s) outstanding"``.
    """

    def __init__(self, noun: str):
        self.noun = noun
        self._items: dict[int, tuple[str, int, float]] = {}  # id -> (label, task id, start)
        self._ids = itertools.count()

    @contextlib.contextmanager
    def track(self, label: str, task_id: int) -> Iterator[None]:
        """The block is one unit of work for ``label`` (a server, a reward function) of episode ``task_id``."""
        key = next(self._ids)
        self._items[key] = (label, task_id, time.monotonic())
        try:
            yield
        finally:
            del self._items[key]

    def describe(self) -> str:
        """By label, oldest first: how many, how old the oldest, and their tasks; "" when there is none."""
        by_label: dict[str, list[tuple[float, int]]] = defaultdict(list)
        for label, task, start in list(self._items.values()):
            by_label[label].append((start, task))
        now, parts = time.monotonic(), []
        for label, items in sorted(by_label.items(), key=lambda item: min(item[1])):
            items.sort()
            tasks = ", ".join(str(task) for _, task in items[:8])
            parts.append(f"{label}: {len(items)} {self.noun}, the oldest {now - items[0][0]:.0f} s (tasks {tasks})")
        return "; ".join(parts)


def request_dumps(run_dir: str | Path, stacks: list[str]) -> None:
    """Ask every heartbeat's process for NCCL's flight recorder, and those named in ``stacks`` for
    their Python stacks (answered within one beat, :meth:`Heartbeat._answer_dump_request`)."""
    path = Path(run_dir) / STACKS_DIR / DUMP_REQUEST
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"time": time.time(), "stacks": sorted(stacks)}))
    os.replace(tmp, path)


def flight_recorder_env(run_dir: str | Path, entries: int = 2000) -> dict[str, str]:
    """The environment that turns on NCCL's flight recorder in a CUDA trainer rank.

    The last ``entries`` collectives of every NCCL group are kept; torch dumps them on its own NCCL
    timeout, and the watchdog asks for a dump when it reports (:meth:`Heartbeat._answer_dump_request`).
    Both spellings: torch renamed the variables (``TORCH_NCCL_*`` -> ``TORCH_FR_*``) in 2.7.
    """
    prefix = str(Path(run_dir) / FLIGHT_RECORDER_DIR / "rank_")
    return {
        "TORCH_FR_BUFFER_SIZE": str(entries),
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(entries),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }


def flight_recorder_dump() -> bytes | None:
    """This process's NCCL flight recorder (pickled, torch's format), or None off NCCL."""
    import torch
    import torch.distributed as dist

    if not (torch.cuda.is_available() and dist.is_available() and dist.is_initialized()):
        return None
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if dump is None:
        return None
    try:
        return dump(True, True, False)  # collectives, their stack traces, not only the active ones
    except RuntimeError as e:  # recorder off (no buffer size), or no NCCL group in this process
        logger.warning("no NCCL flight recorder dump: %s", e)
        return None


def _injected_stall(process: str, phase: str, entry: int) -> float:
    """Seconds ``MEGARL_FAULT_STALL`` makes this entry into ``phase`` hang (0: none)."""
    spec = os.environ.get(FAULT_STALL_ENV, "")
    if not spec:
        return 0.0
    parts = spec.rsplit(":", 2)
    if len(parts) != 3 or not parts[2].replace(".", "", 1).isdigit():
        raise ValueError(f"{FAULT_STALL_ENV}={spec!r}: expected NAME:PHASE[#N]:SECONDS, e.g. trainer-1:train_step:600")
    name, wanted, seconds = parts
    wanted, _, nth = wanted.partition("#")
    if (name, wanted) != (process, phase) or (nth and int(nth) != entry):
        return 0.0
    once = os.environ.get(FAULT_STALL_ONCE_ENV)
    if once:
        if os.path.exists(once):
            return 0.0
        Path(once).touch()
    logger.warning("%s=%s: %s sleeps %s s in phase %s", FAULT_STALL_ENV, spec, process, seconds, phase)
    return float(seconds)


_CURRENT: Heartbeat | None = None


def start(run_dir: str | Path, name: str, interval: float = 5.0, trace_collectives: bool = False) -> Heartbeat:
    """Start this process's heartbeat (once); ``trace_collectives``: name the collective a rank is in."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = Heartbeat(run_dir, name, interval).start(trace_collectives)
    return _CURRENT


def stop() -> None:
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.close()
        _CURRENT = None


def phase(name: str) -> contextlib.AbstractContextManager:
    """The current heartbeat's :meth:`Heartbeat.phase`, or a no-op."""
    return _CURRENT.phase(name) if _CURRENT is not None else contextlib.nullcontext()


def step(text: str) -> None:
    """The current heartbeat's :meth:`Heartbeat.step`, or nothing."""
    if _CURRENT is not None:
        _CURRENT.step(text)


def current() -> Heartbeat | None:
    """This process's heartbeat, if one was started (the rollout pool starts its own beside it)."""
    return _CURRENT


def set_detail_fn(fn: Callable[[], str] | None) -> None:
    if _CURRENT is not None:
        _CURRENT.set_detail_fn(fn)
