"""When the trainer fails, the console shows why: the failed rank's exception, not torchrun's report of it;
torchrun's own files stay with the run."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

from megarl.config import GRPOConfig
from megarl.launcher.local import _tail, check_local, trainer_command, trainer_env
from megarl.run.prelaunch import build_config

CPU_YAML = str(Path(__file__).resolve().parents[2] / "configs" / "gsm8k_grpo_cpu.yaml")

FAILING = textwrap.dedent(  # a rank of a process group: torch prints its exception as "[rank0]: ..." lines
    """
    import atexit
    import subprocess
    import sys

    import torch.distributed as dist

    class ConsistencyError(RuntimeError):
        pass

    dist.init_process_group("gloo")
    # A process the rank started writes to the log after the rank's traceback (as data-loader workers
    # importing Megatron print its warnings), before torchrun's report.
    noise = "import sys; [print(f'UserWarning: Apex is not installed ({i})', file=sys.stderr) for i in range(30)]"
    atexit.register(subprocess.run, [sys.executable, "-c", noise])

    for line in range(40):
        print(f"step output {line}")
    raise ConsistencyError("servers' probe logprobs differ from the trainer's by 0.23")
    """
)


def test_the_console_tail_is_the_failed_ranks_exception(tmp_path):
    script, log, tmp = tmp_path / "fail.py", tmp_path / "trainer.log", tmp_path / "tmp"
    script.write_text(FAILING)
    tmp.mkdir()
    config = build_config(
        GRPOConfig, [CPU_YAML], [f"launcher.trainer_entry={script}", f"cluster.fileroot={tmp_path / 'runs'}"]
    )
    plan = check_local(config)
    cmd = trainer_command(config, tmp_path / "config.yaml", plan)
    env = {**trainer_env(config, plan, ["127.0.0.1:8000"]), "TMPDIR": str(tmp)}
    with open(log, "wb") as out:  # as the launcher runs the trainer: torchrun, its ranks' output in one log
        run = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=120, check=False)
    assert run.returncode == 1, log.read_text()
    assert not list(tmp.iterdir()), "torchrun left files in the temporary directory"
    assert list((config.run_dir / "logs" / "torchrun").iterdir()), "torchrun's directory is not the run's"
    text = log.read_text()
    why = "ConsistencyError: servers' probe logprobs differ from the trainer's by 0.23"
    assert why in text and why not in "\n".join(text.splitlines()[-20:])  # torchrun's report ends the log
    tail = _tail(log)
    assert why in tail and "ChildFailedError" not in tail and "step output 39" not in tail, tail
    assert "Apex is not installed (29)" in text and "Apex" not in tail, tail
    plain = tmp_path / "plain.log"
    plain.write_text("\n".join(f"line {i}" for i in range(30)))
    assert _tail(plain) == "\n".join(f"line {i}" for i in range(10, 30))  # no failure report: the last lines


def test_a_failed_trainer_rank_leaves_its_error_with_the_run(tmp_path):
    """megarl's trainer records its exception for torchrun: the report at the end of the log names it with its
    traceback (on a cluster, which rank failed first), and its error file stays under the run's logs."""
    config = build_config(GRPOConfig, [CPU_YAML], [f"cluster.fileroot={tmp_path / 'runs'}"])
    plan = check_local(config)
    cmd = trainer_command(config, tmp_path / "missing.yaml", plan)  # the trainer cannot read its config
    log = tmp_path / "trainer.log"
    with open(log, "wb") as out:
        run = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=trainer_env(config, plan, []), timeout=300)
    assert run.returncode == 1, log.read_text()[-3000:]
    report = log.read_text().split("ChildFailedError", 1)[-1]
    assert "missing.yaml" in report and "traceback : Traceback" in report, report[-3000:]
    (error_file,) = (config.run_dir / "logs" / "torchrun").rglob("error.json")
    assert "missing.yaml" in error_file.read_text()
    tail = _tail(log)  # the console still shows the rank's own exception, not the report
    assert "missing.yaml" in tail and "ChildFailedError" not in tail and "error_file" not in tail, tail
