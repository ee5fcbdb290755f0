"""``megarl serve``: start one inference server of an experiment and keep it running.

The launchers run this once per server (locally as a subprocess, on Slurm as an
``srun`` step). It builds the backend's command from the config, waits until the
server is healthy, announces its address in ``--addr-file`` (written atomically, so
a reader never sees half an address), then stays until the server exits or the
step is stopped; either way the server's whole process tree goes with it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

from megarl.config.experiment import GRPOConfig
from megarl.models import resolve_model_path
from megarl.serving.launch import InferenceServer, LaunchSpec
from megarl.serving.restarts import JOINS_FILE, append_record
from megarl.serving.sglang import sglang_launch_spec
from megarl.serving.vllm import running_requests, vllm_launch_spec
from megarl.utils.network import format_host_port, gethostip

logger = logging.getLogger(__name__)

_DRAIN_NOTICE_S = 2.0


def servers_on_every_core(config: GRPOConfig) -> bool:
    """CPU: servers bind every core, taking turns with the trainer (``cluster.cpu_threads=shared``, or a
    colocated allocation, whose servers sleep while the trainer computes), instead of their slot's cores."""
    return config.device == "cpu" and (config.cluster.cpu_threads == "shared" or config.allocation.colocated)


SHARED_CORES_NICE = 10
"""CPU priority (``nice``) of a server that shares its cores with the trainer (:func:`servers_on_every_core`).

A vLLM worker that has just answered busy-waits (``sched_yield``) for about a second before it sleeps,
which is when the trainer starts its update: that second ran at a fraction of its speed, ~15% of the
arithmetic job's train phase on a 2-core CPU. At nice 10 the trainer's threads win the cores whenever
both want them; a server alone (while it generates, the trainer waits) still has them all."""


def server_spec(
    config: GRPOConfig,
    index: int,
    devices: list[int],
    host: str,
    port: int,
    joined: bool = False,
    insecure: bool = False,
) -> LaunchSpec:
    """The launch spec of server ``index`` of ``config``'s inference part (``joined``: one more, beyond it),
    guarded by ``$MEGARL_API_KEY`` (``insecure``: without one, open to anyone who reaches ``host``; without
    either, on loopback a key made for this process, elsewhere a ``ValueError``)."""
    inference = config.allocation.inference
    if inference is None:
        raise ValueError(f"allocation_mode {config.allocation_mode!r} has no inference part to serve")
    if not joined and not 0 <= index < inference.dp:
        raise ValueError(f"server index {index} out of range: allocation_mode has {inference.dp} servers")
    # on CPU a server may run on more cores than its slots (cluster.cpu_threads=shared)
    if len(devices) < inference.devices_per_server or (
        config.device == "cuda" and len(devices) > inference.devices_per_server
    ):
        raise ValueError(f"server {index} needs {inference.devices_per_server} devices, got {devices}")
    spec = _backend_spec(config, index, devices, host, port, insecure)
    if servers_on_every_core(config):
        spec.nice = SHARED_CORES_NICE
    return spec


def _backend_spec(
    config: GRPOConfig, index: int, devices: list[int], host: str, port: int, insecure: bool
) -> LaunchSpec:
    inference = config.allocation.inference
    model = resolve_model_path(config.actor.path)
    lora_rank = config.actor.lora.rank if config.adapter_sync else 0
    if inference.backend == "vllm":
        return vllm_launch_spec(
            config.vllm,
            model,
            host,
            port,
            tp=inference.tp,
            devices=devices,
            device_type=config.device,
            replica=index,
            colocated=config.allocation.colocated,
            lora_rank=lora_rank,
            routed_experts=config.rollout.return_routed_experts,
            insecure=insecure,
        )
    return sglang_launch_spec(
        config.sglang,
        model,
        host,
        port,
        tp=inference.tp,
        devices=devices,
        replica=index,
        routed_experts=config.rollout.return_routed_experts,
        colocated=config.allocation.colocated,
        lora_rank=lora_rank,
        insecure=insecure,
    )


def server_host(config: GRPOConfig) -> str:
    """The one address a server listens on: ``$MEGARL_HOST_IP`` (127.0.0.1 under ``megarl run``), the
    cluster interface's (``launcher.slurm.network_interface``) or the default route's; never 0.0.0.0."""
    return gethostip(config.launcher.slurm.network_interface)


def serve(
    config: GRPOConfig,
    index: int,
    devices: list[int],
    port: int,
    addr_file: Path | None,
    join: bool = False,
    drain_timeout: float = 60.0,
    insecure: bool = False,
) -> int:
    """Run server ``index`` until it exits; returns its exit status.

    ``join``: an elastic server of a running run (``megarl serve --join RUN_DIR``): ``index`` is one
    past the run's servers and those joined before; once healthy it announces itself in
    ``{run_dir}/servers_joined.jsonl`` (the trainer pushes it the current weights at its next sync,
    then routes requests to it). Stopped (SIGTERM, Ctrl-C), it announces that it leaves and waits
    until its running requests are done (at most ``drain_timeout`` seconds) before it exits.

    The server is guarded by ``$MEGARL_API_KEY``; ``insecure``: without one, it serves every route to
    anyone who reaches it (else a ``ValueError`` before anything starts).
    """
    host = server_host(config)
    if servers_on_every_core(config):
        devices = sorted(os.sched_getaffinity(0))
    spec = server_spec(config, index, devices, host, port, joined=join, insecure=insecure)
    spec.env.update(config.launcher.env)
    timeout = (
        config.vllm.startup_timeout if config.allocation.inference.backend == "vllm" else config.sglang.startup_timeout
    )
    name = f"server-{index}"
    server = InferenceServer(spec, log_path=config.run_dir / "logs" / f"{name}.log", name=name)
    joins = config.run_dir / JOINS_FILE
    if join:
        signal.signal(signal.SIGTERM, _interrupt)  # a leaving server drains first (the finally below)
    with server:
        server.start()
        server.wait_until_healthy(timeout)
        if addr_file is not None:
            addr_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = addr_file.with_suffix(".tmp")
            tmp.write_text(format_host_port(host, port) + "\n")
            tmp.replace(addr_file)
        if not join:
            code = server.proc.wait()
        else:
            append_record(joins, {"time": time.time(), "event": "join", "server": name, "address": spec.address})
            logger.warning(
                "%s at %s joined %s; stop it (SIGTERM or Ctrl-C) to drain it and leave",
                name,
                spec.address,
                config.run_dir,
            )
            try:
                code = server.proc.wait()
            except KeyboardInterrupt:
                append_record(joins, {"time": time.time(), "event": "leave", "server": name, "address": spec.address})
                drain(spec.address, drain_timeout)
                return 0
    logger.warning("%s at %s exited with status %s", name, spec.address, code)
    return code if code else 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def joined_index(config: GRPOConfig) -> int:
    """The index of a server joining ``config``'s run, reserved for it at once: past the allocation's
    servers and every server that joined or is joining. The reservation is a ``reserve`` line of
    ``servers_joined.jsonl`` written under a file lock, so two servers joining together (each healthy,
    and announcing its join, minutes later) do not both take ``server-N`` and its log."""
    from filelock import FileLock

    path = config.run_dir / JOINS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        lines = path.read_text().splitlines() if path.exists() else []
        records = [json.loads(line) for line in lines if line.strip()]
        reserved = {r.get("server") for r in records if r.get("event") == "reserve"}
        # runs from before reservations: their joins count one each
        joins = sum(r.get("event") == "join" and r.get("server") not in reserved for r in records)
        index = config.allocation.inference.dp + len(reserved) + joins
        append_record(path, {"time": time.time(), "event": "reserve", "server": f"server-{index}", "address": ""})
    return index


def drain(address: str, timeout: float) -> None:
    """Wait until the server at ``address`` runs no request (vLLM's ``/metrics``; else ``timeout`` seconds pass)."""
    deadline = time.monotonic() + timeout
    time.sleep(_DRAIN_NOTICE_S)  # the trainer reads the leave line within a second and routes elsewhere
    while time.monotonic() < deadline:
        running = running_requests(address)
        if running == 0:
            return
        time.sleep(1.0)
    logger.warning("%s still runs requests after %gs: stopping it (they are re-issued elsewhere)", address, timeout)
