"""``megarl convert-point``: a recover point whose optimizer state was written per rank (``data_parallel``,
refused at another pipeline size) is rewritten per parameter, and then resumes at another layout with
the same weights and Adam moments of the actor and PPO's critic, every one bit for bit."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megarl.config.allocation import AllocationMode
from tests.actor.dist_utils import run_ranks

RUN = ("gsm8k-grpo-cpu", "trial0")


def _trained_by_critic(rule) -> bool:
    """The critic's trained weights: all but the LM head (its value head replaces it)."""
    return rule.megatron != "output_layer.weight"


def _critic(model_dir: str, parallel, checkpoint_layout: str):
    """PPO's critic beside the actor, its optimizer state per rank (``data_parallel``) or per parameter."""
    from megarl.actor.critic import MegatronCritic
    from megarl.config.ppo import PPOCriticConfig
    from megarl.config.train import MicroBatchSpec, OptimizerConfig

    optimizer = OptimizerConfig(lr=1e-3, use_distributed_optimizer=True, checkpoint_layout=checkpoint_layout)
    config = PPOCriticConfig(path=model_dir, dtype="float32", mb_spec=MicroBatchSpec(4096, 2), optimizer=optimizer)
    critic = MegatronCritic(config)
    critic.initialize(parallel=parallel, ft_spec=10)
    return critic


def dump_with_state(model_dir: str, run_dir: str, alloc: str) -> dict:
    """A step of the actor and of PPO's critic, then a recover point with per-rank optimizer shards, at
    ``alloc``; rank 0: the weights and Adam moments each holds (HF-named, whole), and the actor's learning rate."""
    from pathlib import Path

    from megarl.config.run import RecoverConfig
    from megarl.run.recover import RecoverHandler
    from tests.actor.workers import _ckpt_engine, _step, full_optimizer_state, make_batch, make_critic_batch, split_rows
    from tests.run.test_recover import info_at

    actor = _ckpt_engine(model_dir, alloc, "float32", "data_parallel")
    _step(actor, make_batch([7, 12, 5, 9]))
    critic = _critic(model_dir, actor.parallel, "data_parallel")
    critic.ppo_update(split_rows(make_critic_batch([7, 12, 5, 9]), actor.parallel.dp_rank, actor.parallel.alloc.dp))
    engines = {"model": actor, "critic": critic}
    RecoverHandler(RecoverConfig(mode="auto"), Path(run_dir)).maybe_dump(engines, info_at(0), force=True)
    return {
        "actor": full_optimizer_state(actor),
        "critic": full_optimizer_state(critic, _trained_by_critic),
        "lr": actor.current_lr,
    }


def load_at(model_dir: str, run_dir: str, alloc: str) -> dict:
    """The recover point loaded at ``alloc``: rank 0, what :func:`dump_with_state` returns, and the step."""
    from pathlib import Path

    from megarl.config.run import RecoverConfig
    from megarl.run.recover import RecoverHandler
    from tests.actor.workers import _ckpt_engine, full_optimizer_state

    actor = _ckpt_engine(model_dir, alloc, "float32", "any")
    critic = _critic(model_dir, actor.parallel, "any")
    info = RecoverHandler(RecoverConfig(mode="resume"), Path(run_dir)).load({"model": actor, "critic": critic})
    return {
        "actor": full_optimizer_state(actor),
        "critic": full_optimizer_state(critic, _trained_by_critic),
        "lr": actor.current_lr,
        "step": info.global_step,
    }


def _overrides(tmp_path, model: str, trainer: str) -> list[str]:
    ranks = AllocationMode.from_str(f"vllm:d1t1+megatron:{trainer}").train.world_size
    return [
        f"cluster.fileroot={tmp_path}",
        f"actor.path={model}",
        "actor.dtype=float32",
        "algorithm.adv_estimator=gae",
        "critic={}",
        "critic.dtype=float32",
        f"allocation_mode=vllm:d1t1+megatron:{trainer}",
        f"cluster.n_gpus_per_node={1 + ranks}",
    ]


@pytest.mark.multiproc
def test_a_per_rank_point_converted_resumes_at_another_pipeline_size(tiny_model_dir, tmp_path):
    from megarl.config.experiment import GRPOConfig
    from megarl.run.prelaunch import load_expr_config
    from megarl.utils.errors import ConfigError

    model = str(tiny_model_dir("llama"))
    run_dir = tmp_path.joinpath(*RUN)
    written = run_ranks(
        2, "tests.run.test_convert_point:dump_with_state", model_dir=model, run_dir=str(run_dir), alloc="d1p2t1"
    )[0]
    config = ["--config", "configs/gsm8k_grpo_cpu.yaml", *_overrides(tmp_path, model, "d2p1t1")]
    with pytest.raises(ConfigError, match=r"per-rank shards .* layout differs \(pp 2 -> 1\)"):
        load_expr_config([*config, "recover.mode=resume"], GRPOConfig)

    cmd = [sys.executable, "-m", "megarl.launcher.cli", "convert-point"]
    done = subprocess.run([*cmd, *config[1:]], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "now loads at any layout" in done.stdout and "on 2 ranks" in done.stdout
    load_expr_config([*config, "recover.mode=resume"], GRPOConfig)  # the check passes now

    loaded = run_ranks(
        2, "tests.run.test_convert_point:load_at", model_dir=model, run_dir=str(run_dir), alloc="d2p1t1"
    )[0]
    assert loaded["step"] == 0 and loaded["lr"] == written["lr"]  # the point's schedule, not the converter's config's
    for model in ("actor", "critic"):
        for key, tensors in written[model].items():
            assert tensors.keys() == loaded[model][key].keys()
            for name, tensor in tensors.items():
                assert torch.equal(tensor, loaded[model][key][name]), f"the {model}'s {key} of {name} changed"
    assert sorted(p.name for p in (run_dir / "recover").iterdir()) == ["step0"]  # rewritten in place
    manifest = (run_dir / "recover" / "step0" / "MANIFEST.json").stat().st_mtime_ns
    again = subprocess.run([*cmd, *config[1:]], capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0 and "already loads at any layout" in again.stdout, again.stdout + again.stderr
    assert (run_dir / "recover" / "step0" / "MANIFEST.json").stat().st_mtime_ns == manifest, "written again"


def test_a_run_without_a_recover_point_is_told_so(tmp_path, capsys):
    from megarl.launcher.cli import main

    assert main(["convert-point", "configs/gsm8k_grpo_cpu.yaml", f"cluster.fileroot={tmp_path}"]) == 2
    assert "holds no complete recover point to convert" in capsys.readouterr().err
