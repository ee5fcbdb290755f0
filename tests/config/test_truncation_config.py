"""The trainer replays the sampling's truncation: ``actor.top_p`` / ``top_k`` / ``min_p`` must equal
``gconfig``'s while ``actor.replay_truncation`` is on (the config loader refuses a mismatch, naming the
key), and follow it through an interpolation."""

from pathlib import Path

import pytest

from megarl.actor.ppo import replayed_truncation
from megarl.config import ConfigError, GRPOConfig
from megarl.config.loader import load_config_values
from megarl.kernels import Truncation

REPO = Path(__file__).resolve().parents[2]
CPU_YAML = str(REPO / "configs/gsm8k_grpo_cpu.yaml")


def _load(*overrides: str) -> GRPOConfig:
    return load_config_values(["--config", CPU_YAML, *overrides], GRPOConfig)[0]


@pytest.mark.parametrize("key, value", [("top_p", "0.9"), ("top_k", "20"), ("min_p", "0.05")])
def test_sampling_truncation_must_reach_the_actor(key, value):
    with pytest.raises(ConfigError, match=rf"actor\.{key}.*gconfig\.{key}={value}"):
        _load(f"gconfig.{key}={value}")
    config = _load(f"gconfig.{key}={value}", f"actor.{key}=${{gconfig.{key}}}")
    assert replayed_truncation(config.actor) == Truncation(**{key: type(getattr(Truncation(), key))(value)})
    off = _load(f"gconfig.{key}={value}", "actor.replay_truncation=false")
    assert replayed_truncation(off.actor) is None


def test_no_truncation_no_replay():
    assert replayed_truncation(_load().actor) is None
