"""SGLangBackend's payloads and launch command, checked against SGLang's own request types.

SGLang cannot serve on CPU; its request classes can be imported (``make install`` keeps a
``--no-deps`` copy of SGLang for them: ``tests/sglang_stub.py``). Two levels: the generated
JSON schema module ``sglang.api.v1.api_types`` (loaded straight from its file: it needs only
msgspec), and, in a subprocess,
``io_struct.GenerateReqInput`` / ``PauseGenerationReqInput`` / ``ContinueGenerationReqInput``,
``SamplingParams.verify`` and the ``ServerArgs`` command-line parser.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.api.io_struct import GenerationHyperparameters
from megarl.config.rollout import SGLangConfig
from megarl.serving import SGLangBackend, sglang_launch_spec
from tests.rollout.fake_server import EOS
from tests.sglang_stub import find_sglang

SGLANG = find_sglang()
pytestmark = [
    pytest.mark.skipif(SGLANG is None, reason="no SGLang: `make install` puts its request types in the venv"),
    pytest.mark.usefixtures("run_key"),  # servers are launched with the run's key
]
CHECK_SCRIPT = str(Path(__file__).with_name("sglang_check.py"))

GCONFIGS = [
    GenerationHyperparameters(n_samples=1, max_new_tokens=64),
    GenerationHyperparameters(n_samples=1, max_new_tokens=8, min_new_tokens=2, temperature=0.7, top_p=0.9, top_k=20),
    GenerationHyperparameters(n_samples=1, max_new_tokens=8, greedy=True, stop=["\n\n"], stop_token_ids=[2]),
    GenerationHyperparameters(n_samples=1, max_new_tokens=8, seed=2**63 - 1),
]


@pytest.fixture(scope="module")
def api_types():
    """``sglang.api.v1.api_types`` loaded from its file (importing the package costs ~10 s)."""
    path = Path(SGLANG.submodule_search_locations[0]) / "api" / "v1" / "api_types.py"
    spec = importlib.util.spec_from_file_location("_sglang_api_types", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _payloads() -> list[dict]:
    backend = SGLangBackend()
    return [backend.generate_payload([1, 2, 3, 4], g, g.max_new_tokens, g.min_new_tokens) for g in GCONFIGS]


@pytest.mark.parametrize("payload", _payloads(), ids=["default", "sampling", "greedy-stop", "seeded"])
def test_generate_payload_matches_schema(api_types, payload):
    decoded = api_types.GenerateRequest.from_json_value(payload)
    fields = set(api_types.GenerateRequest.__struct_fields__)
    assert set(payload) <= fields, f"unknown GenerateRequest fields {set(payload) - fields}"
    assert decoded.input_ids == [1, 2, 3, 4] and decoded.return_logprob is True and decoded.stream is False
    sampling = decoded.sampling_params  # SamplingParams rejects unknown keys
    assert sampling.max_new_tokens == payload["sampling_params"]["max_new_tokens"]


def test_greedy_payload(api_types):
    payload = _payloads()[2]
    sampling = api_types.GenerateRequest.from_json_value(payload).sampling_params
    assert sampling.temperature == 0.0 and sampling.top_k == 1
    assert sampling.stop == ["\n\n"] and sampling.stop_token_ids == [2]


def _reply(tokens: list[int], logprobs: list[float], finish: dict) -> dict:
    meta = {
        "id": "x",
        "finish_reason": finish,
        "prompt_tokens": 4,
        "completion_tokens": len(tokens),
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens)],
    }
    return {"text": "", "output_ids": tokens, "meta_info": meta}


@pytest.mark.parametrize(
    ("finish", "expected"),
    [
        ({"type": "stop", "matched": EOS}, "stop"),
        ({"type": "length", "length": 3}, "length"),
        ({"type": "abort", "message": "Abort in waiting queue"}, "abort"),
    ],
)
def test_parse_generate_on_schema_valid_replies(api_types, finish, expected):
    reply = _reply([5, 6, EOS], [-0.1, -0.2, -0.3], finish)
    api_types.GenerateResponse.from_json_value(reply)  # the reply shape is SGLang's
    chunk = SGLangBackend().parse_generate(reply)
    assert chunk.output_tokens == [5, 6, EOS] and chunk.output_logprobs == [-0.1, -0.2, -0.3]
    assert chunk.finish_reason == expected


def test_fake_server_replies_match_schema(api_types, fake_servers):
    """The fake SGLang server used by the engine tests speaks SGLang's response schema."""
    (server,) = fake_servers(1, dialect="sglang", eos_every=7)
    import urllib.request

    body = json.dumps(_payloads()[0]).encode()
    req = urllib.request.Request(
        f"http://{server.address}/generate", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        reply = json.loads(resp.read())
    decoded = api_types.GenerateResponse.from_json_value(reply)
    assert decoded.meta_info.finish_reason.__class__.__name__ == "FinishStop"


def test_against_sglang_io_struct_and_server_args(tmp_path):
    backend = SGLangBackend()
    spec = sglang_launch_spec(
        SGLangConfig(attention_backend="triton"), "/models/qwen", "127.0.0.1", 30000, tp=2, devices=[2, 3]
    )
    assert spec.cmd[1:3] == ["-m", "sglang.launch_server"] and spec.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    (pause,) = backend.pause_calls()
    flush, resume = backend.resume_calls()
    assert (pause.endpoint, flush.endpoint, resume.endpoint) == (
        "/pause_generation",
        "/flush_cache",
        "/continue_generation",
    )
    request = {
        "vocab_size": 49152,
        "generate": _payloads(),
        "pause": pause.payload,
        "resume": resume.payload,
        "launch_args": spec.cmd[3:],
    }
    proc = subprocess.run(
        [sys.executable, CHECK_SCRIPT],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {
        "ok": True,
        "model_path": "/models/qwen",
        "tp_size": 2,
        "port": 30000,
        "routed_experts": False,
        "memory_saver": False,
        "lora": [None, None, None, 8, None],
    }


def test_routed_experts_request_and_server_flag_against_sglang(tmp_path):
    """``rollout.return_routed_experts``: the request asks for every forwarded position (from 0: the prompt's
    routes are replayed too), the server starts with the flag; SGLang's io_struct, route contract and
    ServerArgs accept both."""
    backend = SGLangBackend()
    backend.return_routed_experts = True
    payload = backend.generate_payload([1, 2, 3, 4], GCONFIGS[0], 8, 0)
    assert payload["return_routed_experts"] is True and payload["routed_experts_start_len"] == 0
    spec = sglang_launch_spec(SGLangConfig(), "/models/moe", "127.0.0.1", 30000, tp=1, devices=[0], routed_experts=True)
    (pause,) = backend.pause_calls()
    _, resume = backend.resume_calls()
    request = {
        "vocab_size": 49152,
        "generate": [payload],
        "pause": pause.payload,
        "resume": resume.payload,
        "launch_args": spec.cmd[3:],
    }
    proc = subprocess.run(
        [sys.executable, CHECK_SCRIPT],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["routed_experts"] is True


def test_lora_adapter_requests_and_server_flags_against_sglang():
    """Adapter weight sync: every request names the served adapter in ``lora_path``, the server starts with
    LoRA on every linear, room for the newest two versions and base; SGLang's io_struct and ServerArgs agree."""
    backend = SGLangBackend()
    payloads = [backend.generate_payload([1, 2, 3, 4], g, 8, 0, adapter="megarl-lora-v3") for g in GCONFIGS]
    assert {p["lora_path"] for p in payloads} == {"megarl-lora-v3"}
    spec = sglang_launch_spec(SGLangConfig(), "/models/qwen", "127.0.0.1", 30000, tp=1, devices=[0], lora_rank=16)
    (pause,) = backend.pause_calls()
    _, resume = backend.resume_calls()
    request = {
        "vocab_size": 49152,
        "generate": payloads,
        "pause": pause.payload,
        "resume": resume.payload,
        "launch_args": spec.cmd[3:],
    }
    proc = subprocess.run(
        [sys.executable, CHECK_SCRIPT], input=json.dumps(request), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["lora"] == [True, 16, ["all"], 3, 3]


def test_colocated_sleep_and_wake_against_sglang():
    """Colocated placement: generation paused (abort) then memory released, resumed before the weight update;
    the server starts with --enable-memory-saver. SGLang's io_struct and ServerArgs accept them."""
    backend = SGLangBackend()
    pause, release = backend.sleep_calls()
    (resume_memory,) = backend.wake_calls()
    assert (pause.endpoint, release.endpoint, resume_memory.endpoint) == (
        "/pause_generation",
        "/release_memory_occupation",
        "/resume_memory_occupation",
    )
    spec = sglang_launch_spec(SGLangConfig(), "/models/qwen", "127.0.0.1", 30000, tp=1, devices=[0], colocated=True)
    _, resume = backend.resume_calls()
    request = {
        "vocab_size": 49152,
        "generate": _payloads(),
        "pause": pause.payload,
        "resume": resume.payload,
        "release": release.payload,
        "resume_memory": resume_memory.payload,
        "launch_args": spec.cmd[3:],
    }
    proc = subprocess.run(
        [sys.executable, CHECK_SCRIPT],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["memory_saver"] is True


def test_parse_routed_experts():
    """SGLang's encoding (``detokenizer_manager``: base64 of the int32 tensor ``[positions, layers, top-k]``),
    one position per forward from the first input token: 4 input tokens and 3 new ones give 6 rows."""
    import base64

    import numpy as np

    from megarl.serving.http import MalformedResponseError

    backend = SGLangBackend()
    backend.return_routed_experts = True
    experts = np.arange(6 * 2 * 2, dtype=np.int32).reshape(6, 2, 2)  # 3 input + 3 new positions, 2 layers, top-2
    reply = _reply([5, 6, EOS], [-0.1, -0.2, -0.3], {"type": "stop", "matched": EOS})
    reply["meta_info"]["routed_experts"] = base64.b64encode(experts.tobytes()).decode()
    chunk = backend.parse_generate(reply)
    assert chunk.prompt_routed_experts == experts[:3].reshape(3, 4).tolist()
    assert chunk.routed_experts == experts[3:].reshape(3, 4).tolist()
    reply["meta_info"]["routed_experts"] = base64.b64encode(experts[:, :, :1].tobytes()[:-4]).decode()
    with pytest.raises(MalformedResponseError, match="holds 11 ids for 6 positions"):
        backend.parse_generate(reply)
    reply["meta_info"]["routed_experts"] = base64.b64encode(experts[:5].tobytes()).decode()  # 5 rows of 4.8 ids
    with pytest.raises(MalformedResponseError, match="for 6 positions"):
        backend.parse_generate(reply)
    reply["meta_info"]["routed_experts"] = base64.b64encode(experts.tobytes()).decode()
    reply["meta_info"]["prompt_tokens"] = None
    with pytest.raises(MalformedResponseError, match="prompt_tokens"):
        backend.parse_generate(reply)
    del reply["meta_info"]["routed_experts"]
    with pytest.raises(MalformedResponseError, match="--enable-return-routed-experts"):
        backend.parse_generate(reply)
    assert SGLangBackend().parse_generate(reply).routed_experts is None, "not asked for, not read"
