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
        ("actor.lora.target_modules=[linear_qkv,q_proj]", "actor.lora.target_modules", "'q_proj'"),
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
