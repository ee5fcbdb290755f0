"""A model directory whose weights or tokenizer cannot load is refused when the config loads, naming the file,
not minutes into the run after the servers started (:mod:`megarl.models.weight_files`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import save_file

from megarl.config import ConfigError, GRPOConfig
from megarl.models.weight_files import weights_problem
from megarl.run.prelaunch import build_config

CPU_YAML = str(Path(__file__).resolve().parents[2] / "configs" / "arithmetic_grpo_cpu.yaml")
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json")


@pytest.fixture
def model(tiny_model_dir, tmp_path) -> Path:
    """A writable copy of the tiny llama (one model.safetensors, SmolLM2's tokenizer)."""
    return Path(shutil.copytree(tiny_model_dir("llama"), tmp_path / "model"))


def load(tmp_path: Path, *overrides: str) -> GRPOConfig:
    return build_config(GRPOConfig, [CPU_YAML], [f"cluster.fileroot={tmp_path / 'out'}", *overrides])


def shard(model: Path) -> None:
    """Split model.safetensors in two files with an index, as the hub's larger models are."""
    from safetensors.torch import load_file

    tensors = load_file(model / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, model / file)
    weight_map = {n: file for file, part in halves.items() for n in part}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (model / "model.safetensors").unlink()


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def widen(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["hidden_size"] *= 2
    (model / "config.json").write_text(json.dumps(config))


DAMAGE = [
    (
        "shard-missing",
        lambda m: (shard(m), (m / "model-00002-of-00002.safetensors").unlink()),
        "actor.path",
        "names model-00002-of-00002.safetensors, not in the directory (1 of 2 files present)",
    ),
    (
        "no-weights",
        lambda m: (m / "model.safetensors").unlink(),
        "actor.path",
        "no weights: neither model.safetensors nor model.safetensors.index.json",
    ),
    ("cut-short", lambda m: truncate(m / "model.safetensors"), "actor.path", "model.safetensors is cut short"),
    (
        "index-garbled",
        lambda m: (shard(m), (m / "model.safetensors.index.json").write_text("{")),
        "actor.path",
        "model.safetensors.index.json is unreadable",
    ),
    (
        "header-not-safetensors",
        lambda m: (m / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"[]"),
        "actor.path",
        "model.safetensors is not a safetensors file (its header does not place its tensors)",
    ),
    (
        "not-safetensors",
        lambda m: (m / "model.safetensors").write_text("x" * 100),
        "actor.path",
        "model.safetensors is not a safetensors file",
    ),
    ("other-width", widen, "actor.path", "model.embed_tokens.weight is ["),  # and config.json's hidden_size
    (
        "no-tokenizer",
        lambda m: [(m / f).unlink(missing_ok=True) for f in TOKENIZER],
        "tokenizer_path",
        "has no tokenizer",
    ),
]


@pytest.mark.parametrize("damage,key,message", [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE])
def test_a_model_that_cannot_load_is_refused_naming_the_file(model, tmp_path, damage, key, message):
    assert load(tmp_path, f"actor.path={model}").actor.path == str(model)  # whole: loads
    damage(model)
    with pytest.raises(ConfigError) as err:
        load(tmp_path, f"actor.path={model}")
    assert err.value.key == key and message in err.value.message, err.value


def test_whole_shards_and_the_cases_that_need_no_weights_load(model, tmp_path):
    shard(model)
    assert weights_problem(model) is None
    (model / "model-00002-of-00002.safetensors").unlink()
    load(tmp_path, f"actor.path={model}", "actor.init_from_scratch=true")  # random weights: none read
    for name in ("tokenizer.json", "vocab.json"):
        (model / name).unlink(missing_ok=True)
    load(tmp_path, f"actor.path={model}", "actor.init_from_scratch=true", "tokenizer_path=smollm2")
