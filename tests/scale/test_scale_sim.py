"""The control plane in front of a simulated cluster (``benchmarks/scale_sim.py``): 64 servers, 4 heads, one fault.

The simulated servers are real HTTP endpoints (``tests/scale/sim_host.py``) whose workers join the
trainer's group; megarl's pools, coordinators and weight syncs are its own code, with real Megatron
trainer ranks.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.scale.sim_cluster import SimCluster
from tests.scale.sim_host import ServingModel, WeightLoad


def _post(address: str, route: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://{address}{route}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


def test_four_heads_in_sharded_mode_evict_a_server_that_hangs_and_go_on():
    """64 servers, 4 trainer heads (a gloo world of 4 Megatron ranks, each with its own pool), the
    default ``sharded`` mode (every server joins the trainer's group for real and receives its slices).
    At step 1 one server accepts the weight update and never receives: the sender gives up on it at
    the relative deadline (here max(3 s, 4 x the median round)), the update names it and takes it out
    of rotation, and the next step runs on the other 63 with nothing lost, doubled or misaligned. Each
    update is one call per server whatever the heads (it pauses, receives, commits and resumes the
    server; the other heads only gate their own pools). Before: the sharded send waited on the hung
    worker for the group's timeout with every server paused, every head sent /pause and /resume to
    every server, and later rank 0 still sent a /resume of its own after each update call."""
    from benchmarks.scale_sim import _in_own_process

    row = _in_own_process(64, 3, "hang_update", mean_tokens=100.0, straggler_floor_s=3.0, heads=4)
    assert (row["heads"], row["mode"], row["steps"]) == (4, "sharded", 3), row
    assert row["evicted"] == 1 and row["servers on the last version"] == 63, row
    assert row["calls_per_server_per_update"] == 1, row
    assert row["requests to hit after"] == 0, row
    assert (row["lost"], row["doubled"], row["misaligned"]) == (0, 0, 0), row
    assert row["handed out"] > 3 * 8 * 64 and row["bytes_received"] > 0, row
    assert row["send_s"] < 30, row  # the hung worker cost the floor, not update_timeout


def test_the_control_plane_drives_sglang_servers_too():
    """The same run against 8 servers speaking SGLang's routes (``/generate``, ``/pause_generation``,
    ``/update_weights_from_disk``, ``/update_weight_version``): every update reaches every server and
    the books balance."""
    from benchmarks.scale_sim import _in_own_process

    row = _in_own_process(8, 2, mean_tokens=60.0, dialect="sglang", mode="disk")  # SGLang has no sharded receive
    assert row["dialect"] == "sglang" and row["servers on the last version"] == 8, row
    assert (row["lost"], row["doubled"], row["misaligned"]) == (0, 0, 0), row
    assert row["handed out"] == 2 * 8 * 8 and row["requests/s"] > 0, row


def test_a_simulated_server_answers_like_a_batching_server():
    """One request alone decodes at peak / (1 + half) tokens/s, c of them share peak * c / (c + half);
    an answer's length depends on its prompt only, and a generation continued after a pause (prompt +
    the answer's first part) ends with the very tokens of the uninterrupted one."""
    serving = ServingModel(peak_tokens_per_s=400.0, half_concurrency=4.0, ttft_s=0.0, mean_tokens=40.0, sigma=0.5)
    assert serving.throughput(1) == pytest.approx(80.0) and serving.throughput(4) == pytest.approx(200.0)
    prompt = [11, 12, 13, 14]
    length = serving.answer_tokens(repr(prompt).encode())
    assert length == serving.answer_tokens(repr(prompt).encode()) >= 1
    with SimCluster(1, prompt_len=4, serving=serving, load=WeightLoad(model_bytes=1e9, bytes_per_s=1e10)) as cluster:
        address = cluster.addresses[0]
        whole = _complete(address, prompt)
        assert len(whole["token_ids"]) == length and whole["finish_reason"] == "stop"
        half = whole["token_ids"][: length // 2]
        rest = _complete(address, prompt + half)
        assert half + rest["token_ids"] == whole["token_ids"]
        stats = cluster.stats()[0]
        assert stats["requests"] == 2 and stats["tokens"] == pytest.approx(length + len(rest["token_ids"]))


def _complete(address: str, prompt: list[int]) -> dict:
    return _post(address, "/v1/completions", {"prompt": prompt, "max_tokens": 1000, "model": "sim"})["choices"][0]
