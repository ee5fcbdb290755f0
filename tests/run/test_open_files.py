"""The open-file limit a run needs (megarl.utils.limits, megarl.run.open_files): raised before launch
and in each trainer, refused with both numbers when the hard limit is below it.

Each limit is set in a child process (``preexec_fn``), so this test process keeps its own."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megarl.config import GRPOConfig
from megarl.config.loader import build_config_values
from megarl.run.open_files import OPEN_FILES_MARGIN, trainer_open_files

REPO = Path(__file__).resolve().parents[2]
SOFT, HARD = resource.getrlimit(resource.RLIMIT_NOFILE)


def _run(code: str, soft: int, hard: int, *args: str) -> subprocess.CompletedProcess:
    """``python -c code`` whose RLIMIT_NOFILE starts at (soft, hard)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)),
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )


def _need_hard_limit(at_least: int) -> None:
    if HARD != resource.RLIM_INFINITY and HARD < at_least:
        pytest.skip(f"this machine's hard RLIMIT_NOFILE is {HARD}, below the {at_least} the test raises to")


def test_the_soft_limit_is_raised_to_what_is_needed():
    """A process started with a soft limit of 256 opens 1,500 files once it asked for 1,600."""
    _need_hard_limit(2000)
    child = _run(
        """
        import os, resource
        from megarl.utils.limits import ensure_open_files
        print(ensure_open_files(1600, "the test"), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(1500)]
        print("opened", len(fds))
        """,
        256,
        HARD,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["1600", "1600", "opened", "1500"]


def test_a_soft_limit_above_the_need_is_kept():
    _need_hard_limit(2000)
    child = _run(
        """
        import resource
        from megarl.utils.limits import ensure_open_files
        print(ensure_open_files(100, "the test"), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        """,
        1500,
        HARD,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["1500", "1500"]


def test_a_hard_limit_below_the_need_is_refused_naming_both():
    child = _run(
        """
        import resource
        from megarl.utils.limits import OpenFilesError, ensure_open_files
        try:
            ensure_open_files(2000, "the test's head")
        except OpenFilesError as err:
            print(err)
        print("limits", *resource.getrlimit(resource.RLIMIT_NOFILE))
        print("no refusal", ensure_open_files(2000, "the test's head", refuse=False))
        """,
        256,
        512,
    )
    assert child.returncode == 0, child.stderr
    error, limits, no_refusal = child.stdout.strip().splitlines()
    assert error.startswith("the test's head needs 2,000 open files, but this process may open at most 512")
    assert "hard limit 512, soft 256" in error and "ulimit -Hn" in error and "--propagate=NOFILE" in error
    assert limits == "limits 256 512"  # refused: nothing changed
    assert no_refusal == "no refusal 512"  # otherwise as far as the hard limit goes


def _config(name: str, *overrides: str) -> GRPOConfig:
    return build_config_values(GRPOConfig, [str(REPO / "configs" / name)], list(overrides))


def test_the_bundled_configs_need_what_their_heads_connect_to():
    """MoE, 256 GPUs: 16 heads of 512 / 16 = 32 prompts; max_staleness 2 lets 3 x 32 = 96 episodes
    run (not max_concurrent_rollouts' 1,024), each of 16 samples: 1,536 requests in flight; 32
    servers x 4 control and health sockets; a broadcast group of 128 inference GPUs + the sender."""
    moe = trainer_open_files(_config("gsm8k_grpo_qwen3-30b-a3b_256gpu.yaml"))
    assert (moe.generation, moe.control, moe.bridge, moe.margin) == (1536, 128, 258, OPEN_FILES_MARGIN)
    assert moe.total == 2434
    # 3 x 256 / 16 episodes x 16; sharded mode: 64 servers in 4 blocks of 16, 64 workers + 4 stores, both ends
    dense = trainer_open_files(_config("gsm8k_grpo_qwen2.5-7b_128gpu.yaml"))
    assert (dense.generation, dense.control, dense.bridge, dense.total) == (768, 256, 136, 1672)
    cpu = trainer_open_files(_config("arithmetic_grpo_cpu.yaml"))  # 8 episodes x 8, one server
    assert (cpu.generation, cpu.control, cpu.bridge, cpu.total) == (64, 4, 4, 584)
    capped = trainer_open_files(_config("gsm8k_grpo_qwen3-30b-a3b_256gpu.yaml", "rollout.max_connections=256"))
    assert capped.generation == 256


def test_megarl_run_refuses_a_config_over_the_hard_limit(tmp_path):
    """The pre-launch check (``megarl config`` loads as ``megarl run`` does) refuses 584 files under
    a hard limit of 500, naming both numbers, before anything starts."""
    child = _run(
        "import sys; from megarl.launcher.cli import main; sys.exit(main(sys.argv[1:]))",
        256,
        500,
        "config",
        "--config",
        "configs/arithmetic_grpo_cpu.yaml",
        f"cluster.fileroot={tmp_path}",
    )
    assert child.returncode == 2, child.stdout + child.stderr
    assert "config error at 'rollout.max_connections'" in child.stderr
    assert "needs 584 open files" in child.stderr and "hard limit 500, soft 256" in child.stderr


def test_the_pre_launch_check_raises_the_soft_limit_a_trainer_inherits(tmp_path):
    _need_hard_limit(1000)
    child = _run(
        """
        import resource, subprocess, sys
        from megarl.config import GRPOConfig
        from megarl.run.prelaunch import build_config
        build_config(GRPOConfig, ["configs/arithmetic_grpo_cpu.yaml"], [sys.argv[1]])
        code = "import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
        print(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip())
        """,
        256,
        HARD,
        f"cluster.fileroot={tmp_path}",
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["584"]


def test_a_login_node_short_of_the_limit_does_not_refuse_a_multi_node_run():
    """``megarl slurm`` checks on the submitting machine: it raises what it can and leaves the
    refusal to each trainer rank, on its own node."""
    child = _run(
        """
        from megarl.config import GRPOConfig
        from megarl.config.loader import build_config_values
        from megarl.run.open_files import check_open_files
        config = build_config_values(GRPOConfig, ["configs/gsm8k_grpo_qwen3-30b-a3b_256gpu.yaml"], [])
        print(check_open_files(config, refuse=False))
        try:
            check_open_files(config)
        except ValueError as err:
            print(err)
        """,
        256,
        1024,
    )
    assert child.returncode == 0, child.stderr
    lifted, error = child.stdout.strip().splitlines()
    assert lifted == "1024"
    assert "needs 2,434 open files" in error and "hard limit 1,024, soft 1,024" in error


def test_each_trainer_checks_its_limit_before_it_builds(monkeypatch):
    """``megarl.train.main`` raises or refuses the limit on its own node (a Slurm trainer's is not
    the launcher's) before the build opens any connection."""
    import megarl.train as train

    class Checked(Exception):
        pass

    def check(config, refuse=True):
        raise Checked(refuse)

    monkeypatch.setattr(train, "load_expr_config", lambda argv, cls: (_config("arithmetic_grpo_cpu.yaml"), []))
    monkeypatch.setattr(train, "check_open_files", check)
    monkeypatch.setattr(train, "build", lambda config: pytest.fail("built before the open-file check"))
    with pytest.raises(Checked) as caught:
        train.main([])
    assert caught.value.args == (True,)
