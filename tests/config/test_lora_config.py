"""``actor.lora`` and ``weight_update.lora``: bad values fail when the config loads, naming the key; a run
takes adapters with the merged weight sync and refuses the adapter sync (not implemented yet)."""

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
        ("actor.lora.rank=8 weight_update.lora=adapter", "weight_update.lora", "not implemented yet"),
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
