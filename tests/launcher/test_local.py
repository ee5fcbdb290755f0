"""``megarl run`` (megarl.launcher.local): config errors start nothing; servers, trainer, restarts, faults, teardown.

The trainer is a tiny script (``fake_trainer.py``, written per test) that checks the
server addresses it was given, records each attempt (and the processes it saw or left
behind) and fails, succeeds, sleeps or kills the server as told. The whole ``megarl run``
path, in process and as a process stopped by Ctrl-C or SIGTERM, runs against the fake
server of ``tests/rollout`` (seconds); the real vLLM-CPU tests share one server start-up
(the slow part) through the launcher's own ``running_servers`` and drive ``run_trainer``
on it, the killing test last.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from megarl.config import GRPOConfig, save_config
from megarl.launcher import local
from megarl.launcher.cli import main
from megarl.launcher.local import (
    OutputRelay,
    check_local,
    run_trainer,
    running_servers,
    server_specs,
    startup_lines,
    trainer_env,
)
from megarl.launcher.serve import SHARED_CORES_NICE
from megarl.run.prelaunch import build_config
from megarl.serving.launch import InferenceServer, LaunchSpec, ServerLaunchError
from megarl.utils.auth import run_api_key
from megarl.utils.process import terminate_process_tree

ROOT = Path(__file__).resolve().parents[2]
CPU_YAML = str(ROOT / "configs" / "gsm8k_grpo_cpu.yaml")
FAKE_SERVER = str(ROOT / "tests" / "rollout" / "fake_server.py")
ADDRS_ENV = "TEST_LOCAL_SERVER_ADDRS"  # not the default: the launcher must honour rollout.server_addrs_env

FAKE_TRAINER = """\
import json, os, signal, subprocess, sys, time, urllib.request
from pathlib import Path
import psutil

out = Path(os.environ["FAKE_TRAINER_DIR"])
config = sys.argv[sys.argv.index("--config") + 1]
assert Path(config).is_file(), config
addrs = os.environ["TEST_LOCAL_SERVER_ADDRS"].split(",")
def healthy(addr):
    try:
        with urllib.request.urlopen(f"http://{addr}/health", timeout=30) as resp:
            return resp.status == 200
    except OSError:
        return False

server_was_up = healthy(addrs[0])
deadline = time.monotonic() + 400
for addr in addrs:  # the launcher starts the trainer with the servers: wait for them, as the rollout engine does
    while not healthy(addr):
        assert time.monotonic() < deadline, addr
        time.sleep(0.2)
(out.parent / "setup_timeout").write_text(open(config).read().split("setup_timeout:")[1].split()[0])
port = int(addrs[0].rsplit(":", 1)[1])
server_pid = next(
    c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
)
attempt = len(list(out.glob("attempt-*")))
mode = os.environ["FAKE_TRAINER_MODE"]
record = {"pid": os.getpid(), "server_pid": server_pid, "config": config, "omp": os.environ.get("OMP_NUM_THREADS"),
          "server_was_up": server_was_up}
if mode == "fail-once" and attempt == 0:
    # A worker that outlives its rank, in its own session, holding the rank's stdout (the launcher's pipe).
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    record["orphan"] = sleeper.pid
(out / f"attempt-{attempt}").write_text(json.dumps(record))
print(f"fake trainer attempt {attempt} saw {','.join(addrs)}", flush=True)
if mode == "fail-once":
    sys.exit(1 if attempt == 0 else 0)
if mode == "fail":
    sys.exit(3)
if mode == "user-error":  # as megarl.train does when the user's reward is broken
    print("megarl: the run stopped: reward function my.reward returned None", flush=True)
    (Path(config).parent / "logs" / "stopped.txt").write_text("reward function my.reward returned None")
    sys.exit(1)
if mode == "kill-server":
    os.kill(server_pid, signal.SIGKILL)
time.sleep(300)  # "kill-server" and "sleep": until stopped
"""


def make_config(root: Path, mode: str, *overrides: str) -> GRPOConfig:
    """The CPU example config running ``fake_trainer.py`` in ``mode``, outputs under ``root``."""
    script = root / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    (root / "markers").mkdir(exist_ok=True)
    return build_config(GRPOConfig, [CPU_YAML], config_overrides(root, mode) + list(overrides))


def config_overrides(root: Path, mode: str) -> list[str]:
    return [
        f"cluster.fileroot={root}",
        f"launcher.trainer_entry={root / 'fake_trainer.py'}",
        f"launcher.env.FAKE_TRAINER_DIR={root / 'markers'}",
        f"launcher.env.FAKE_TRAINER_MODE={mode}",
        f"rollout.server_addrs_env={ADDRS_ENV}",
        "vllm.max_model_len=512",
        "gconfig.max_new_tokens=64",
        "train_dataset.max_prompt_tokens=256",
        "vllm.max_num_seqs=4",
        "vllm.cpu_kvcache_space_gb=1",
        "vllm.enforce_eager=true",
        "vllm.startup_timeout=400",
    ]


def pids_of(records: list[dict]) -> list[int]:
    """Every process the fake trainer's attempts saw or started: ranks, servers, orphans."""
    return [r[key] for r in records for key in ("pid", "server_pid", "orphan") if key in r]


def attempts(root: Path) -> list[dict]:
    return [
        json.loads((root / "markers" / f"attempt-{i}").read_text())
        for i in range(len(list((root / "markers").iterdir())))
    ]


def gone(pid: int) -> bool:
    """Exited (a zombie counts: an orphan waiting for a reaper is dead)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def alive_after(pids: list[int], timeout: float = 60.0) -> list[int]:
    """``pids`` still alive after up to ``timeout`` s: a killed vLLM worker starved of its
    one bound core by other processes can take many seconds to finish exiting."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if not gone(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


# --------------------------------------------------------------------------------------
# Config errors: exit 2, one line, nothing started.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["allocation_mode=vllm:d2t1+megatron:d1p1t1"], "= 3 devices"),
        (["actor.optimizer.lrr=1"], "actor.optimizer.lrr"),
        (["cluster.n_nodes=2", "cluster.n_gpus_per_node=1"], "use `megarl slurm`"),
        (["launcher.trainer_entry=/nonexistent/trainer.py"], "is not a file"),
        (["launcher.trainer_entry=megarl.no_such_module"], "nor an importable module"),
    ],
)
def test_bad_config_exits_2_and_starts_nothing(overrides, needle, tmp_path, monkeypatch, capsys):
    def forbidden(*args, **kwargs):
        raise AssertionError("a process was started for a bad config")

    monkeypatch.setattr(subprocess, "Popen", forbidden)
    monkeypatch.setattr(InferenceServer, "start", forbidden)
    assert main(["run", CPU_YAML, f"cluster.fileroot={tmp_path}", *overrides]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.strip().count("\n") == 0, err
    assert not list(tmp_path.iterdir()), "nothing is written for a bad config"


def test_devices_are_those_this_process_may_use(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {6, 7})  # taskset -c 6,7 megarl run ...
    config = make_config(tmp_path, "unused")
    plan = check_local(config)
    assert plan.servers[0].devices == (6,) and plan.trainer_devices == (1,)  # CPU trainer slots are not cores
    assert trainer_env(config, plan, ["h:1"])["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    config = make_config(tmp_path, "unused", "cluster.device=cuda")
    plan = check_local(config)
    assert plan.servers[0].devices == (4,) and plan.trainer_devices == (5,)
    env = trainer_env(config, plan, ["h:1", "h:2"])
    assert env["CUDA_VISIBLE_DEVICES"] == "5" and env[ADDRS_ENV] == "h:1,h:2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    with pytest.raises(ValueError, match=r"shows 1 GPUs to megarl run \(\[4\]\)"):
        check_local(config)


@pytest.mark.parametrize(
    ("policy", "bind", "nice"), [("static", "6", 0), ("elastic", "6", 0), ("shared", "6,7", SHARED_CORES_NICE)]
)
def test_cpu_threads_policy_places_the_server(tmp_path, monkeypatch, policy, bind, nice, run_key):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {6, 7})
    config = make_config(tmp_path, "unused", f"cluster.cpu_threads={policy}")
    [spec] = server_specs(config, check_local(config))
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == bind  # shared: the server computes on every core too
    assert spec.nice == nice  # on the trainer's cores, below the trainer
    assert trainer_env(config, check_local(config), ["h:1"])["OMP_NUM_THREADS"] == "1"  # the share; phases widen it


def test_colocated_server_and_trainer_share_cores_or_gpus(tmp_path, monkeypatch, run_key):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {6, 7})
    colocated = ["allocation_mode=vllm:d1t1|megatron:d1p1t1", "cluster.n_gpus_per_node=1", "cluster.cpu_threads=static"]
    config = make_config(tmp_path, "unused", *colocated)
    plan = check_local(config)
    [spec] = server_specs(config, plan)
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "6,7"  # every core, whatever cluster.cpu_threads says
    assert spec.nice == SHARED_CORES_NICE
    assert trainer_env(config, plan, ["h:1"])["OMP_NUM_THREADS"] == "2"  # every core too: they take turns
    assert "colocated: the servers sleep while it computes" in startup_lines(config, plan)[-1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    config = make_config(
        tmp_path,
        "unused",
        *colocated,
        "cluster.device=cuda",
        "weight_update.mode=disk",
        f"weight_update.disk_path={tmp_path}/weights",
    )
    plan = check_local(config)
    [spec] = server_specs(config, plan)
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "4" and "--enable-sleep-mode" in spec.cmd
    assert spec.nice == 0  # a GPU server's host threads keep their priority
    assert trainer_env(config, plan, ["h:1"])["CUDA_VISIBLE_DEVICES"] == "4"


# --------------------------------------------------------------------------------------
# The whole `megarl run` against the fake server: restart then success, server death, teardown.
# --------------------------------------------------------------------------------------


def fake_server_spec(config, index, devices, host, port) -> LaunchSpec:
    return LaunchSpec(cmd=[sys.executable, FAKE_SERVER, "--port", str(port)], host=host, port=port)


def slow_fake_server_spec(config, index, devices, host, port) -> LaunchSpec:
    """The fake server, up 15 s after its launch (a real one takes ~30 s on 2 cores)."""
    spec = fake_server_spec(config, index, devices, host, port)
    return replace(spec, cmd=["sh", "-c", f"sleep 15 && exec {' '.join(spec.cmd)}"])


@pytest.mark.parametrize(
    "mode,recover,code,n_attempts",
    [
        ("fail-once", ["recover.mode=auto", "recover.retries=1"], 0, 2),
        ("kill-server", ["recover.mode=auto", "launcher.server_restarts=0"], 1, 1),
        ("user-error", ["recover.mode=auto", "recover.retries=1"], 1, 1),  # broken user code: no restart
    ],
)
def test_megarl_run(mode, recover, code, n_attempts, tmp_path, monkeypatch, capsys):
    # with a server slow to start: the trainer starts with it, not after it
    monkeypatch.setattr(local, "server_spec", slow_fake_server_spec if mode == "fail-once" else fake_server_spec)
    monkeypatch.setattr("megarl.utils.logging.setup_logging", lambda *a, **k: None)  # keep the session's logging
    make_config(tmp_path, mode)  # writes the script
    start = time.monotonic()
    assert main(["run", CPU_YAML, *config_overrides(tmp_path, mode), *recover]) == code
    assert time.monotonic() - start < 200, "the trainer sleeps 300 s"
    out, err = capsys.readouterr()
    run_dir = tmp_path / "gsm8k-grpo-cpu" / "trial0"
    records = attempts(tmp_path)
    assert len(records) == n_attempts
    assert all(r["config"] == str(run_dir / "config.yaml") and r["omp"] == "1" for r in records)
    assert float((tmp_path / "setup_timeout").read_text()) == 400  # waits as long as vllm.startup_timeout
    if mode == "fail-once":
        assert [r["server_was_up"] for r in records] == [False, True]
        assert "servers ready in 1" in out  # ~15 s
    assert f"\nfake trainer attempt {n_attempts - 1} saw 127.0.0.1:" in out  # unprefixed: the console is the trainer's
    assert f"fake trainer attempt {n_attempts - 1}" in (run_dir / "logs" / "trainer.log").read_text()
    if mode == "kill-server":
        assert "megarl run: error: server-0 at 127.0.0.1:" in err and "during training" in err
        assert "not restarted: launcher.server_restarts=0 restarts of server-0 are spent" in err
    elif mode == "user-error":  # the trainer's reason ends the console, not the launcher's tail of its log
        assert out.rstrip().endswith(f"megarl run: the trainer stopped for the reason above (logs in {run_dir}/logs)")
        assert "megarl: the run stopped: reward function my.reward returned None" in out
        assert "trainer exited with status" not in out + err and not (run_dir / "logs" / "stopped.txt").exists()
    else:  # a server stopped at the end of the run says so in its log, not on the console
        assert "fake server: shut down" in (run_dir / "logs" / "server-0.log").read_text()
        assert "shut down" not in out
    assert alive_after(pids_of(records)) == []


def test_server_dying_while_the_trainer_starts_fails_the_run(tmp_path, monkeypatch, capsys):
    def dying_spec(config, index, devices, host, port) -> LaunchSpec:
        return LaunchSpec(cmd=["sh", "-c", "sleep 2; echo 'no model here' >&2; exit 3"], host=host, port=port)

    monkeypatch.setattr(local, "server_spec", dying_spec)
    monkeypatch.setattr("megarl.utils.logging.setup_logging", lambda *a, **k: None)
    make_config(tmp_path, "sleep")
    start = time.monotonic()
    assert main(["run", CPU_YAML, *config_overrides(tmp_path, "sleep")]) == 1
    assert time.monotonic() - start < 60, "the trainer waiting for the server must have been stopped"
    err = capsys.readouterr().err
    assert "server-0 at 127.0.0.1:" in err and "exited with code 3 before it was healthy" in err
    assert "no model here" in err  # the end of its log
    assert attempts(tmp_path) == []  # the trainer never got past its wait


# `megarl run` as its own process, stopped by Ctrl-C or SIGTERM while training.
WRAPPER = """\
import sys
from megarl.launcher import local
from megarl.launcher.cli import main
from tests.launcher.test_local import fake_server_spec
local.server_spec = fake_server_spec
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_signal_stops_everything(sig, code, tmp_path):
    make_config(tmp_path, "sleep")
    argv = ["run", CPU_YAML, *config_overrides(tmp_path, "sleep")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen(
        [sys.executable, "-c", WRAPPER, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        marker = tmp_path / "markers" / "attempt-0"
        deadline = time.monotonic() + 150
        while not marker.exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), launcher.communicate(timeout=60)[0].decode()
        launcher.send_signal(sig)
        output = launcher.communicate(timeout=90)[0].decode()
    finally:
        terminate_process_tree(launcher)
    assert launcher.returncode == code, output
    [record] = attempts(tmp_path)
    assert alive_after([record["pid"], record["server_pid"]]) == [], output
    after = output.split("fake trainer attempt 0 saw", 1)[1].splitlines()[1:]
    assert after == (
        ["megarl run: interrupted; every server and trainer process was stopped"] if sig == signal.SIGINT else []
    ), output  # one line, no traceback


# --------------------------------------------------------------------------------------
# A real vLLM-CPU server (SmolLM2-135M), started once by the launcher's running_servers.
# --------------------------------------------------------------------------------------


class LiveServers:
    """Servers of the shared run, and how to stop them (the killing test does, last)."""

    def __init__(self, root: Path):
        self.root = root
        self.out = io.StringIO()
        self.relay = OutputRelay(self.out)
        config = make_config(root, "unused")
        self.plan = check_local(config)
        self.stack = ExitStack()
        self.stack.enter_context(run_api_key())  # as run_local: servers and trainers share the run's key
        self.servers = self.stack.enter_context(running_servers(config, server_specs(config, self.plan), self.relay))
        leaders = [psutil.Process(s.proc.pid) for s in self.servers]
        self.pids = [p.pid for leader in leaders for p in [leader, *leader.children(recursive=True)]]

    def run(self, name: str, mode: str, *overrides: str) -> tuple[Path, int]:
        """``run_trainer`` with a fresh fake trainer in ``mode``; returns its root dir and exit status."""
        root = self.root / name
        root.mkdir()
        config = make_config(root, mode, *overrides)
        return root, run_trainer(config, save_config(config).resolve(), self.plan, self.servers, self.relay)

    def close(self) -> None:
        self.stack.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    servers = LiveServers(tmp_path_factory.mktemp("live"))
    yield servers
    servers.close()


@pytest.mark.slow  # a real vLLM server under the launcher: ~2 min with its start
@pytest.mark.vllm
def test_vllm_trainer_restarts_then_succeeds(live):
    assert all(s.proc.poll() is None for s in live.servers), "the shared server was stopped by an earlier test"
    root, code = live.run("restart", "fail-once", "recover.mode=auto", "recover.retries=2")
    assert code == 0
    records = attempts(root)
    assert len(records) == 2 and alive_after([records[0]["orphan"], *(r["pid"] for r in records)]) == []
    out = live.out.getvalue()
    assert "[server-0] " in out and "[trainer] fake trainer attempt 1 saw " in out
    assert all(s.proc.poll() is None for s in live.servers), "servers stay up across trainer restarts"


@pytest.mark.slow  # a real vLLM server under the launcher: ~2 min with its start
@pytest.mark.vllm
def test_vllm_trainer_failure_is_the_exit_code(live):
    assert all(s.proc.poll() is None for s in live.servers), "the shared server was stopped by an earlier test"
    root, code = live.run("fail", "fail", "recover.mode=disabled", "recover.retries=3")
    assert code == 1  # torchrun's status when a rank fails (the rank exited 3)
    records = attempts(root)
    assert len(records) == 1 and alive_after([records[0]["pid"]]) == []


@pytest.mark.slow  # a real vLLM server under the launcher: ~2 min with its start
@pytest.mark.vllm
def test_vllm_server_death_stops_the_trainer_and_teardown_leaves_nothing(live):
    """Kills the shared server: keep this test last."""
    server_tree = {p.pid for p in psutil.Process(live.servers[0].proc.pid).children(recursive=True)}
    start = time.monotonic()
    with pytest.raises(ServerLaunchError, match=r"server-0 at 127\.0\.0\.1:\d+ exited with code -9 during training"):
        live.run("kill", "kill-server", "recover.mode=auto", "launcher.server_restarts=0")
    assert time.monotonic() - start < 200, "the trainer sleeps 300 s: it must have been stopped"
    [record] = attempts(live.root / "kill")
    assert alive_after([record["pid"]]) == []
    assert record["server_pid"] in server_tree  # the process serving its port (vLLM's API server starts it)
    live.close()  # the engine core and workers the dead server left behind go too
    assert alive_after(live.pids) == []


@pytest.mark.parametrize("tty", [False, True])
def test_relay_passes_the_trainer_console_through(tty, tmp_path):
    out = io.StringIO()
    out.isatty = lambda: tty  # type: ignore[method-assign]
    relay = OutputRelay(out, verbose=False)
    read_fd, write_fd = os.pipe()
    log = open(tmp_path / "trainer.log", "wb")  # noqa: SIM115
    thread = relay.console("trainer", os.fdopen(read_fd, "rb"), log)
    chunks = [
        b"\rtrain 0/2 [00",
        b":10] rollout 1/4\rtrain 0/2 [00:20] rollout 2/4",
        b"\n\nstep 1/2  rew",
        "ard 0.5 \u2588\n".encode()[:-2],
        "ard 0.5 \u2588\n".encode()[-2:],
        b"megarl: finished",
    ]
    with os.fdopen(write_fd, "wb", buffering=0) as w:
        for chunk in chunks:
            w.write(chunk)
            time.sleep(0.05)
    thread.join(5)
    log.close()
    text = out.getvalue()
    logged = (tmp_path / "trainer.log").read_text()
    assert logged.splitlines() == ["train 0/2 [00:20] rollout 2/4", "step 1/2  reward 0.5 \u2588", "megarl: finished"]
    if tty:  # byte for byte: the bar redraws in place
        assert text.startswith("\rtrain 0/2 [00:10] rollout 1/4\rtrain") and "step 1/2  reward 0.5 \u2588\n" in text
    else:  # whole lines only, a carriage return ends one
        assert text.splitlines() == [
            "train 0/2 [00:10] rollout 1/4",
            "train 0/2 [00:20] rollout 2/4",
            "step 1/2  reward 0.5 \u2588",
            "megarl: finished",
        ]
