"""Under Slurm, server i is slot i everywhere: its address file ``servers/i.addr``, its log
``slurm/server-i-<job>.log``, its restart records (``server-i``), and the trainer's ``server-i``
(the i-th address of ``$MEGARL_LLM_SERVER_ADDRS``). With 13 servers the shell's glob lists the
address files as 0, 1, 10, 11, 12, 2, ...: the script must list them by slot (no Slurm needed)."""

from __future__ import annotations

import json
import os
import subprocess

from megarl.config.rollout import InferenceEngineConfig
from megarl.launcher.slurm import render_sbatch
from megarl.launcher.watchdog import job_servers
from megarl.serving import make_backend
from megarl.serving.restarts import RESTARTS_FILE
from megarl.serving.servers import ServerSet
from tests.launcher.test_slurm_render import config
from tests.launcher.test_slurm_server_restart import _serve_slot

N = 13
# addresses whose own sort order is not the slot order either (10.0.0.50 is slot 0, 10.0.0.38 slot 12)
ADDRESSES = [f"10.0.0.{50 - i}:{18000 + i}" for i in range(N)]

# a server step that "dies" at once, recording the arguments srun was given
FAKE_SRUN = """#!/bin/bash
echo "$@" >> "$FAKE_DIR/srun-args"
exit 9
"""


def _script(tmp_path, *overrides) -> str:
    layout = (f"allocation_mode=vllm:d{N}t1+megatron:d1p1t1", f"cluster.n_gpus_per_node={N + 1}")
    return render_sbatch(config("gsm8k_grpo_cpu.yaml", *layout, *overrides), tmp_path / "c.yaml")


def _block(script: str, first: str, last: str) -> str:
    """The script's lines from the one starting with ``first`` to the one starting with ``last``."""
    lines = script.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    end = next(i for i, line in enumerate(lines) if i > start and line.startswith(last))
    return "\n".join(lines[start : end + 1])


def _server_addrs(script: str, run_dir, env: str = "MEGARL_LLM_SERVER_ADDRS") -> subprocess.CompletedProcess:
    """Step 2 of ``script`` (wait for every server's address, export them) with its servers' table; prints
    ``ADDRS=`` and what the variable ``env`` holds after it, in a child process as the trainer would."""
    body = "\n".join(
        [
            "set -uo pipefail",
            f"RUN_DIR={run_dir}",
            "PIDS=()",
            _block(script, "SERVERS=(", ")"),
            _block(script, "# 2. wait until every server is healthy", 'echo "megarl: servers at'),
            f"bash -c 'echo ADDRS=${env}'",  # exported: what the trainer, a child, sees
        ]
    )
    return subprocess.run(["bash", "-c", body], capture_output=True, text=True, timeout=60, check=False)


def _write_addresses(run_dir, slots) -> None:
    (run_dir / "servers").mkdir(parents=True, exist_ok=True)
    for i in slots:
        (run_dir / "servers" / f"{i}.addr").write_text(ADDRESSES[i] + "\n")


def _listed(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("ADDRS="))
    return line.removeprefix("ADDRS=").split(",")


def test_the_trainer_gets_the_addresses_in_slot_order(tmp_path):
    _write_addresses(tmp_path / "run", range(N))
    assert _listed(_server_addrs(_script(tmp_path), tmp_path / "run")) == ADDRESSES


def test_the_trainer_finds_them_under_the_variable_the_config_names(tmp_path):
    """``rollout.server_addrs_env``: the trainer reads the list from it (under Slurm the job exported only
    ``MEGARL_LLM_SERVER_ADDRS``, and a run with another name found no servers)."""
    _write_addresses(tmp_path / "run", range(N))
    script = _script(tmp_path, "rollout.server_addrs_env=MY_ADDRS")
    assert _listed(_server_addrs(script, tmp_path / "run", env="MY_ADDRS")) == ADDRESSES


def test_a_slot_without_its_address_is_named(tmp_path):
    """A stray address file (a server started by hand into ``servers/``) does not stand in for a missing slot."""
    _write_addresses(tmp_path / "run", [i for i in range(N) if i != 7])
    (tmp_path / "run" / "servers" / f"{N}.addr").write_text("10.0.0.99:19000\n")
    script = _script(tmp_path).replace("deadline=$((SECONDS + 1800))", "deadline=$SECONDS")  # no waiting
    result = _server_addrs(script, tmp_path / "run")
    assert result.returncode == 1 and "ADDRS=" not in result.stdout
    assert "no address yet from server-7\n" in result.stderr, result.stderr


def test_a_slots_restart_record_log_and_trainer_name_agree(tmp_path):
    """Slot 10 restarted: its record says server-10 with slot 10's address, its log is server-10-<job>.log,
    and the trainer's server 10 (watchdog ``server-10``, rollout's server list, metrics) is that address."""
    run_dir, bin_dir = tmp_path / "run", tmp_path / "bin"
    _write_addresses(run_dir, range(N))
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    script = _script(tmp_path, "launcher.server_restarts=1")
    trainer_side = ServerSet(
        InferenceEngineConfig(), make_backend("vllm"), _listed(_server_addrs(script, run_dir)), run_dir
    )

    body = "\n".join([f"RUN_DIR={run_dir}", "NODES=(n0)", _serve_slot(script), "serve_slot 10 0 10 18010"])
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_DIR=str(tmp_path))
    subprocess.run(["bash", "-c", body], env=env, capture_output=True, text=True, timeout=60, check=False)

    (record,) = [json.loads(line) for line in (run_dir / RESTARTS_FILE).read_text().splitlines()]
    assert (record["server"], record["address"]) == ("server-10", ADDRESSES[10])
    assert f"--output={run_dir}/slurm/server-10-%j.log" in (tmp_path / "srun-args").read_text()
    index = trainer_side.addresses.index(record["address"])
    assert index == 10, f"the trainer calls slot 10's server server-{index}"
    assert job_servers(trainer_side.addresses, "/health")[10].name == "server-10"
    trainer_side.choose()  # reads the restart record
    assert [i for i, s in enumerate(trainer_side._servers) if s.awaiting_push] == [10]
