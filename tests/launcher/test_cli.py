"""The ``megarl`` console script: help, config printing, allocation checks, clear errors."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.launcher.cli import main

CPU_YAML = str(Path(__file__).resolve().parents[2] / "configs" / "gsm8k_grpo_cpu.yaml")


def test_console_script_help():
    exe = shutil.which("megarl", path=str(Path(sys.executable).parent))
    assert exe, "the megarl console script is not installed"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("config", "allocation", "models"):
        assert command in out


def test_import_is_light():
    """`import megarl` must not drag in torch, vLLM or Megatron (CLI start-up time)."""
    code = "import sys, megarl; print(','.join(m for m in ('torch', 'vllm', 'megatron') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""


def test_config_prints_resolved_yaml(capsys):
    assert main(["config", "--config", CPU_YAML, "gconfig.n_samples=7"]) == 0
    assert "n_samples: 7" in capsys.readouterr().out


def test_config_save_writes_run_dir(tmp_path, capsys):
    argv = ["config", "--save", "--config", CPU_YAML, f"cluster.fileroot={tmp_path}"]
    assert main(argv) == 0
    assert (tmp_path / "gsm8k-grpo-cpu" / "trial0" / "config.yaml").is_file()


def test_config_takes_leading_yaml_files_as_run_does(capsys):
    assert main(["config", CPU_YAML, "gconfig.n_samples=7"]) == 0
    assert "n_samples: 7" in capsys.readouterr().out


def test_run_check_checks_and_starts_and_writes_nothing(tmp_path, capsys):
    assert main(["run", "--check", CPU_YAML, f"cluster.fileroot={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "1 vllm server(s) of TP 1" in out and "nothing was started" in out
    assert list(tmp_path.iterdir()) == []
    assert main(["run", "--check", CPU_YAML, "launcher.trainer_entry=nowhere.py"]) == 2  # the launch's own checks
    assert "launcher.trainer_entry 'nowhere.py' is not a file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["config", "--config", CPU_YAML, "actor.optimizer.lrr=1"], "actor.optimizer.lrr"),
        (["config", "--config", "missing.yaml"], "'missing.yaml' does not exist"),
        (["allocation", "vllm:d4t2+megatron:d2p2t2", "--nodes", "1", "--gpus-per-node", "8"], "= 16 devices"),
        (["allocation", "vllm:d4q2"], "unknown size 'q'2"),
        (["allocation", "vllm:d1t1", "--nodes", "1"], "--nodes and --gpus-per-node go together"),
        (["config", "--config", str(Path(CPU_YAML).parent)], "is a directory; expected a YAML file"),
        (["allocation", "vllm:d1t1", "--model", "/nonexistent"], "'/nonexistent' is not a directory"),
    ],
)
def test_errors_exit_2_and_name_the_value(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (
            ["serve", "--port", "1", "--devices", "a,b"],
            "argument --devices: 'a,b': expected comma-separated device ids",
        ),
        (["plan", "--rates", "r.yaml", "--top", "0"], "argument --top: '0': expected a whole number >= 1"),
        (["plan", "--rates", "r.yaml", "--devices", "0"], "argument --devices: '0': expected a whole number >= 1"),
        (["allocation", "vllm:d1t1", "--nodes", "-1", "--gpus-per-node", "2"], "argument --nodes: '-1'"),
    ],
)
def test_bad_arguments_are_refused_by_argparse_naming_them(argv, needle, capsys):
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    assert f"megarl {argv[0]}: error: {needle}" in capsys.readouterr().err


def test_allocation_table(capsys):
    assert main(["allocation", "vllm:d48t2+megatron:d4p2t4", "--nodes", "16", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "48 servers x TP 2" in out and "128" in out


def test_serve_join_names_a_missing_run_and_another_runs_directory(tmp_path, capsys):
    assert main(["serve", "--join", str(tmp_path / "nowhere")]) == 2
    assert f"no {tmp_path / 'nowhere' / 'config.yaml'}" in capsys.readouterr().err
    assert main(["config", "--save", "--config", CPU_YAML, f"cluster.fileroot={tmp_path}"]) == 0
    copied = tmp_path / "copy"
    copied.mkdir()
    shutil.copy(tmp_path / "gsm8k-grpo-cpu" / "trial0" / "config.yaml", copied / "config.yaml")
    assert main(["serve", "--join", str(copied)]) == 2
    err = capsys.readouterr().err
    assert "the config names run directory" in err and str(tmp_path / "gsm8k-grpo-cpu" / "trial0") in err


def test_a_joining_server_takes_the_index_past_the_servers_and_earlier_joins(tmp_path):
    from megarl.config import GRPOConfig
    from megarl.launcher.serve import joined_index
    from megarl.run.prelaunch import load_expr_config
    from megarl.serving.restarts import JOINS_FILE, append_record

    config, _ = load_expr_config(["--config", CPU_YAML, f"cluster.fileroot={tmp_path}"], GRPOConfig)
    servers = config.allocation.inference.dp
    assert joined_index(config) == servers  # reserved: the next one is past it
    for event in ("join", "leave", "join"):  # a leave does not free its index: logs and records keep their names
        append_record(config.run_dir / JOINS_FILE, {"event": event, "server": "s", "address": "h:1"})
    assert joined_index(config) == servers + 3  # the reservation and the two joins


def test_two_servers_joining_together_get_two_indices(tmp_path):
    """Each join reserves its index when it starts (its join line comes once it is healthy, minutes later):
    two started together are server-N and server-N+1, not both server-N."""
    from megarl.config import GRPOConfig
    from megarl.launcher.serve import joined_index
    from megarl.run.prelaunch import load_expr_config
    from megarl.serving.restarts import JOINS_FILE, append_record

    config, _ = load_expr_config(["--config", CPU_YAML, f"cluster.fileroot={tmp_path}"], GRPOConfig)
    servers = config.allocation.inference.dp
    first, second = joined_index(config), joined_index(config)
    assert (first, second) == (servers, servers + 1)
    append_record(config.run_dir / JOINS_FILE, {"event": "join", "server": f"server-{first}", "address": "h:1"})
    assert joined_index(config) == servers + 2  # the first's join line does not count it twice


def test_the_console_script_takes_context_parallel_and_names_what_it_cannot_split(tmp_path):
    """``megarl config`` as a user types it: a CP layout is a run; asking it to share a group's prompt
    is refused, naming the key, the value and why."""
    exe = shutil.which("megarl", path=str(Path(sys.executable).parent))
    argv = [
        exe,
        "config",
        "--config",
        CPU_YAML,
        "allocation_mode=vllm:d1t1+megatron:d1p1t1c2",
        "cluster.n_gpus_per_node=3",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert "megatron:d1p1t1c2" in result.stdout
    argv.append("actor.mb_spec.share_prefix=true")
    result = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.startswith("megarl config: error: config error at 'actor.mb_spec.share_prefix':"), (
        result.stderr
    )
    assert "context parallel c2 cannot split" in result.stderr


def test_arealS_launcher_modules_start_a_script_as_megarl_does(tmp_path):
    """``python -m megarl.launcher.local <script> --config <file>`` (AReaL's command, areal -> megarl) is
    ``megarl run --config <file> launcher.trainer_entry=<script>``; ``.slurm`` is ``megarl slurm``'s. Without
    a script: usage, status 2 (it used to exit 0 having done nothing)."""
    script = Path(__file__).resolve().parents[2] / "examples" / "areal" / "gsm8k_rl.py"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    common = [str(script), "--config", str(Path(CPU_YAML).resolve()), f"cluster.fileroot={tmp_path}"]

    def launch(module: str, *argv: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", f"megarl.launcher.{module}", *argv]
        return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env)

    local = launch("local", *common, "--check")
    assert local.returncode == 0 and "the config checks out" in local.stdout, local.stderr
    slurm = launch("slurm", *common, "--dry-run")
    assert slurm.returncode == 0 and f"{script} --config {tmp_path}" in slurm.stdout, slurm.stderr
    bare = launch("local")
    assert bare.returncode == 2 and "python -m megarl.launcher.local SCRIPT --config FILE" in bare.stderr
