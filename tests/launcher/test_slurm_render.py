"""The rendered sbatch script: header, placement, ordering, failure handling (no Slurm needed)."""

import subprocess
from pathlib import Path

import pytest

from megarl.config import GRPOConfig
from megarl.launcher.cli import main
from megarl.launcher.slurm import render_sbatch
from megarl.run.prelaunch import load_expr_config

REPO = Path(__file__).resolve().parents[2]


def config(name, *overrides):
    cfg, _ = load_expr_config(["--config", str(REPO / "configs" / name), *overrides], GRPOConfig)
    return cfg


def test_128gpu_script(tmp_path):
    cfg = config("gsm8k_grpo_qwen2.5-7b_128gpu.yaml", "launcher.slurm.partition=gpu", "launcher.slurm.account=rl")
    script = render_sbatch(cfg, tmp_path / "config.yaml", requeue=True)
    for line in [
        "#SBATCH --nodes=16",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=rl",
        "#SBATCH --requeue",
        "#SBATCH --exclusive",
    ]:
        assert line in script.splitlines()
    # vllm:d64t1+megatron:d16p1t4: 64 one-GPU servers on nodes 0-7, the trainer on nodes 8-15
    assert script.count('\n  "') == 64  # one row per vLLM server
    assert '  "0 0 0 18000"' in script and '  "63 7 7 18007"' in script
    assert "torchrun --nnodes=8 --nproc-per-node=8" in script
    assert 'MEGARL_TRAIN_MASTER="${NODES[8]}"' in script and "-m megarl.train" in script
    assert f"--config {tmp_path / 'config.yaml'}" in script
    assert f"--log-dir={cfg.run_dir.resolve() / 'logs' / 'torchrun'} " in script  # torchrun's files: the run's
    # servers start, become healthy, then the trainer starts; the first step to end decides
    assert script.index("megarl serve") < script.index("MEGARL_LLM_SERVER_ADDRS") < script.index("torchrun")
    assert "wait -n" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # valid bash


def test_colocated_128gpu_script_puts_servers_and_trainer_on_every_node(tmp_path):
    cfg = config(
        "gsm8k_grpo_qwen2.5-7b_128gpu.yaml",
        "allocation_mode=vllm:d64t2|megatron:d8p2t8",
        "weight_update.mode=disk",
        "weight_update.disk_path=/dev/shm/megarl",
        "weight_update.extra_modes=[]",
    )
    script = render_sbatch(cfg, tmp_path / "config.yaml")
    assert script.count('\n  "') == 64 and '  "0 0 0,1 18000"' in script and '  "63 15 6,7 18006"' in script
    assert "torchrun --nnodes=16 --nproc-per-node=8" in script and "NODES[0]},${NODES[1]}" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_cpu_script_has_no_gpu_request(tmp_path):
    script = render_sbatch(config("gsm8k_grpo_cpu.yaml"), tmp_path / "c.yaml")
    assert "--gpus-per-node" not in script and "CUDA_VISIBLE_DEVICES" not in script
    assert "torchrun --nnodes=1 --nproc-per-node=1" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_requeue_needs_auto_recover(tmp_path):
    with pytest.raises(ValueError, match="--requeue needs recover.mode=auto.*'disabled'"):
        render_sbatch(config("gsm8k_grpo_cpu.yaml"), tmp_path / "c.yaml", requeue=True)


def test_watchdog_runs_beside_the_trainer(tmp_path):
    """``megarl watchdog`` watches the trainer step; abort exits 3, restart requeues; CUDA ranks keep NCCL's flight recorder."""
    cpu = render_sbatch(config("gsm8k_grpo_cpu.yaml", "watchdog.action=abort"), tmp_path / "c.yaml")
    assert f'megarl watchdog --config {tmp_path / "c.yaml"} --trainer-pid "$TRAINER" &' in cpu
    assert cpu.index("TRAINER=$!") < cpu.index("megarl watchdog") < cpu.index('wait "$TRAINER"')
    assert 'if [ -f "$RUN_DIR/watchdog.stopped" ]; then' in cpu and "  exit 3" in cpu and "scontrol requeue" not in cpu
    assert "TORCH_FR_BUFFER_SIZE" not in cpu, "no flight recorder on CPU (gloo)"
    subprocess.run(["bash", "-n"], input=cpu, text=True, check=True)
    with pytest.raises(
        ValueError, match="watchdog.action=restart under Slurm requeues the job: render it with --requeue"
    ):
        render_sbatch(
            config("gsm8k_grpo_cpu.yaml", "watchdog.action=restart", "recover.mode=auto"), tmp_path / "c.yaml"
        )
    gpu = render_sbatch(
        config("gsm8k_grpo_qwen2.5-7b_128gpu.yaml", "watchdog.action=restart"), tmp_path / "g.yaml", requeue=True
    )
    assert 'scontrol requeue "$SLURM_JOB_ID"' in gpu
    assert gpu.index("export TORCH_FR_BUFFER_SIZE=2000") < gpu.index("torchrun")
    assert "nccl_trace/rank_" in gpu
    off = render_sbatch(config("gsm8k_grpo_cpu.yaml", "watchdog.enabled=false"), tmp_path / "c.yaml")
    assert "megarl watchdog" not in off and 'if [ -f "$RUN_DIR/watchdog.stopped" ]' not in off


def test_script_entry_path_and_env(tmp_path):
    cfg = config("gsm8k_grpo_cpu.yaml", "launcher.trainer_entry=my/train.py", "launcher.env.FOO=bar")
    script = render_sbatch(cfg, tmp_path / "c.yaml")
    assert "my/train.py --config" in script and "-m my/train.py" not in script
    assert "export FOO=bar" in script


def test_one_run_key_reaches_every_server_and_the_trainer(tmp_path):
    """Exported before any step starts (srun hands a step the script's environment), kept if the submitter set
    it, saved for joining servers readable by its owner only, and never written into the script."""
    script = render_sbatch(config("gsm8k_grpo_qwen2.5-7b_128gpu.yaml"), tmp_path / "c.yaml")
    lines = script.splitlines()
    export = next(i for i, line in enumerate(lines) if line.startswith('export MEGARL_API_KEY="${MEGARL_API_KEY:-'))
    steps = [i for i, line in enumerate(lines) if line.lstrip().startswith("srun ")]
    assert steps and all(export < i for i in steps) and "--export" not in script
    assert any("megarl serve" in lines[i + 1] for i in steps) and any("-m megarl.train" in lines[i] for i in steps)
    assert '(umask 077; echo "$MEGARL_API_KEY" > "$RUN_DIR/api_key")' in script


def test_network_interface_for_servers_and_collectives(tmp_path, monkeypatch, run_key):
    """The cluster interface: servers bind its address (never 0.0.0.0), gloo and NCCL use it unless
    launcher.env says otherwise."""
    from megarl.launcher.serve import server_host, server_spec

    cfg = config("gsm8k_grpo_cpu.yaml", "launcher.slurm.network_interface=lo", "launcher.env.NCCL_SOCKET_IFNAME=eth9")
    script = render_sbatch(cfg, tmp_path / "c.yaml")
    assert "export GLOO_SOCKET_IFNAME=lo" in script.splitlines()
    assert "export NCCL_SOCKET_IFNAME=eth9" in script.splitlines() and "NCCL_SOCKET_IFNAME=lo" not in script
    assert script.index("GLOO_SOCKET_IFNAME") < script.index("megarl serve")
    assert "export MEGARL_NETWORK_INTERFACE=lo" in script.splitlines(), "every announced address, the bridge's too"
    monkeypatch.delenv("MEGARL_HOST_IP", raising=False)
    from megarl.utils.network import gethostip

    monkeypatch.setenv("MEGARL_NETWORK_INTERFACE", "lo")
    assert gethostip() == "127.0.0.1", "the interface the script exports wins over the default route"
    monkeypatch.delenv("MEGARL_NETWORK_INTERFACE")
    host = server_host(cfg)
    assert host == "127.0.0.1"
    cmd = server_spec(cfg, 0, [0], host, 18000).cmd
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert "GLOO_SOCKET_IFNAME" not in render_sbatch(config("gsm8k_grpo_cpu.yaml"), tmp_path / "c.yaml")


def test_dry_run_cli_prints_without_writing(tmp_path, capsys):
    argv = [
        "slurm",
        "--dry-run",
        "--config",
        str(REPO / "configs" / "gsm8k_grpo_cpu.yaml"),
        f"cluster.fileroot={tmp_path}",
    ]
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("watchdog", ["warn", "abort"])
def test_a_failed_trainer_requeues_a_requeueable_job_within_recover_retries(tmp_path, watchdog):
    """With ``--requeue`` the script's last lines requeue the job after a failed trainer while
    ``SLURM_RESTART_COUNT`` < ``recover.retries``; a trainer that finished, or a job rendered without
    ``--requeue``, is never requeued (run with a fake ``scontrol`` that records its arguments)."""
    overrides = ("recover.mode=auto", "recover.retries=2", f"watchdog.action={watchdog}")
    requeueable = render_sbatch(config("gsm8k_grpo_cpu.yaml", *overrides), tmp_path / "c.yaml", requeue=True)
    plain = render_sbatch(config("gsm8k_grpo_cpu.yaml", *overrides), tmp_path / "c.yaml")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text('#!/bin/sh\necho "$@" >> "$CALLS"\n')
    (fake / "scontrol").chmod(0o755)

    def last_lines(script: str, status: int, restarts: int) -> tuple[int, list[str]]:
        tail = script[script.index('echo "megarl: trainer exited with status $status"') :]
        calls = tmp_path / "calls"
        calls.unlink(missing_ok=True)
        env = {
            "PATH": f"{fake}:/usr/bin:/bin",
            "CALLS": str(calls),
            "SLURM_JOB_ID": "42",
            "SLURM_RESTART_COUNT": str(restarts),
        }
        done = subprocess.run(["bash", "-c", f"status={status}\n{tail}"], env=env, capture_output=True, text=True)
        return done.returncode, calls.read_text().splitlines() if calls.exists() else []

    assert last_lines(requeueable, 1, 0) == (1, ["requeue 42"])
    assert last_lines(requeueable, 1, 1) == (1, ["requeue 42"])
    assert last_lines(requeueable, 1, 2) == (1, []), "recover.retries spent"
    assert last_lines(requeueable, 0, 0) == (0, []), "a finished trainer is not requeued"
    assert last_lines(plain, 1, 0) == (1, []), "rendered without --requeue"


def test_the_conversion_job_runs_on_the_ranks_that_wrote_the_point(tmp_path):
    """``megarl slurm --convert-point``: the point's world size decides the job's nodes and ranks per node."""
    from megarl.launcher.slurm import render_convert_sbatch

    cfg = config("gsm8k_grpo_qwen2.5-7b_128gpu.yaml", "launcher.slurm.partition=gpu")
    script = render_convert_sbatch(cfg, tmp_path / "convert.yaml", 64)  # the trainer's d16p1t4 ranks
    assert "#SBATCH --nodes=8" in script.splitlines() and "#SBATCH --gpus-per-node=8" in script.splitlines()
    assert (
        "#SBATCH --partition=gpu" in script and f"--job-name={cfg.experiment_name}-{cfg.trial_name}-convert" in script
    )
    assert "torchrun --nnodes=8 --nproc-per-node=8" in script and "CUDA_VISIBLE_DEVICES" not in script
    assert f"-m megarl.run.convert_point --config {tmp_path / 'convert.yaml'}" in script
    assert "megarl serve" not in script and script.rstrip().endswith("exit $status")
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    cpu = render_convert_sbatch(config("gsm8k_grpo_cpu.yaml"), tmp_path / "c.yaml", 2)
    assert "#SBATCH --nodes=1" in cpu and "torchrun --nnodes=1 --nproc-per-node=2" in cpu
    with pytest.raises(ValueError, match="written by 12 ranks, which 8 GPUs a node"):
        render_convert_sbatch(cfg, tmp_path / "convert.yaml", 12)


def test_the_job_holds_its_run_directory_as_megarl_run_does(tmp_path):
    """The script's lock lines, run by bash: a job refuses a directory a live ``megarl run`` holds, and
    while a job holds it ``megarl run``'s lock (the same flock) names the job."""
    from megarl.run.earlier_run import RunDirInUse, lock_run_dir

    script = render_sbatch(config("gsm8k_grpo_cpu.yaml"), tmp_path / "c.yaml").splitlines()
    start = script.index("# the run directory is this job's while it runs: a second start of the trial is refused")
    hold = "\n".join(script[start : script.index("fi", start) + 1])
    env = {"RUN_DIR": str(tmp_path), "SLURM_JOB_ID": "7", "PATH": "/usr/bin:/bin"}
    lock = lock_run_dir(tmp_path)
    refused = subprocess.run(["bash", "-c", f"{hold}\necho went on"], env=env, capture_output=True, text=True)
    assert refused.returncode == 1 and "went on" not in refused.stdout
    assert f"{tmp_path} is in use by a run that is still going (pid " in refused.stderr
    lock.release()
    job = subprocess.Popen(
        ["bash", "-c", f"{hold}\necho holding; sleep 30"], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert job.stdout.readline() == "holding\n"
        with pytest.raises(RunDirInUse, match=r"in use by a run that is still going \(slurm job 7 on "):
            lock_run_dir(tmp_path)
    finally:
        job.kill()
        job.wait()
    lock_run_dir(tmp_path).release()  # the job's end freed it
