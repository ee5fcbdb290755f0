"""docs/concepts/algorithms.md: every command on the page loads (the config check included), each
override lands as written, and each ``actor.loss`` preset sets the keys the page says it sets."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from megarl.config import GRPOConfig
from megarl.config.ppo import ADV_ESTIMATOR_PRESETS, LOSS_PRESETS
from megarl.run.prelaunch import load_expr_config

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "concepts" / "algorithms.md"
CONFIG = "configs/gsm8k_grpo_cpu.yaml"


def page_commands() -> list[str]:
    """The ``megarl run`` lines of the page's bash blocks."""
    blocks = re.findall(r"```bash\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.DOTALL)
    return [line.strip() for block in blocks for line in block.splitlines() if line.startswith("megarl run")]


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def load(overrides: list[str]):
    config, rest = load_expr_config(["--config", str(REPO / CONFIG), *overrides], GRPOConfig)
    assert rest == []
    return OmegaConf.structured(config)


def test_the_page_has_a_command_for_every_builtin_loss():
    losses = {m for cmd in page_commands() for m in re.findall(r"actor\.loss=(\w+)", cmd)}
    assert set(LOSS_PRESETS) - {"ppo"} <= losses
    assert any("algorithm.adv_estimator=gae" in cmd for cmd in page_commands())


@pytest.mark.parametrize("command", page_commands())
def test_every_command_loads_with_its_values(command):
    argv = shlex.split(command)
    assert argv[:3] == ["megarl", "run", CONFIG]
    overrides = argv[3:]
    config = load(overrides)
    for override in overrides:
        key, _, raw = override.partition("=")
        want = yaml.safe_load(raw)
        if isinstance(want, str) and re.fullmatch(r"[\d.]+e-?\d+", want):
            want = float(want)  # YAML 1.1 reads 1e-4 as a string, OmegaConf as a float
        got = OmegaConf.select(config, key)
        got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
        if isinstance(want, dict):  # `critic={}`: a block with its defaults
            assert isinstance(got, dict), key
        else:
            assert got == want, f"{key}: {got!r} != {want!r}"
    presets = [LOSS_PRESETS.get(OmegaConf.select(config, "actor.loss"), {})]
    presets.append(ADV_ESTIMATOR_PRESETS[OmegaConf.select(config, "algorithm.adv_estimator")])
    for key, value in (item for preset in presets for item in flatten(preset).items()):
        if key in {k for k, _, _ in (o.partition("=") for o in overrides)}:
            continue  # the command's own value wins
        got = OmegaConf.select(config, key)
        if isinstance(value, str) and value.startswith("${"):
            value = OmegaConf.select(config, value[2:-1])
        assert got == value, f"{command}: the preset's {key}={value!r}, loaded {got!r}"


@pytest.mark.parametrize("name", sorted(set(LOSS_PRESETS) - {"ppo"}))
def test_the_page_names_every_key_a_preset_sets(name):
    """Each preset's section names the keys the preset sets (so the page cannot fall behind the code)."""
    text = PAGE.read_text(encoding="utf-8")
    sections = {"grpo": "## GRPO", "dapo": "## DAPO", "dr_grpo": "## Dr. GRPO", "gspo": "## GSPO"}
    section = text.split(sections[name] + "\n", 1)[1].split("\n## ", 1)[0]
    for key, value in flatten(LOSS_PRESETS[name]).items():
        assert f"`{key}`" in section, f"{name}: {key} not named"
        shown = {value} if isinstance(value, str) else {f"{value:g}", f"{value:.0e}".replace("e-0", "e-")}
        assert any(s in section for s in shown), f"{name}: {key}={value} not shown"
