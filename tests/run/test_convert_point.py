"""``megarl convert-point``: a recover point whose optimizer state was written per rank (``data_parallel``,
refused at another pipeline or tensor-parallel size) is rewritten per parameter, and then resumes at
another layout with the same weights and Adam moments (the actor's and PPO's critic's; a LoRA actor's
adapters'), every one bit for bit, and the same learning rate."""

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


def _adapter_state(engine) -> dict:
    """A LoRA actor's adapters and their Adam moments, whole (canonical names), and its learning rate."""
    from megarl.models import lora
    from tests.actor.workers import OPTIMIZER_STATE_KEYS, optimizer_state_per_param

    per_param = optimizer_state_per_param(engine)
    state = {
        key: lora.gather_full(engine.model, engine.coords, value=lambda q, key=key: per_param[id(q)][key])
        for key in OPTIMIZER_STATE_KEYS
    }
    return {"actor": state, "lr": engine.current_lr}


def dump_lora(model_dir: str, run_dir: str, alloc: str) -> dict:
    """A LoRA actor's step, then a recover point with per-rank optimizer shards, at ``alloc``."""
    from pathlib import Path

    from megarl.config.run import RecoverConfig
    from megarl.config.train import LoRAConfig
    from megarl.run.recover import RecoverHandler
    from tests.actor.lora_workers import ALPHA, DENSE, RANK, _lora_engine
    from tests.actor.workers import _step, make_batch
    from tests.run.test_recover import info_at

    settings = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=DENSE)
    engine = _lora_engine(model_dir, alloc, settings, 2, True, False, layout="data_parallel")
    _step(engine, make_batch([7, 12, 5, 9]))
    RecoverHandler(RecoverConfig(mode="auto"), Path(run_dir)).maybe_dump(engine, info_at(0), force=True)
    return _adapter_state(engine)


def load_lora_at(model_dir: str, run_dir: str, alloc: str) -> dict:
    """The LoRA actor's recover point loaded at ``alloc``: what :func:`dump_lora` returns, and the step."""
    from pathlib import Path

    from megarl.config.run import RecoverConfig
    from megarl.config.train import LoRAConfig
    from megarl.run.recover import RecoverHandler
    from tests.actor.lora_workers import ALPHA, DENSE, RANK, _lora_engine

    engine = _lora_engine(model_dir, alloc, LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=DENSE), 2, True, False)
    info = RecoverHandler(RecoverConfig(mode="resume"), Path(run_dir)).load(engine)
    return {**_adapter_state(engine), "step": info.global_step}


def _convert(config: list[str]) -> str:
    """``megarl convert-point`` with the run's ``config`` (files and overrides); its console."""
    cmd = [sys.executable, "-m", "megarl.launcher.cli", "convert-point", *config]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _assert_same_state(written: dict, loaded: dict, models: tuple[str, ...]) -> None:
    assert loaded["step"] == 0 and loaded["lr"] == written["lr"]  # the point's schedule, not the converter's config's
    for model in models:
        for key, tensors in written[model].items():
            assert tensors.keys() == loaded[model][key].keys()
            for name, tensor in tensors.items():
                assert torch.equal(tensor, loaded[model][key][name]), f"the {model}'s {key} of {name} changed"


CRITIC = ["algorithm.adv_estimator=gae", "critic={}", "critic.dtype=float32"]
LORA = [
    "actor.lora.rank=4",
    "actor.lora.alpha=8",
    "actor.lora.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
]
"""The overrides of the run whose point :func:`dump_lora` writes (``tests.actor.lora_workers``'s adapters)."""


def _overrides(tmp_path, model: str, trainer: str, *more: str) -> list[str]:
    ranks = AllocationMode.from_str(f"vllm:d1t1+megatron:{trainer}").train.world_size
    return [
        f"cluster.fileroot={tmp_path}",
        f"actor.path={model}",
        "actor.dtype=float32",
        f"allocation_mode=vllm:d1t1+megatron:{trainer}",
        f"cluster.n_gpus_per_node={1 + ranks}",
        *more,
    ]


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "actor,written_at,more,refused",
    [
        ("full", "d1p2t1", CRITIC, r"\(pp 2 -> 1\)"),  # the actor and PPO's critic
        ("lora", "d1p1t2", LORA, r"\(tp 2 -> 1\)"),  # a LoRA actor: its adapters' optimizer state
    ],
    ids=["actor-and-critic", "lora-actor"],
)
def test_a_per_rank_point_converted_resumes_at_another_layout(
    tiny_model_dir, tmp_path, actor, written_at, more, refused
):
    from megarl.config.experiment import GRPOConfig
    from megarl.run.prelaunch import load_expr_config
    from megarl.utils.errors import ConfigError

    model = str(tiny_model_dir("llama"))
    run_dir = tmp_path.joinpath(*RUN)
    dump, load = ("dump_with_state", "load_at") if actor == "full" else ("dump_lora", "load_lora_at")
    worker = "tests.run.test_convert_point:"
    written = run_ranks(2, worker + dump, model_dir=model, run_dir=str(run_dir), alloc=written_at)[0]
    config = ["configs/gsm8k_grpo_cpu.yaml", *_overrides(tmp_path, model, "d2p1t1", *more)]
    with pytest.raises(ConfigError, match=rf"per-rank shards .* layout differs {refused}"):
        load_expr_config(["--config", *config, "recover.mode=resume"], GRPOConfig)

    console = _convert(config)
    assert "now loads at any layout" in console and "on 2 ranks" in console
    load_expr_config(["--config", *config, "recover.mode=resume"], GRPOConfig)  # the check passes now
    loaded = run_ranks(2, worker + load, model_dir=model, run_dir=str(run_dir), alloc="d2p1t1")[0]
    _assert_same_state(written, loaded, ("actor", "critic") if actor == "full" else ("actor",))
    assert sorted(p.name for p in (run_dir / "recover").iterdir()) == ["step0"]  # rewritten in place
    manifest = (run_dir / "recover" / "step0" / "MANIFEST.json").stat().st_mtime_ns
    assert "already loads at any layout" in _convert(config)
    assert (run_dir / "recover" / "step0" / "MANIFEST.json").stat().st_mtime_ns == manifest, "written again"


def test_a_run_without_a_recover_point_is_told_so(tmp_path, capsys):
    from megarl.launcher.cli import main

    assert main(["convert-point", "configs/gsm8k_grpo_cpu.yaml", f"cluster.fileroot={tmp_path}"]) == 2
    assert "holds no complete recover point to convert" in capsys.readouterr().err


def test_a_point_of_a_run_still_going_is_not_rewritten(tmp_path, capsys, monkeypatch):
    """While ``megarl run`` holds the trial, convert-point refuses it (exit 2, naming the run) and starts nothing."""
    import megarl.launcher.cli as cli
    import megarl.launcher.local as local
    import megarl.run.convert_point as convert_point
    from megarl.config import GRPOConfig
    from megarl.run.earlier_run import lock_run_dir
    from megarl.run.prelaunch import build_config

    config = build_config(GRPOConfig, ["configs/gsm8k_grpo_cpu.yaml"], [f"cluster.fileroot={tmp_path}"])
    point = config.run_dir / "recover" / "step3"
    monkeypatch.setattr(cli, "_point_to_convert", lambda args, console: (config, point))  # a point to convert
    monkeypatch.setattr(convert_point, "saved_world_size", lambda point: 1)
    monkeypatch.setattr(local, "torchrun_command", lambda *a: pytest.fail("a live run's point was rewritten"))
    lock = lock_run_dir(config.run_dir)
    try:
        assert cli.main(["convert-point", "configs/gsm8k_grpo_cpu.yaml", f"cluster.fileroot={tmp_path}"]) == 2
    finally:
        lock.release()
    err = capsys.readouterr().err
    assert f"{config.run_dir} is in use by a run that is still going (pid " in err
    assert not (config.run_dir / cli.CONVERT_CONFIG).exists()
