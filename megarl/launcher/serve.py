"""``megarl serve``: start one inference server of an experiment and keep it running.

The launchers run this once per server (locally as a subprocess, on Slurm as an
``srun`` step). It builds the backend's command from the config, waits until the
server is healthy, announces its address in ``--addr-file`` (written atomically, so
a reader never sees half an address), then stays until the server exits or the
step is stopped; either way the server's whole process tree goes with it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from megarl.config.experiment import GRPOConfig
from megarl.models import resolve_model_path
from megarl.rollout.server import InferenceServer, LaunchSpec
from megarl.rollout.sglang import sglang_launch_spec
from megarl.rollout.vllm import vllm_launch_spec
from megarl.utils.network import format_host_port, gethostip

logger = logging.getLogger(__name__)


def servers_on_every_core(config: GRPOConfig) -> bool:
    """CPU: servers bind every core, taking turns with the trainer (``cluster.cpu_threads=shared``, or a
    colocated allocation, whose servers sleep while the trainer computes), instead of their slot's cores."""
    return config.device == "cpu" and (config.cluster.cpu_threads == "shared" or config.allocation.colocated)


def server_spec(config: GRPOConfig, index: int, devices: list[int], host: str, port: int) -> LaunchSpec:
    """The launch spec of server ``index`` of ``config``'s inference part."""
    inference = config.allocation.inference
    if inference is None:
        raise ValueError(f"allocation_mode {config.allocation_mode!r} has no inference part to serve")
    if not 0 <= index < inference.dp:
        raise ValueError(f"server index {index} out of range: allocation_mode has {inference.dp} servers")
    # on CPU a server may run on more cores than its slots (cluster.cpu_threads=shared)
    if len(devices) < inference.devices_per_server or (config.device == "cuda" and len(devices) > inference.devices_per_server):
        raise ValueError(f"server {index} needs {inference.devices_per_server} devices, got {devices}")
    model = resolve_model_path(config.actor.path)
    if inference.backend == "vllm":
        return vllm_launch_spec(
            config.vllm, model, host, port, tp=inference.tp, devices=devices,
            device_type=config.device, replica=index, colocated=config.allocation.colocated,
        )  # fmt: skip
    return sglang_launch_spec(config.sglang, model, host, port, tp=inference.tp, devices=devices, replica=index,
                              routed_experts=config.rollout.return_routed_experts,
                              colocated=config.allocation.colocated)  # fmt: skip


def server_host(config: GRPOConfig) -> str:
    """The one address a server listens on: ``$MEGARL_HOST_IP`` (127.0.0.1 under ``megarl run``), the
    cluster interface's (``launcher.slurm.network_interface``) or the default route's; never 0.0.0.0."""
    return gethostip(config.launcher.slurm.network_interface)


def serve(config: GRPOConfig, index: int, devices: list[int], port: int, addr_file: Path | None) -> int:
    """Run server ``index`` until it exits; returns its exit status."""
    host = server_host(config)
    if servers_on_every_core(config):
        devices = sorted(os.sched_getaffinity(0))
    spec = server_spec(config, index, devices, host, port)
    spec.env.update(config.launcher.env)
    timeout = config.vllm.startup_timeout if config.allocation.inference.backend == "vllm" else config.sglang.startup_timeout
    server = InferenceServer(spec, log_path=config.run_dir / "logs" / f"server-{index}.log", name=f"server-{index}")
    with server:
        server.start()
        server.wait_until_healthy(timeout)
        if addr_file is not None:
            addr_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = addr_file.with_suffix(".tmp")
            tmp.write_text(format_host_port(host, port) + "\n")
            tmp.replace(addr_file)
        code = server.proc.wait()
    logger.warning("server-%d at %s exited with status %s", index, spec.address, code)
    return code if code else 0
