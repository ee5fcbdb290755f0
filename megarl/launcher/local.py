"""``megarl run``: every process of an experiment on this one machine.

    megarl run configs/gsm8k_grpo_cpu.yaml actor.optimizer.lr=1e-5

The same steps as the sbatch script of :mod:`megarl.launcher.slurm`, as child processes:

1. check the config (one node, a trainer entry that exists, the devices it places
   processes on) before anything starts, and write the resolved config to
   ``{run_dir}/config.yaml``: the trainer reads it, the servers are built from it;
2. start every inference server of the placement plan (logs in
   ``{run_dir}/logs/server-{i}.log``); one dying before it is healthy, or not healthy
   within its ``startup_timeout``, fails the run at once, quoting the end of its log;
3. meanwhile ``torchrun --standalone`` the trainer with the servers' addresses in
   ``$rollout.server_addrs_env``: it builds its model while the servers start and waits
   for them; with ``recover.mode=auto`` a trainer that fails is restarted (servers stay
   up) up to ``recover.retries`` times;
4. a server dying meanwhile is restarted in its slot (same devices, same address; the
   trainer pushes its current weights to it before it gets requests again), up to
   ``launcher.server_restarts`` times per server and ``launcher.max_server_restarts`` per
   run; past that budget it stops the trainer and fails the run.

Every child's output reaches the console line by line, prefixed ``[server-0]`` or
``[trainer]``; the trainer's also goes to ``{run_dir}/logs/trainer.log``. Whatever
happens (success, failure, Ctrl-C, SIGTERM) every server's and the trainer's whole
process tree is stopped before :func:`run_local` returns.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import IO, TextIO

from megarl.config.experiment import GRPOConfig
from megarl.config.loader import save_config
from megarl.launcher.output import OutputRelay
from megarl.launcher.placement import Placement, plan_placement
from megarl.launcher.serve import server_spec, servers_on_every_core
from megarl.launcher.server_health import POLL_S, ServerRestarts, ServerStartup, check_servers, wait_healthy
from megarl.launcher.watchdog import HealthTarget, ServerBeats, Watchdog
from megarl.serving.launch import InferenceServer, LaunchSpec
from megarl.utils.auth import run_api_key, save_run_key
from megarl.utils.children import Child
from megarl.utils.console import CONSOLE_TTY_ENV, take_stop
from megarl.utils.hardware import auto_dtype
from megarl.utils.heartbeat import flight_recorder_env
from megarl.utils.network import find_free_ports

logger = logging.getLogger(__name__)


_STOP_TIMEOUT_S = 15.0
_HOST = "127.0.0.1"  # one machine: the servers need not be reachable from elsewhere


def check_local(config: GRPOConfig) -> Placement:
    """Where each process of ``config`` goes on this machine; ``ValueError`` if it cannot run here."""
    if config.cluster.n_nodes != 1:
        raise ValueError(
            f"megarl run starts everything on this one machine, but cluster.n_nodes={config.cluster.n_nodes}; "
            "use `megarl slurm` for several nodes"
        )
    entry = config.launcher.trainer_entry
    if entry.endswith(".py"):
        if not Path(entry).is_file():
            raise ValueError(f"launcher.trainer_entry {entry!r} is not a file")
    elif _find_module(entry) is None:
        raise ValueError(f"launcher.trainer_entry {entry!r} is neither a .py file nor an importable module")
    plan = plan_placement(config.allocation, config.cluster.n_nodes, config.cluster.n_gpus_per_node)
    return _on_this_machine(config, plan)


def _on_this_machine(config: GRPOConfig, plan: Placement) -> Placement:
    """``plan`` with its device indexes turned into ids this process may use.

    They index the visible GPUs (``$CUDA_VISIBLE_DEVICES``), or on CPU the cores of this
    process's affinity mask (which servers are bound to), so ``CUDA_VISIBLE_DEVICES=4,5,6,7
    megarl run ...`` or ``taskset -c 8-15 megarl run ...`` keeps the run inside them.
    On CPU the trainer's slots are not bound to cores and stay as they are.
    """
    cuda = config.device == "cuda"
    visible, kind = (_visible_gpus(), "GPUs") if cuda else (sorted(os.sched_getaffinity(0)), "CPU cores")

    def physical(ids: tuple[int, ...]) -> tuple[int, ...]:
        if max(ids, default=-1) >= len(visible):
            raise ValueError(
                f"allocation_mode {config.allocation_mode!r} places a process on device {max(ids)} of "
                f"cluster.n_gpus_per_node={config.cluster.n_gpus_per_node}, but this machine shows {len(visible)} "
                f"{kind} to megarl run ({visible})"
            )
        return tuple(visible[i] for i in ids)

    servers = tuple(replace(slot, devices=physical(slot.devices)) for slot in plan.servers)
    trainer = physical(plan.trainer_devices) if cuda else plan.trainer_devices
    return replace(plan, servers=servers, trainer_devices=trainer)


def _visible_gpus() -> list[int]:
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        import torch

        return list(range(torch.cuda.device_count()))
    try:
        return [int(d) for d in raw.split(",") if d.strip()]
    except ValueError:
        raise ValueError(f"megarl run needs integer GPU ids in CUDA_VISIBLE_DEVICES, got {raw!r}") from None


def _find_module(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def server_specs(config: GRPOConfig, plan: Placement) -> list[LaunchSpec]:
    """One launch spec per server of ``plan``, each on a free port, with ``launcher.env``."""
    if not plan.servers:
        return []
    ports = find_free_ports(len(plan.servers), host=_HOST)
    shared = servers_on_every_core(config)
    specs = []
    for slot, port in zip(plan.servers, ports, strict=True):
        devices = sorted(os.sched_getaffinity(0)) if shared else list(slot.devices)
        spec = server_spec(config, slot.index, devices, _HOST, port)
        spec.env.update(config.launcher.env)
        specs.append(spec)
    return specs


def _startup_timeout(config: GRPOConfig) -> float:
    if config.allocation.inference.backend == "vllm":
        return config.vllm.startup_timeout
    return config.sglang.startup_timeout


@contextmanager
def running_servers(
    config: GRPOConfig, specs: list[LaunchSpec], relay: OutputRelay, wait: bool = True
) -> Iterator[list[InferenceServer]]:
    """Start a server per spec, wait until all are healthy (unless not ``wait``: see
    :class:`ServerStartup`), yield them; stop every tree on exit."""
    log_dir = config.run_dir / "logs"
    servers = [InferenceServer(spec, log_dir / f"server-{i}.log", name=f"server-{i}") for i, spec in enumerate(specs)]
    try:
        for server in servers:
            if relay.verbose:
                relay.follow(server.name, server.log_path)
            server.start()
        if wait:
            wait_healthy(servers, _startup_timeout(config))
        yield servers
    finally:
        relay.close()  # a server's shutdown chatter stays in its log file, off the console
        _stop_all(servers)


def _stop_all(servers: list[InferenceServer]) -> None:
    """Stop every server at once (each may take seconds), a dead one's leftovers too."""
    threads = [threading.Thread(target=s.stop, args=(_STOP_TIMEOUT_S,)) for s in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def trainer_command(config: GRPOConfig, config_file: Path, plan: Placement) -> list[str]:
    """``torchrun`` of the trainer entry on this node.

    ``--standalone`` binds the rendezvous to ``localhost:0``: the OS picks a free port,
    so runs side by side never collide. torchrun's own directory (its ranks' error files) is the run's
    ``logs/torchrun``, not a new ``/tmp/torchelastic_*`` per run.
    """
    entry = config.launcher.trainer_entry
    target = [entry] if entry.endswith(".py") else ["-m", entry]
    return torchrun_command(config, plan.trainer_procs_per_node, [*target, "--config", str(config_file)])


def torchrun_command(config: GRPOConfig, procs: int, target: list[str]) -> list[str]:
    """``torchrun --standalone`` of ``target`` (a script or ``-m module``, and its arguments) on ``procs``
    ranks of this node, its directory under the run (see :func:`trainer_command`)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={procs}",
        f"--log-dir={config.run_dir / 'logs' / 'torchrun'}",
        *target,
    ]


def trainer_env(config: GRPOConfig, plan: Placement, addrs: list[str]) -> dict[str, str]:
    """The trainer's environment: ``launcher.env``, server addresses, its devices or threads."""
    env = {**os.environ, **config.launcher.env, "PYTHONUNBUFFERED": "1"}
    env[config.rollout.server_addrs_env] = ",".join(addrs)
    if config.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, plan.trainer_devices))
        if config.watchdog.enabled:
            env = {**flight_recorder_env(config.run_dir), **env}  # the user's launcher.env wins
    elif "OMP_NUM_THREADS" not in env:
        # Servers are bound to their cores (vllm_launch_spec); ranks share the others (all of them when
        # colocated: the servers sleep while the trainer computes, and it waits while they generate).
        server_cores = 0 if config.allocation.colocated else sum(len(slot.devices) for slot in plan.servers)
        free = len(os.sched_getaffinity(0)) - server_cores
        env["OMP_NUM_THREADS"] = str(max(1, free // max(1, plan.trainer_procs_per_node)))
    return env


def run_trainer(
    config: GRPOConfig,
    config_file: Path,
    plan: Placement,
    servers: list[InferenceServer],
    relay: OutputRelay,
    startup: ServerStartup | None = None,
) -> int:
    """Run the trainer until it succeeds or is out of restarts; returns its exit status.

    ``startup``: the servers are still starting; the watch loop probes them meanwhile.
    Raises :class:`ServerLaunchError` when a server dies meanwhile past the restart budget (the trainer is stopped)
    or is not up in time.
    """
    cmd = trainer_command(config, config_file, plan)
    env = trainer_env(config, plan, [s.address for s in servers])
    env[CONSOLE_TTY_ENV] = "1" if relay.tty else "0"  # the trainer's bar draws for our console
    retries = config.recover.retries if config.recover.mode == "auto" else 0
    log_path = config.run_dir / "logs" / "trainer.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    watchdog = Watchdog(config.run_dir, config.watchdog) if config.watchdog.enabled else None
    targets = [HealthTarget.of(server) for server in servers]
    beats = ServerBeats(config.run_dir, targets, config.watchdog.interval_s) if watchdog is not None else nullcontext()
    restarts = ServerRestarts(
        config.launcher.server_restarts, config.launcher.max_server_restarts, config.run_dir, relay
    )
    take_stop(config.run_dir)  # a note of an earlier run's is not this one's
    with open(log_path, "ab") as log, beats:
        for attempt in range(retries + 1):
            log.write(f"# megarl run: trainer attempt {attempt + 1}: {' '.join(cmd)}\n".encode())
            log.flush()
            if watchdog is not None:
                watchdog.reset()  # the heartbeats of an earlier attempt's ranks are not this one's
            code = _run_trainer_once(cmd, env, servers, relay, log, startup, watchdog, restarts)
            if code == WATCHDOG_ABORT_STATUS and config.watchdog.action == "abort":
                return code
            if code == 0:
                logger.info("trainer finished")
                return 0
            relay.end_line()
            if (reason := take_stop(config.run_dir)) is not None:  # the user's code is broken: a restart would not help
                logger.info("the trainer stopped: %s", reason)
                relay.line(
                    "megarl", f"megarl run: the trainer stopped for the reason above (logs in {log_path.parent})"
                )
                return code
            if attempt < retries:
                logger.warning(
                    "trainer exited with status %d; restarting it (restart %d of %d)", code, attempt + 1, retries
                )
    logger.error("trainer exited with status %d; last lines of %s:\n%s", code, log_path, _tail(log_path))
    return code


_TRACEBACK = "Traceback (most recent call last):"
_TORCHRUN = ("torch/distributed/run.py", "ChildFailedError")
"""What marks torchrun's own report of a failed rank (its traceback, after the rank's)."""
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:")
"""What torch.distributed puts before each line of a rank's uncaught exception."""
_TORCHRUN_LOG = re.compile(r"[EWI]\d{4} \d")
"""torchrun's log lines (``E1125 20:02:41.397000 ... failed (exitcode: 1) ...``)."""


def _tail(path: Path, lines: int = 20) -> str:
    """The end of the trainer's log for the console: its last ``lines`` lines, or, when torchrun's report of
    a failed rank ends it (which says nothing of why), the end of the rank's own traceback before it (its
    ``[rankN]:`` lines where torch marks them: what other processes print meanwhile is left out)."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 256 * 1024))
        text = f.read().decode(errors="replace").splitlines()
    starts = [i for i, line in enumerate(text) if _RANK_PREFIX.sub("", line).strip() == _TRACEBACK]
    blocks = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]
    if not blocks or not any(mark in "\n".join(blocks[-1]) for mark in _TORCHRUN):
        return "\n".join(text[-lines:])
    rank = [b for b in blocks if not any(mark in "\n".join(b) for mark in _TORCHRUN)]
    if not rank:
        return "\n".join(text[-lines:])
    block = rank[-1]
    end = next((i for i, line in enumerate(block) if _TORCHRUN_LOG.match(line)), len(block))
    block = [line for line in block[:end] if _RANK_PREFIX.match(line)] or block[:end]
    return "\n".join([*block[-lines:], "(torchrun's report of the failed rank follows in the log)"])


def _run_trainer_once(
    cmd: list[str],
    env: dict[str, str],
    servers: list[InferenceServer],
    relay: OutputRelay,
    log: IO[bytes],
    startup: ServerStartup | None = None,
    watchdog: Watchdog | None = None,
    restarts: ServerRestarts | None = None,
) -> int:
    logger.info("starting trainer: %s", " ".join(cmd))
    # not verbose: the ranks write their own output to the log and only their console lines
    # to stdout; torchrun's own messages (stderr) go to the log
    proc = Child(  # torchrun and its ranks end with this process however it dies
        cmd,
        env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if relay.verbose else log,
        stdin=subprocess.DEVNULL,
    )
    pump = relay.pipe("trainer", proc.stdout, log) if relay.verbose else relay.console("trainer", proc.stdout, log)
    try:
        code = _watch(proc, servers, startup, watchdog, relay, restarts)
    finally:
        proc.stop(_STOP_TIMEOUT_S, whole_tree=True)
        pump.join(5.0)
        if pump.is_alive():  # closing would block on the reader's lock
            logger.warning("the trainer's output pipe is still open: some process outside its tree holds it")
        else:
            proc.stdout.close()
    if code != 0:
        check_servers(servers, "while the trainer ran")  # it likely failed for that: name the server
    return code if code >= 0 else 128 - code  # killed by signal N: the shell's 128 + N


def _watch(
    proc: subprocess.Popen,
    servers: list[InferenceServer],
    startup: ServerStartup | None,
    watchdog: Watchdog | None = None,
    relay: OutputRelay | None = None,
    restarts: ServerRestarts | None = None,
) -> int:
    """Until the trainer exits: the servers' start-up and health (a dead one restarted within ``restarts``'
    budget), and the watchdog (which may end the trainer)."""
    while (code := proc.poll()) is None:
        if startup is not None and startup.waiting:
            startup.poll()
        starting = startup is not None and bool(startup.waiting)
        # a server that dies while the start-up waits for it (also after this poll looked) died before it was healthy
        check_servers(
            servers, "before it was healthy" if starting else "during training", None if starting else restarts
        )
        event = watchdog.check() if watchdog is not None else None
        if event is not None:
            if relay is not None:
                relay.end_line()
                relay.line("megarl", event.line())
            if watchdog.config.action != "warn":
                what = (
                    "stopping the run"
                    if watchdog.config.action == "abort"
                    else "restarting the trainer from its last recover point"
                )
                logger.error("watchdog: %s (watchdog.action=%s)", what, watchdog.config.action)
                if relay is not None:
                    relay.line("megarl", f"watchdog: {what} (watchdog.action={watchdog.config.action})")
                return WATCHDOG_ABORT_STATUS  # the caller's finally stops the trainer's process tree
        time.sleep(POLL_S)
    return code


WATCHDOG_ABORT_STATUS = 3  # the trainer stopped by the watchdog (warn keeps it running)


@contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into ``SystemExit(143)`` so teardown runs as for Ctrl-C.

    The handler stays if something chained to it meanwhile (``kill_on_exit`` does so
    when it first installs its own): it still ends the process, as SIGTERM should.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, previous)


def run_local(config: GRPOConfig, config_file: str | Path | None = None, out: TextIO | None = None) -> int:
    """Run ``config`` on this machine: servers, then the trainer; returns the trainer's exit status.

    Args:
        config: A loaded and validated config.
        config_file: Where to write the resolved config the trainer reads (default
            ``{run_dir}/config.yaml``); the servers are built from the same config.
        out: Where children's prefixed output goes (default ``sys.stdout``).

    Raises:
        ValueError: The config cannot run here (nothing was started).
        ServerLaunchError: A server failed to start or died during the run.
    """
    plan = check_local(config)
    with run_api_key():  # servers and trainer inherit it; the servers refuse requests without it
        return _run(config, config_file, plan, out)


def _run(config: GRPOConfig, config_file: str | Path | None, plan: Placement, out: TextIO | None) -> int:
    specs = server_specs(config, plan)
    # the trainer starts with the servers: it waits for them as long as this launcher does
    config.rollout.setup_timeout = max(config.rollout.setup_timeout, _startup_timeout(config))
    config_file = save_config(config, config_file).resolve()
    save_run_key(config.run_dir)  # for servers that join later (megarl serve --join)
    logger.info("run dir %s; config %s", config.run_dir.resolve(), config_file)
    relay = OutputRelay(out if out is not None else sys.stdout, verbose=config.launcher.verbose)
    for line in startup_lines(config, plan):
        relay.line("megarl", line)
    try:
        with _sigterm_as_exit(), running_servers(config, specs, relay, wait=False) as servers:
            announce = lambda seconds: relay.line("megarl", f"servers ready in {seconds:.0f} s")  # noqa: E731
            startup = ServerStartup(servers, _startup_timeout(config), on_ready=announce)
            return run_trainer(config, config_file, plan, servers, relay, startup)
    finally:
        relay.end_line()  # an error or "interrupted" starts on a line of its own


def startup_lines(config: GRPOConfig, plan: Placement) -> list[str]:
    """What runs where, in which dtype, on how many threads: the console's first lines."""
    inference, train = config.allocation.inference, config.allocation.train
    dtypes = config.dtypes()
    servers = dtypes[f"{inference.backend}.dtype"]
    lines = [
        f"{config.experiment_name}/{config.trial_name}: {inference.dp} {inference.backend} server(s) of TP {inference.tp} "
        f"+ megatron trainer {train} on {config.device}; logs in {config.run_dir / 'logs'}",
        f"dtype: trainer {dtypes['actor.dtype']}, servers {servers}, weight sync {dtypes['weight_update.dtype']} "
        f"({auto_dtype(config.device)[1]})",
    ]
    if config.device == "cpu":
        shared = servers_on_every_core(config)
        cores = "; ".join(
            f"server-{s.index} on {'every core' if shared else 'cores ' + ','.join(map(str, s.devices))}"
            for s in plan.servers
        )
        share = trainer_env(config, plan, [])["OMP_NUM_THREADS"]
        idle = ", every core while the servers idle" if config.cluster.cpu_threads != "static" else ""
        policy = f"cluster.cpu_threads={config.cluster.cpu_threads}"
        if config.allocation.colocated:
            idle, policy = "", "colocated: the servers sleep while it computes"
        lines.append(f"threads: {cores}; trainer {share} per rank{idle} ({policy})")
    return lines


if __name__ == "__main__":  # AReaL's `python -m areal.launcher.local <script> --config <file> [key=value ...]`
    from megarl.launcher import areal_command

    areal_command.main("local")
