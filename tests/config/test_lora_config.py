"""``actor.lora``: bad values fail when the config loads, naming the key; a run refuses adapters for now."""

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
        ("actor.lora.rank=8", "actor.lora.rank", "weight sync"),
    ],
)
def test_bad_lora_values_name_the_key(override, key, fragment):
    with pytest.raises(ConfigError) as err:
        load_expr_config(["--config", CPU_YAML, override], GRPOConfig)
    assert err.value.key == key, str(err.value)
    assert fragment in str(err.value)


def test_lora_is_off_by_default():
    config, _ = load_expr_config(["--config", CPU_YAML], GRPOConfig)
    assert config.actor.lora.rank == 0 and not config.actor.lora.enabled
