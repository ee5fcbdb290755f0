"""The SGLang path: payloads checked against SGLang's request classes; fake SGLang servers get exact bytes.

SGLang cannot serve on CPU. Its request classes and its receiving code
(``init_custom_process_group``, ``FlattenedTensorBucket``) can run: the fake server
(``fake_sglang.py``) uses them, so a trainer that fills it speaks SGLang's protocol.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.bridge.schedule import broadcast_schedule, receiver_spec
from megarl.bridge.transfer_plan import build_plan
from megarl.bridge.wiring import make_wiring
from megarl.config.allocation import TrainingAllocation
from megarl.models.build import describe
from megarl.models.hf_io import SafetensorsReader
from megarl.serving import InferenceServer, LaunchSpec
from megarl.serving.sglang import SGLangControl
from megarl.utils.network import find_free_ports
from tests.actor.dist_utils import run_ranks
from tests.bridge.workers import WIRE
from tests.sglang_stub import find_sglang

pytestmark = pytest.mark.skipif(
    find_sglang() is None, reason="no SGLang: `make install` puts its request types in the venv"
)
HERE = Path(__file__).parent
CHECK = """
import json, sys
sys.path.insert(0, {repo!r})
from tests.bridge.sglang_types import validate
for route, payload in json.load(sys.stdin):
    validate(route, payload)
print("ok")
"""


def _init_info(model_dir, server_tp=(1, 1)) -> dict:
    reader = SafetensorsReader(model_dir)
    layout = TrainingAllocation(pp=2)
    plan = build_plan(
        describe(model_dir, 1),
        {n: reader.shape(n) for n in reader.keys()},
        layout,
        server_tp,  # noqa: SIM118 (the reader is not iterable)
        sharded=False,
    )
    sched = broadcast_schedule(plan, 200_000)
    wiring = make_wiring(
        "gloo",
        len(plan.workers),
        sched.senders,
        [],
        lambda o: o.pp,
        lambda r, k: ("127.0.0.1", 30000 + r),
        "megarl-bridge-1",
    )
    spec = receiver_spec(plan, plan.worker_index(1, 0), "broadcast", 200_000)
    return {
        "wiring": wiring.to_json(),
        "worker_offset": plan.worker_index(1, 0),
        "specs": {"0": {"broadcast": spec}},
        "dtype": "bfloat16",
        "timeout": 60.0,
        "stage": True,
    }


def test_payloads_validate_against_sglang_request_types(tiny_model_dir):
    control = SGLangControl("127.0.0.1:1", 1)
    info = _init_info(tiny_model_dir("llama"))
    control._groups = [g["name"] for g in info["wiring"]["broadcast"]]
    control._buckets = info["specs"]["0"]["broadcast"]["buckets"]
    payloads = [("/init_weights_update_group", p) for p in control.init_payloads(info)]
    assert [p["rank_offset"] for _, p in payloads] == [2, 2]  # second server: after the sender and server 0
    payloads += [("/update_weights_from_distributed", p) for p in control.bucket_payloads()]
    payloads += [
        ("/begin_weight_update", {}),
        ("/end_weight_update", {}),
        ("/update_weight_version", {"new_version": "3", "abort_all_requests": False}),
        ("/update_weights_from_disk", {"model_path": "/x", "weight_version": "3", "flush_cache": True}),
        ("/generate", control.score_payload([1, 2, 3])),
        ("/generate", control.score_payload([1, 2, 3], k=20)),
        ("/load_lora_adapter", control.adapter_payload("megarl-lora-v3", "/x/lora/v3")),
        ("/unload_lora_adapter", {"lora_name": "megarl-lora-v1"}),
    ]
    scored = control.score_payload([1, 2, 3], k=20, adapter="megarl-lora-v3")  # the probe under the served adapter
    assert scored["lora_path"] == "megarl-lora-v3"
    payloads.append(("/generate", scored))
    proc = subprocess.run(
        [sys.executable, "-c", CHECK.format(repo=str(HERE.parents[1]))],
        input=json.dumps(payloads),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.multiproc
def test_fake_sglang_servers_receive_exact_bytes(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama", vocab_size=1001)
    reader = SafetensorsReader(model_dir)
    hf = {n: reader(n, None, 0, 0) for n in reader.keys()}  # noqa: SIM118 (the reader is not iterable)
    servers = []
    for port in find_free_ports(2):
        cmd = [sys.executable, str(HERE / "fake_sglang.py"), "--port", str(port)]
        servers.append(
            InferenceServer(LaunchSpec(cmd=cmd, port=port), tmp_path / f"sglang-{port}.log", name="fake-sglang").start()
        )
    try:
        for server in servers:
            server.wait_until_healthy(120)
        (result, _) = run_ranks(
            2,
            "tests.bridge.workers:sglang_transfer",
            timeout=400,
            model_dir=str(model_dir),
            layout={"pp": 2},
            addresses=[s.address for s in servers],
            dump_dir=str(tmp_path),
            disk_dir=str(tmp_path / "disk"),
        )
    finally:
        for server in servers:
            server.stop()
    assert all(ok for ok, *_ in result["reports"]), result
    for version in (1, 2, 3):
        for i in range(len(servers)):
            dump = torch.load(tmp_path / f"v{version}-s{i}.pt")
            assert dump["version"] == str(version)
            assert sorted(dump["weights"]) == sorted(hf)
            for name, tensor in hf.items():
                assert torch.equal(dump["weights"][name], (tensor * version).to(WIRE)), (version, i, name)


def test_disk_mode_alone_joins_no_group():
    """``weight_update.mode: disk`` with SGLang servers: nothing to join at connect (the server reads each
    version from the path); connecting used to fail every SGLang server ("only broadcast and disk modes")."""
    control = SGLangControl("127.0.0.1:9", tp=1, timeout=1.0)  # nothing listens there: no request may be made
    control.init_group({"specs": {"0": {}}, "wiring": {"broadcast": []}, "dtype": "bfloat16"})
    with pytest.raises(ValueError, match="no sharded receive API"):
        control.init_group({"specs": {"0": {"sharded": {}}}, "wiring": {"broadcast": []}, "dtype": "bfloat16"})
