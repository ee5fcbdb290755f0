"""The ``megarl`` console script: help, config printing, allocation checks, clear errors."""

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


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["config", "--config", CPU_YAML, "actor.optimizer.lrr=1"], "actor.optimizer.lrr"),
        (["config", "--config", "missing.yaml"], "'missing.yaml' does not exist"),
        (["allocation", "vllm:d4t2+megatron:d2p2t2", "--nodes", "1", "--gpus-per-node", "8"], "= 16 devices"),
        (["allocation", "vllm:d4q2"], "unknown size 'q'2"),
        (["allocation", "vllm:d1t1", "--model", "/nonexistent"], "'/nonexistent' is not a directory"),
    ],
)
def test_errors_exit_2_and_name_the_value(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_allocation_table(capsys):
    assert main(["allocation", "vllm:d48t2+megatron:d4p2t4", "--nodes", "16", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "48 servers x TP 2" in out and "128" in out
