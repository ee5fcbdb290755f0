"""Adapter weight sync (``megarl.bridge.adapter``) against fake SGLang servers that parse every body with
SGLang's own request classes and load each adapter from its PEFT directory.

The real vLLM-CPU path (the adapters served and probed in a GRPO run) is ``tests/train/test_lora_e2e.py``.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megarl.bridge.adapter import ADAPTER_FILE, AdapterBridge, adapter_name
from megarl.config.bridge import WeightUpdateConfig
from megarl.serving import InferenceServer, LaunchSpec
from megarl.serving.sglang import SGLangControl
from megarl.serving.vllm import VLLMControl
from megarl.utils.network import find_free_ports
from tests.sglang_stub import find_sglang

pytestmark = pytest.mark.skipif(
    find_sglang() is None, reason="no SGLang: `make install` puts its request types in the venv"
)
HERE = Path(__file__).parent
SHAPES = {"a": (4, 64), "b": (64, 4)}


def tensors(version: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The adapters of ``version`` (PEFT names), a different value per version."""
    return {
        f"base_model.model.model.layers.0.self_attn.q_proj.lora_{m.upper()}.weight": torch.full(shape, version + 0.5)
        .to(dtype)
        .clone()
        for m, shape in SHAPES.items()
    }


class Trainer:
    """What the engine's ``export_adapters`` does, for one rank: a PEFT directory of this version's adapters."""

    def __init__(self):
        self.version, self.fail = 0, False

    def export(self, path: str, dtype: torch.dtype) -> None:
        if self.fail:
            raise OSError("No space left on device")
        Path(path).mkdir(parents=True, exist_ok=True)
        save_file(tensors(self.version, dtype), str(Path(path) / ADAPTER_FILE))
        (Path(path) / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))


def loaded(server) -> dict[str, dict[str, float]]:
    with urllib.request.urlopen(f"http://{server.address}/fake/adapters", timeout=30) as reply:
        return json.loads(reply.read())


@pytest.fixture(scope="module")
def fake_servers(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("fake-sglang")
    servers = []
    for port in find_free_ports(2):
        cmd = [sys.executable, str(HERE / "fake_sglang.py"), "--port", str(port)]
        servers.append(InferenceServer(LaunchSpec(cmd=cmd, port=port), log_dir / f"{port}.log", name="sglang").start())
    try:
        for server in servers:
            server.wait_until_healthy(180)
        yield servers
    finally:
        for server in servers:
            server.stop()


def test_each_version_is_loaded_as_a_new_adapter_and_older_ones_dropped(fake_servers, tmp_path):
    trainer = Trainer()
    controls = [SGLangControl(s.address, 1, timeout=60) for s in fake_servers]
    bridge = AdapterBridge(WeightUpdateConfig(disk_path=str(tmp_path)), trainer.export, torch.bfloat16)
    bridge.connect(controls)
    for version in range(4):
        trainer.version = version
        report = bridge.update(None, version)
        assert report.ok and report.updated == [s.address for s in fake_servers], report
        assert report.adapter == adapter_name(version) == f"megarl-lora-v{version}"
        assert report.bytes_sent == (tmp_path / "lora" / f"v{version}" / ADAPTER_FILE).stat().st_size
        assert 2 * 2 * 4 * 64 < report.bytes_sent < 2 * 2 * 4 * 64 + 1024  # two bf16 matrices and the header
        kept = [v for v in (version - 1, version) if v >= 0]
        for server, control in zip(fake_servers, controls):
            held = loaded(server)
            assert sorted(held) == sorted(adapter_name(v) for v in kept), (version, held)
            for v in kept:  # the bytes of that version, in the wire dtype
                assert set(held[adapter_name(v)].values()) == {(v + 0.5) * 4 * 64}
        assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == [f"v{v}" for v in kept]


def test_a_version_pushed_again_replaces_the_adapter_of_that_name(fake_servers, tmp_path):
    """A readmitted server gets the current version again; SGLang refuses a name it holds, so it is reloaded."""
    trainer = Trainer()
    controls = [SGLangControl(s.address, 1, timeout=60) for s in fake_servers]
    bridge = AdapterBridge(WeightUpdateConfig(disk_path=str(tmp_path)), trainer.export, torch.float32)
    bridge.connect(controls)
    for server, control in zip(fake_servers, controls):  # what the previous test left loaded
        for name in loaded(server):
            control.unload_adapter(name)
    trainer.version = 7
    assert bridge.update(None, 7).ok
    trainer.version = 8  # new bytes under the same version number
    report = bridge.update(None, 7)
    assert report.ok, report
    for server in fake_servers:
        assert loaded(server) == {adapter_name(7): {k: 8.5 * t.numel() for k, t in tensors(8, torch.float32).items()}}


def test_failures_are_reported_per_server_and_for_the_trainer(fake_servers, tmp_path):
    trainer = Trainer()
    dead = SGLangControl(f"127.0.0.1:{find_free_ports(1)[0]}", 1, timeout=5)
    controls = [SGLangControl(fake_servers[0].address, 1, timeout=60), dead]
    bridge = AdapterBridge(WeightUpdateConfig(disk_path=str(tmp_path)), trainer.export, torch.float32)
    bridge.connect(controls)
    report = bridge.update(None, 20)
    assert report.updated == [fake_servers[0].address] and list(report.failed) == [dead.address]
    assert "load_lora_adapter" in report.failed[dead.address]
    trainer.fail = True
    report = bridge.update(None, 21)
    assert not report.ok and not report.updated and set(report.failed) == {c.address for c in controls}
    assert (
        "No space left on device" in report.sender_errors[0]
        and str(tmp_path / "lora" / "v21") in report.sender_errors[0]
    )
    no_lora = VLLMControl(fake_servers[1].address, 1, timeout=30)  # as a server without the LoRA routes: 404
    bridge.connect([no_lora])
    trainer.fail = False
    report = bridge.update(None, 22)
    assert "HTTP 404" in report.failed[no_lora.address]
    assert "was the server started with LoRA enabled?" in report.failed[no_lora.address]
    with pytest.raises(ValueError, match="weight_update.disk_path"):
        AdapterBridge(WeightUpdateConfig(), trainer.export, torch.float32)
