"""``actor.lora`` and ``weight_update.lora``: bad values fail when the config loads, naming the key; a run
takes adapters with either weight sync; the adapter sync refuses what servers cannot load."""

from pathlib import Path

import pytest

from megarl.config import ConfigError, GRPOConfig
from megarl.run.prelaunch import load_expr_config

REPO = Path(__file__).resolve().parents[2]
CPU_YAML = "configs/gsm8k_grpo_cpu.yaml"


@pytest.fixture(autouse=True)
def in_repo_offline(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize(
    "override,key,fragment",
    [
        ("actor.lora.rank=-1", "actor.lora.rank", "must be >= 0"),
        ("actor.lora.alpha=0", "actor.lora.alpha", "must be > 0"),
        ("actor.lora.dropout=1.0", "actor.lora.dropout", "must be in [0, 1)"),
        ("actor.lora.target_modules=[linear_q]", "actor.lora.target_modules", "unknown module name(s)"),
        (
            "actor.lora.target_modules=[all-linear]",
            "actor.lora.target_modules",
            "(PEFT's all-linear: [q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj])",
        ),
        (
            "actor.lora.target_modules=[linear_qkv,q_proj]",
            "actor.lora.target_modules",
            "names linear_qkv both by its Megatron name and by HF module names",
        ),
        ("actor.lora.init_from=/some/adapter", "actor.lora.init_from", "set rank > 0"),
        ("weight_update.lora=folded", "weight_update.lora", "['merged', 'adapter']"),
        (
            "actor.lora.rank=8 actor.lora.target_modules=[linear_qkv,experts.linear_fc1] weight_update.lora=adapter",
            "weight_update.lora",
            "adapters on expert linears (experts.linear_fc1) have no PEFT form",
        ),
        ("actor.lora.rank=600 weight_update.lora=adapter", "actor.lora.rank", "LoRA ranks up to 512"),
    ],
)
def test_bad_lora_values_name_the_key(override, key, fragment):
    with pytest.raises(ConfigError) as err:
        load_expr_config(["--config", CPU_YAML, *override.split()], GRPOConfig)
    assert err.value.key == key, str(err.value)
    assert fragment in str(err.value)


def test_lora_is_off_by_default():
    config, _ = load_expr_config(["--config", CPU_YAML], GRPOConfig)
    assert config.actor.lora.rank == 0 and not config.actor.lora.enabled


def test_a_run_takes_adapters_with_the_merged_sync():
    config, _ = load_expr_config(["--config", CPU_YAML, "actor.lora.rank=8"], GRPOConfig)
    assert config.actor.lora.enabled and config.weight_update.lora == "merged"


def test_adapter_sync_on_cpu_says_merged_is_faster(tmp_path, caplog):
    argv = ["--config", CPU_YAML, "actor.lora.rank=8", f"cluster.fileroot={tmp_path}", "cluster.device=cpu"]
    with caplog.at_level("WARNING", logger="megarl.config"):
        load_expr_config([*argv, "weight_update.lora=adapter"], GRPOConfig)
    assert "weight_update.lora=merged is faster here" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="megarl.config"):
        load_expr_config(argv, GRPOConfig)
    assert "lora=merged is faster" not in caplog.text


def test_adapter_sync_writes_under_the_run_directory_unless_told(tmp_path, run_key):
    """The servers read each version's adapters from ``weight_update.disk_path``: the run directory's
    ``weight_updates`` by default, the directory given otherwise; and the servers start with LoRA on."""
    from megarl.launcher.serve import server_spec

    base = ["--config", CPU_YAML, "actor.lora.rank=8", "weight_update.lora=adapter", f"cluster.fileroot={tmp_path}"]
    config, _ = load_expr_config(base, GRPOConfig)
    assert config.adapter_sync and config.weight_update.disk_path == str(config.run_dir / "weight_updates")
    assert "--enable-lora" in server_spec(config, 0, [0], "127.0.0.1", 1).cmd
    config, _ = load_expr_config([*base, f"weight_update.disk_path={tmp_path / 'shared'}"], GRPOConfig)
    assert config.weight_update.disk_path == str(tmp_path / "shared")
    merged, _ = load_expr_config([*base, "weight_update.lora=merged"], GRPOConfig)
    assert not merged.adapter_sync and "--enable-lora" not in server_spec(merged, 0, [0], "127.0.0.1", 1).cmd


def test_lora_with_transformer_engine_asked_for_fails_when_the_config_loads():
    """TE layers are refused at load, before any server starts (it was at model build, after)."""
    with pytest.raises(ConfigError) as err:
        load_expr_config(
            ["--config", CPU_YAML, "actor.lora.rank=8", "actor.megatron.use_transformer_engine=true"], GRPOConfig
        )
    assert err.value.key == "actor.megatron.use_transformer_engine"
    assert "LoRA wraps Megatron's own linears" in str(err.value) and "null" in str(err.value)


@pytest.fixture
def transformer_engine_on_a_gpu(monkeypatch):
    """A GPU machine with TransformerEngine installed, as `pip install 'megarl[gpu]'` makes one."""
    import sys
    import types

    from megarl.actor import cpu_shim, engine  # noqa: F401 (Megatron asks TE's version when it first imports)

    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setattr(cpu_shim, "cuda_available", lambda: True)


def test_lora_builds_the_local_spec_when_transformer_engine_is_installed(transformer_engine_on_a_gpu):
    from megarl.actor.engine_settings import use_transformer_engine

    config, _ = load_expr_config(["--config", CPU_YAML, "actor.lora.rank=8"], GRPOConfig)
    assert config.actor.megatron.use_transformer_engine is None
    assert use_transformer_engine(config.actor) is False
    full, _ = load_expr_config(["--config", CPU_YAML], GRPOConfig)
    assert use_transformer_engine(full.actor) is True  # the stub is seen: without LoRA, TE is picked


def _peft_dir(path: Path, modules: list[str], **config) -> Path:
    """A PEFT adapter directory of rank 8 on ``modules`` of one layer (shapes do not matter before launch)."""
    import json

    import torch
    from safetensors.torch import save_file

    path.mkdir()
    prefix = "base_model.model.model.layers.0"
    tensors = {}
    for module in modules:
        where = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        tensors[f"{prefix}.{where}.{module}.lora_A.weight"] = torch.zeros(8, 4)
        tensors[f"{prefix}.{where}.{module}.lora_B.weight"] = torch.zeros(4, 8)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": modules, "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps({**settings, **config}))
    return path


@pytest.mark.parametrize(
    "modules,config,targets,key,fragment",
    [
        (["q_proj", "v_proj"], {"r": 4}, "[q_proj,v_proj]", "actor.lora.rank", "r=4 in adapter_config.json"),
        (["q_proj", "v_proj"], {"use_rslora": True}, "[q_proj,v_proj]", "actor.lora.use_rslora", "alpha / sqrt(r)"),
        (["q_proj", "v_proj"], {"use_dora": True}, "[q_proj,v_proj]", "actor.lora.init_from", "DoRA"),
        (["q_proj", "v_proj"], {"rank_pattern": {"q_proj": 4}}, "[q_proj,v_proj]", "actor.lora.init_from", "ranks per"),
        (["q_proj", "v_proj"], {"modules_to_save": ["lm_head"]}, "[q_proj,v_proj]", "actor.lora.init_from", "fully"),
        (["q_proj", "v_proj"], {}, "[q_proj]", "actor.lora.target_modules", "has modules ['v_proj'] that"),
        (["q_proj", "v_proj"], {}, "[linear_qkv]", "actor.lora.target_modules", "adapt ['k_proj'], which the adapter"),
    ],
)
def test_a_peft_adapter_to_start_from_is_checked_before_launch(tmp_path, modules, config, targets, key, fragment):
    """What megarl's adapters cannot hold, or what the targets and the adapter disagree on, fails when the
    config loads, naming the key to change (a PEFT adapter made with PEFT's defaults has q_proj and v_proj)."""
    adapter = _peft_dir(tmp_path / "adapter", modules, **config)
    argv = ["--config", CPU_YAML, "actor.lora.rank=8", "actor.lora.alpha=16", f"actor.lora.target_modules={targets}"]
    with pytest.raises(ConfigError) as err:
        load_expr_config([*argv, f"actor.lora.init_from={adapter}"], GRPOConfig)
    assert err.value.key == key, str(err.value)
    assert fragment in str(err.value)


QV_RANK_8 = [
    "--config",
    CPU_YAML,
    "actor.lora.rank=8",
    "actor.lora.alpha=16",
    "actor.lora.target_modules=[q_proj,v_proj]",
]
"""A run with adapters of rank 8 and alpha 16 on q_proj and v_proj (what :func:`_peft_dir` makes)."""


def test_a_peft_adapter_on_its_own_modules_is_taken(tmp_path):
    adapter = _peft_dir(tmp_path / "adapter", ["q_proj", "v_proj"])
    argv = QV_RANK_8
    config, _ = load_expr_config([*argv, f"actor.lora.init_from={adapter}"], GRPOConfig)
    assert config.actor.lora.init_from == str(adapter) and config.actor.lora.target_modules == ["q_proj", "v_proj"]


def test_an_rslora_adapter_is_taken_with_use_rslora_and_only_with_it(tmp_path):
    """An adapter trained with rank-stabilised scaling starts a run that scales as it did, and a plain one a
    run that does not: the other way round each is refused naming ``actor.lora.use_rslora``."""
    argv = QV_RANK_8
    rslora = _peft_dir(tmp_path / "rslora", ["q_proj", "v_proj"], use_rslora=True)
    config, _ = load_expr_config([*argv, "actor.lora.use_rslora=true", f"actor.lora.init_from={rslora}"], GRPOConfig)
    assert config.actor.lora.use_rslora
    plain = _peft_dir(tmp_path / "plain", ["q_proj", "v_proj"])
    with pytest.raises(ConfigError) as err:
        load_expr_config([*argv, "actor.lora.use_rslora=true", f"actor.lora.init_from={plain}"], GRPOConfig)
    assert err.value.key == "actor.lora.use_rslora" and "use_rslora=False in adapter_config.json" in str(err.value)


def test_a_checkpoint_of_adapters_at_another_scale_is_another_model():
    """The same adapter tensors at another scale (``alpha``, ``use_rslora``) compute another policy: a resume
    with them is refused, naming the scales; a record from before the scale was kept compares the rest."""
    from megarl.actor.checkpoint import model_problem, model_shape
    from megarl.config.train import LoRAConfig

    hf = {"hidden_size": 64, "num_hidden_layers": 2}
    saved = {"model": model_shape(hf, LoRAConfig(rank=16, alpha=32.0))}
    assert model_problem(saved, model_shape(hf, LoRAConfig(rank=16, alpha=32.0))) is None
    problem = model_problem(saved, model_shape(hf, LoRAConfig(rank=16, alpha=32.0, use_rslora=True)))
    assert problem is not None and "'scale': 2.0} -> {" in problem and "'scale': 8.0}" in problem
    older = {
        "model": {**saved["model"], "lora": {"rank": 16, "target_modules": saved["model"]["lora"]["target_modules"]}}
    }
    assert model_problem(older, model_shape(hf, LoRAConfig(rank=16, alpha=64.0))) is None
    assert "'rank': 16" in model_problem(older, model_shape(hf, LoRAConfig(rank=8, alpha=16.0)))


def test_the_critic_takes_adapters_checked_under_its_own_keys(tmp_path):
    """``critic.lora`` builds a LoRA critic; its adapter to start from is checked as the actor's, named
    ``critic.lora.*``; a frozen ``ref`` model takes none."""
    ppo = ["--config", CPU_YAML, "algorithm.adv_estimator=gae", "critic={}", "critic.optimizer.lr=1e-4"]
    config, _ = load_expr_config([*ppo, "critic.lora.rank=8"], GRPOConfig)
    assert config.critic.lora.enabled and not config.actor.lora.enabled
    adapter = _peft_dir(tmp_path / "adapter", ["q_proj", "v_proj"], r=4)
    with pytest.raises(ConfigError) as err:
        load_expr_config(
            [*ppo, "critic.lora.rank=8", "critic.lora.alpha=16", f"critic.lora.init_from={adapter}"], GRPOConfig
        )
    assert err.value.key == "critic.lora.rank" and "but critic.lora.rank=8" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_expr_config(["--config", CPU_YAML, "ref.path=smollm2-135m-instruct", "ref.lora.rank=8"], GRPOConfig)
    assert err.value.key == "ref.lora.rank" and "the reference model is frozen" in str(err.value)
