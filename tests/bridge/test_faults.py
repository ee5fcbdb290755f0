"""A server dying mid-transfer: a clear error naming it, no server half-updated, the survivors reconnect.

Fake vLLM servers (``fake_vllm.py``: vLLM's weight routes over megarl's receiver core)
keep what they commit; one exits abruptly after two buckets of the second update.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megarl.models.hf_io import SafetensorsReader
from megarl.serving import InferenceServer, LaunchSpec
from megarl.utils.network import find_free_ports
from tests.actor.dist_utils import run_ranks
from tests.bridge.workers import WIRE

pytestmark = pytest.mark.multiproc
HERE = Path(__file__).parent


def _start(tmp_path, dying: bool) -> InferenceServer:
    port = find_free_ports(1)[0]
    cmd = [sys.executable, str(HERE / "fake_vllm.py"), "--port", str(port)]
    if dying:
        cmd += ["--die-after-buckets", "2", "--die-in-update", "2"]
    return InferenceServer(LaunchSpec(cmd=cmd, port=port), tmp_path / f"fake-{port}.log", name="fake-vllm").start()


@pytest.mark.parametrize("mode", [pytest.param("broadcast", marks=pytest.mark.slow), "sharded"])
def test_server_dying_mid_transfer(mode, tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama", vocab_size=1001)
    reader = SafetensorsReader(model_dir)
    hf = {n: reader(n, None, 0, 0) for n in reader.keys()}  # noqa: SIM118 (the reader is not iterable)
    survivor, dying = _start(tmp_path, False), _start(tmp_path, True)
    try:
        for server in (survivor, dying):
            server.wait_until_healthy(60)
        (reports,) = run_ranks(
            1,
            "tests.bridge.workers:fault_transfer",
            timeout=300,
            model_dir=str(model_dir),
            addresses=[survivor.address, dying.address],
            mode=mode,
            dump_dir=str(tmp_path),
        )
    finally:
        survivor.stop()
        dying.stop()
    first, second, third = reports
    assert first["ok"] and sorted(first["updated"]) == sorted([survivor.address, dying.address])
    assert not second["ok"] and dying.address in second["failed"]
    assert dying.address in second["failed"][dying.address] or "update_weights" in second["failed"][dying.address]
    assert third["ok"] and third["updated"] == [survivor.address]  # reconnected to the survivor only
    # the survivor holds one whole version after the failed update: the new one, or still the old one
    kept = "2" if survivor.address in second["updated"] else "1"
    _check_dump(tmp_path, 2, survivor.address, kept, hf, mode, present=survivor.address in second["updated"])
    _check_dump(tmp_path, 3, survivor.address, "3", hf, mode, present=True)


def _check_dump(tmp_path, version, address, want_version, hf, mode, present):
    path = tmp_path / f"v{version}-{address.replace(':', '_')}.pt"
    if not present and not path.exists():
        return
    dump = torch.load(path)
    assert dump["version"] == want_version
    scale = float(want_version)
    if mode == "broadcast":
        for name, tensor in hf.items():
            assert torch.equal(dump["weights"][name], (tensor * scale).to(WIRE)), name
    else:  # TP-1 local tensors are whole HF tensors (fused ones concatenated)
        embed = dump["weights"]["model.embed_tokens.weight", None]
        assert torch.equal(
            embed[: hf["model.embed_tokens.weight"].shape[0]], (hf["model.embed_tokens.weight"] * scale).to(WIRE)
        )
