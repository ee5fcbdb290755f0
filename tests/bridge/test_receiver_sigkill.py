"""One of 16 receivers SIGKILLed mid-transfer in sharded mode: the update fails on it alone, in time.

16 fake vLLM server processes (``fake_vllm.py``: megarl's real receiver over a real gloo group of 17
ranks, megarl's one-call update route; 15 of them forked from one process, so that they start in
seconds) and a one-rank trainer driving them through the run's own
:class:`~megarl.run.weight_sync.WeightSync` (``sigkill_workers.py``; it starts while the servers do
and waits for them). Update 1 reaches all 16. In
update 2 one server stops after two buckets and the test kills its process with ``SIGKILL``
(nothing of it runs again: no cleanup, its sockets reset by the kernel). Update 2 must come back well
within ``weight_update.update_timeout``, with the dead server failed and out of rotation, the run
going on; update 3 goes to the 15 survivors (the bridge reconnected) and every one holds version 3's
weights. The bridge forms a group per block of 4 servers: update 3 re-forms the victim's block alone, so
its 3 survivors are initialised a second time and the 12 others are not called.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
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
SERVERS = 16
VICTIM = 5
"""Which server is killed (not the first: the first is the bridge's reference server)."""
UPDATE_TIMEOUT = 60.0
PER_GROUP = 4
"""``weight_update.servers_per_group``: servers 4-7 are the victim's block."""


def _start(tmp_path: Path, ports: list[int], stall_marker: Path | None = None) -> InferenceServer:
    """The victim (one server that stalls in update 2, ``stall_marker``) or the fleet of plain servers on
    ``ports``, each a process forked from one (torch imported once)."""
    cmd = [sys.executable, str(HERE / "fake_vllm.py")]
    if stall_marker is not None:
        (port,) = ports
        stall = ["--stall-after-buckets", "2", "--die-in-update", "2", "--marker", str(stall_marker)]
        cmd += ["--port", str(port), *stall]
    else:
        cmd += ["--ports", ",".join(map(str, ports))]
    spec = LaunchSpec(cmd=cmd, port=ports[0])
    return InferenceServer(spec, tmp_path / f"fake-{ports[0]}.log", name="fake-vllm").start()


def _kill_when_stalled(marker: Path, killed: dict, stop: threading.Event) -> None:
    """SIGKILL the process whose pid appears in ``marker`` (the stalled receiver), from outside it."""
    while not stop.is_set():
        if marker.exists():
            pid = int(marker.read_text())
            os.kill(pid, signal.SIGKILL)
            killed.update(pid=pid, at=time.time())
            return
        time.sleep(0.02)


def test_a_receiver_sigkilled_mid_transfer_fails_alone(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama", vocab_size=1001)
    reader = SafetensorsReader(model_dir)
    hf = {n: reader(n, None, 0, 0) for n in reader.keys()}  # noqa: SIM118 (the reader is not iterable)
    marker = tmp_path / "stalled.pid"
    ports = find_free_ports(SERVERS)
    addresses = [f"127.0.0.1:{port}" for port in ports]
    started = time.perf_counter()
    servers = [_start(tmp_path, [ports[VICTIM]], marker), _start(tmp_path, ports[:VICTIM] + ports[VICTIM + 1 :])]
    killed, stop = {}, threading.Event()
    killer = threading.Thread(target=_kill_when_stalled, args=(marker, killed, stop), daemon=True)
    try:
        killer.start()
        ((waited, updates),) = run_ranks(
            1,
            "tests.bridge.sigkill_workers:sync_through_a_kill",
            timeout=300,
            model_dir=str(model_dir),
            addresses=addresses,
            dump_dir=str(tmp_path),
            update_timeout=UPDATE_TIMEOUT,
            servers_per_group=PER_GROUP,
        )
    finally:
        stop.set()
        for server in servers:
            server.stop()
    victim = addresses[VICTIM]
    survivors = [a for a in addresses if a != victim]
    first, second, third = updates
    summary = "\n".join(
        f"update {u['version']}: {u['seconds']:.1f}s error={u['error']} report={u['report']} "
        f"held_out={u['held_out']} lost_workers={u['lost_workers']}"
        for u in updates
    )
    print(
        f"{SERVERS} servers up and three updates done in {time.perf_counter() - started:.1f}s ({waited:.1f}s till up)"
    )
    print(summary)
    assert killed, f"the stalled receiver never announced itself\n{summary}"

    assert first["error"] is None and first["report"]["ok"], summary
    assert sorted(first["report"]["updated"]) == sorted(addresses)

    # the killed receiver fails the update on its own, well within its timeout; the run goes on
    assert second["error"] is None, summary
    assert second["seconds"] < UPDATE_TIMEOUT / 2, summary
    assert list(second["report"]["failed"]) == [victim], summary
    assert sorted(second["report"]["updated"]) == sorted(survivors), summary
    assert second["report"]["sender_errors"] == [], summary
    # the sender lost the dead worker alone, if it saw it die
    assert set(second["lost_workers"]) <= {f"{victim} rank 0"}, summary
    assert second["held_out"] == [victim], summary  # evicted from rotation
    assert second["engine_version"] == second["rollout_version"] == 2
    for address in survivors:  # the survivors took the whole update (no one half-updated)
        _check_dump(tmp_path, 2, address, hf)

    # the bridge reconnected to the 15 survivors; all of them hold version 3
    assert third["error"] is None and third["report"]["ok"], summary
    assert sorted(third["bridge_servers"]) == sorted(survivors), summary
    assert sorted(third["report"]["updated"]) == sorted(survivors)
    assert third["held_out"] == [victim] and third["engine_version"] == third["rollout_version"] == 3
    assert sorted(third["dumped"]) == sorted(survivors)
    for address in survivors:
        _check_dump(tmp_path, 3, address, hf)
    # only the victim's block re-formed: its survivors joined new groups, the other blocks kept theirs
    block = VICTIM // PER_GROUP * PER_GROUP
    rejoined = {a for a in addresses[block : block + PER_GROUP] if a != victim}
    inits = {a: torch.load(tmp_path / f"v3-{a.replace(':', '_')}.pt")["inits"] for a in survivors}
    assert inits == {a: 2 if a in rejoined else 1 for a in survivors}, inits


def _check_dump(tmp_path: Path, version: int, address: str, hf: dict) -> None:
    """The server at ``address`` committed ``version`` and holds that version's weights (the checkpoint's
    times the version; a TP-1 server's local tensors are whole HF tensors, fused ones concatenated)."""
    dump = torch.load(tmp_path / f"v{version}-{address.replace(':', '_')}.pt")
    assert dump["version"] == str(version), (address, dump["version"])
    scale = float(version)
    embed = dump["weights"]["model.embed_tokens.weight", None]
    want = hf["model.embed_tokens.weight"]
    assert torch.equal(embed[: want.shape[0]], (want * scale).to(WIRE)), address
    lm_head = dump["weights"]["lm_head.weight", None]
    assert torch.equal(lm_head[: want.shape[0]], (hf["lm_head.weight"] * scale).to(WIRE)), address
    down = dump["weights"]["model.layers.3.mlp.down_proj.weight", None]
    assert torch.equal(down, (hf["model.layers.3.mlp.down_proj.weight"] * scale).to(WIRE)), address
