"""``megarl slurm --convert-point`` on a real one-node Slurm: the job rewrites a recover point written per rank
on the ranks that wrote it, after which the run's config check takes it at another pipeline size."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.utils.network import find_free_ports
from tests.actor.dist_utils import run_ranks
from tests.launcher.test_slurm_e2e import CPU_YAML, OFFLINE, ROOT, job_env
from tests.run.test_convert_point import CRITIC, RUN, _overrides

pytestmark = [pytest.mark.slurm, pytest.mark.multiproc]


def test_the_conversion_job_rewrites_the_point(cluster, tiny_model_dir, tmp_path):
    from megarl.config.experiment import GRPOConfig
    from megarl.run.prelaunch import load_expr_config
    from megarl.utils.errors import ConfigError

    model = str(tiny_model_dir("llama"))
    run_dir = tmp_path.joinpath(*RUN)
    run_ranks(2, "tests.run.test_convert_point:dump_with_state", model_dir=model, run_dir=str(run_dir), alloc="d1p2t1")
    overrides = [
        *_overrides(tmp_path, model, "d2p1t1", *CRITIC),
        *(f"launcher.env.{k}={v}" for k, v in OFFLINE.items()),
    ]
    with pytest.raises(ConfigError, match=r"per-rank shards"):
        load_expr_config(["--config", str(CPU_YAML), *overrides, "recover.mode=resume"], GRPOConfig)

    activate = Path(sys.prefix) / "bin" / "activate"
    setup = f"source {activate}" if activate.exists() else f"export PATH={Path(sys.prefix) / 'bin'}:$PATH"
    argv = ["slurm", "--convert-point", "--config", str(CPU_YAML), *overrides, f"launcher.slurm.setup=[{setup!r}]"]
    port = find_free_ports(1, host="0.0.0.0", port_range=(20000, 60000))[0]
    argv.append(f"launcher.slurm.trainer_port={port}")
    submitted = subprocess.run(
        [sys.executable, "-m", "megarl.launcher.cli", *argv],
        cwd=ROOT,
        env=job_env(cluster),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    match = re.match(rf"submitted job (\d+): {re.escape(str(run_dir / 'convert.sbatch'))} ", submitted.stdout)
    assert match, submitted.stdout
    state = cluster.wait_job(match[1], 600)
    output = "\n".join(p.read_text() for p in (run_dir / "slurm").glob("*.out"))
    assert state == "COMPLETED", output[-6000:]
    assert "megarl: the conversion exited with status 0" in output
    load_expr_config(["--config", str(CPU_YAML), *overrides, "recover.mode=resume"], GRPOConfig)  # taken now
