"""Parallel-strategy presets (configs/parallel/): what they set, that each fits its cluster and model,
that each composes with every experiment config through ``megarl config`` and ``megarl slurm
--dry-run``, and that launch/*.sbatch are rendered from them."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megarl.config import AllocationMode, GRPOConfig, ModelShape, to_yaml, validate_allocation
from megarl.launcher.cli import main
from megarl.run.prelaunch import load_expr_config
from tests.config.bad_files import write_model_dir

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted(p.stem for p in (REPO / "configs" / "parallel").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))

LAYOUT = {
    "allocation_mode",
    "cluster.n_nodes",
    "cluster.n_gpus_per_node",
    "cluster.device",
    "actor.megatron.sequence_parallel",
    "actor.megatron.recompute_granularity",
    "actor.megatron.overlap_grad_reduce",
    "actor.megatron.overlap_param_gather",
    "actor.megatron.moe_token_dispatcher_type",
}
"""What every preset sets, so that composing one never mixes two layouts."""
BACKEND_KEYS = {"weight_update.mode"}
"""What a preset may set besides: a transfer its servers take (SGLang has no per-shard route)."""

QWEN25_7B = {
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "num_hidden_layers": 28,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "vocab_size": 152064,
}
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "vocab_size": 151936,
}
SMOLLM2 = "SmolLM2-135M"
MODEL_OF_PRESET = {
    "cpu_1node": SMOLLM2,
    "dense_7b_8gpu": "Qwen2.5-7B",
    "dense_7b_32gpu": "Qwen2.5-7B",
    "dense_7b_128gpu": "Qwen2.5-7B",
    "moe_30b_32gpu": "Qwen3-30B-A3B",
    "moe_30b_256gpu": "Qwen3-30B-A3B",
}
"""The model each preset is sized for (its header says so)."""
SHAPES = {
    SMOLLM2: ModelShape(9, 3, 30),
    "Qwen2.5-7B": ModelShape.from_hf_config(QWEN25_7B),
    "Qwen3-30B-A3B": ModelShape.from_hf_config(QWEN3_30B_A3B),
}

# Pairs that cannot be one valid run, and why. SmolLM2-135M (the CPU experiments) has 9 attention
# heads: no tensor parallel size above 1 that a Qwen layout uses (2, 4) divides it; its batches of 2
# and 8 prompts do not split over 4 or 16 data-parallel ranks; expert parallel needs a model with
# experts (Megatron-Core refuses it on a dense one). Every other pair is a valid config.
TP_VS_9_HEADS = "tensor parallel t{} does not divide the model's 9 attention heads"
DP_VS_BATCH = "must be divisible by the trainer's data-parallel size d{}"
EP_VS_DENSE = "megatron expert parallel e8 is set, but the model has no experts (dense)"
REFUSED = {
    ("arithmetic_grpo_cpu", "dense_7b_32gpu"): TP_VS_9_HEADS.format(2),
    ("arithmetic_grpo_cpu", "dense_7b_128gpu"): DP_VS_BATCH.format(16),
    ("arithmetic_grpo_cpu", "moe_30b_32gpu"): TP_VS_9_HEADS.format(4),
    ("arithmetic_grpo_cpu", "moe_30b_256gpu"): DP_VS_BATCH.format(16),
    ("gsm8k_grpo_cpu", "dense_7b_32gpu"): TP_VS_9_HEADS.format(2),
    ("gsm8k_grpo_cpu", "dense_7b_128gpu"): DP_VS_BATCH.format(16),
    ("gsm8k_grpo_cpu", "moe_30b_32gpu"): DP_VS_BATCH.format(4),
    ("gsm8k_grpo_cpu", "moe_30b_256gpu"): DP_VS_BATCH.format(16),
    ("gsm8k_grpo_qwen2.5-7b_128gpu", "moe_30b_32gpu"): EP_VS_DENSE,
    ("gsm8k_grpo_qwen2.5-7b_128gpu", "moe_30b_256gpu"): EP_VS_DENSE,
}


@pytest.fixture(autouse=True)
def in_repo_offline(monkeypatch):
    """Relative paths (and the file names in errors) start at the repository; no hub."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """Experiment -> a directory holding its model's config.json, for the GPU experiments.

    Their ``actor.path`` is a cluster path (/shared/models/...) this machine lacks, which a
    single-node preset would rightly refuse; the stand-in also gets the layout checked against
    the model's heads, layers and experts.
    """
    dirs = {}
    for experiment, config in (
        ("gsm8k_grpo_qwen2.5-7b_128gpu", QWEN25_7B),
        ("gsm8k_grpo_qwen3-30b-a3b_256gpu", QWEN3_30B_A3B),
    ):
        dirs[experiment] = str(write_model_dir(tmp_path_factory.mktemp(config["model_type"]), config))
    return dirs


def preset_yaml(name: str) -> dict:
    return yaml.safe_load((REPO / "configs" / "parallel" / f"{name}.yaml").read_text())


def dotted(tree: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        keys |= dotted(value, f"{path}.") if isinstance(value, dict) else {path}
    return keys


def test_the_issue_presets_exist():
    assert set(PRESETS) == set(MODEL_OF_PRESET)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_sets_the_layout_and_nothing_else(name):
    keys = dotted(preset_yaml(name))
    assert LAYOUT <= keys, f"{name} leaves {sorted(LAYOUT - keys)} to the experiment"
    assert keys <= LAYOUT | BACKEND_KEYS, f"{name} sets {sorted(keys - LAYOUT - BACKEND_KEYS)}, not layout keys"


@pytest.mark.parametrize("name", PRESETS)
def test_preset_header_says_what_it_is_for_and_how_to_compose(name):
    text = (REPO / "configs" / "parallel" / f"{name}.yaml").read_text()
    header = text[: text.index("\nallocation_mode:")]
    assert header.startswith("# Parallel-strategy preset:")
    assert all(line.startswith("#") for line in header.splitlines())
    for needle in (
        "Hardware:",
        f"Model: {'any' if name == 'cpu_1node' else 'sized for'}",
        f"--config configs/parallel/{name}.yaml",
        "docs/guides/parallel-strategies.md",
    ):
        assert needle in header, f"{name}: {needle!r} not in its header"
    assert name == "cpu_1node" or MODEL_OF_PRESET[name] in header


@pytest.mark.parametrize("name", PRESETS)
def test_preset_fits_its_cluster_and_model(name):
    preset = preset_yaml(name)
    alloc = AllocationMode.from_str(preset["allocation_mode"])
    cluster = preset["cluster"]
    validate_allocation(
        alloc,
        n_nodes=cluster["n_nodes"],
        n_gpus_per_node=cluster["n_gpus_per_node"],
        model=SHAPES[MODEL_OF_PRESET[name]],
    )
    if "sglang" in preset["allocation_mode"]:
        assert preset["weight_update"]["mode"] in ("broadcast", "disk")


def compose(experiment: str, preset: str, tmp_path: Path, model_dirs: dict[str, str]) -> list[str]:
    argv = [
        "--config",
        f"configs/{experiment}.yaml",
        "--config",
        f"configs/parallel/{preset}.yaml",
        f"cluster.fileroot={tmp_path}",
    ]
    return argv + ([f"actor.path={model_dirs[experiment]}"] if experiment in model_dirs else [])


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_preset_composes_with_every_experiment(experiment, preset, tmp_path, model_dirs, capsys):
    """Valid pairs load and render with the preset's layout and the experiment's everything else;
    the others fail in one line naming the mismatch and the preset file with its allocation and
    cluster size."""
    argv = compose(experiment, preset, tmp_path, model_dirs)
    layout = preset_yaml(preset)
    cluster = layout["cluster"]
    refused = REFUSED.get((experiment, preset))
    for command in (["config"], ["slurm", "--dry-run"]):
        status = main(command + argv)
        out, err = capsys.readouterr()
        if refused is not None:
            assert status == 2 and out == "" and len(err.strip().splitlines()) == 1
            assert refused in err
            assert (
                f"config file configs/parallel/{preset}.yaml: allocation_mode='{layout['allocation_mode']}', "
                f"cluster.n_nodes={cluster['n_nodes']}, cluster.n_gpus_per_node={cluster['n_gpus_per_node']}"
            ) in err
            continue
        assert status == 0, err
        if command == ["config"]:
            resolved, alone = yaml.safe_load(out), yaml.safe_load((REPO / "configs" / f"{experiment}.yaml").read_text())
            assert resolved["allocation_mode"] == layout["allocation_mode"]
            assert {k: resolved["cluster"][k] for k in cluster} == cluster
            assert resolved["actor"]["megatron"].items() >= layout["actor"]["megatron"].items()
            assert resolved["experiment_name"] == alone["experiment_name"]
            assert resolved["gconfig"].items() >= alone["gconfig"].items()
            assert resolved["train_dataset"]["batch_size"] == alone["train_dataset"]["batch_size"]
        else:
            assert f"#SBATCH --nodes={cluster['n_nodes']}" in out.splitlines()
            assert (f"#SBATCH --gpus-per-node={cluster['n_gpus_per_node']}" in out) == (cluster["device"] == "cuda")
            assert out.count("megarl serve") == 1 and "torchrun" in out
            subprocess.run(["bash", "-n"], input=out, text=True, check=True)


def test_most_pairs_are_valid():
    """Each preset runs at least the experiments of the model it is sized for (and the CPU and
    single-node presets all four)."""
    valid = {(e, p) for e in EXPERIMENTS for p in PRESETS} - set(REFUSED)
    assert len(valid) == 14
    assert {p for _, p in valid} == set(PRESETS)
    assert {e for e, p in valid if p in ("cpu_1node", "dense_7b_8gpu")} == set(EXPERIMENTS)


@pytest.mark.parametrize(
    "experiment,preset",
    [("gsm8k_grpo_qwen2.5-7b_128gpu", "dense_7b_128gpu"), ("gsm8k_grpo_qwen3-30b-a3b_256gpu", "moe_30b_256gpu")],
)
def test_the_big_experiments_use_their_preset_layout(experiment, preset):
    """Composing a shipped GPU experiment with the preset of its own layout changes nothing."""
    alone, _ = load_expr_config(["--config", f"configs/{experiment}.yaml"], GRPOConfig)
    composed, _ = load_expr_config(
        ["--config", f"configs/{experiment}.yaml", "--config", f"configs/parallel/{preset}.yaml"], GRPOConfig
    )
    assert to_yaml(composed) == to_yaml(alone)


BROKEN = [
    pytest.param(
        "n_nodes: 3",
        "vllm:d8t2+megatron:d2p2t4",
        "uses 16 (vllm:d8t2) + 16 (megatron:d2p2t4) = 32 devices, but the cluster has 3 nodes x 8 GPUs per node = 24",
        id="too-few-devices",
    ),
    pytest.param(
        "n_nodes: 3",
        "vllm:d3t2+megatron:d3p2t3",
        "the inference part 'vllm:d3t2' uses 6 devices, not a multiple of 8 GPUs per node",
        id="part-not-whole-nodes",
    ),
    pytest.param(
        "n_nodes: 1\n  n_gpus_per_node: 4",
        "vllm:d1t8+megatron:d1p1t1",
        "uses 8 (vllm:d1t8) + 1 (megatron:d1p1t1) = 9 devices, but the cluster has 1 nodes x 4",
        id="too-many",
    ),
]


@pytest.mark.parametrize("cluster,allocation,needle", BROKEN)
def test_preset_not_fitting_its_cluster_names_numbers_and_file(cluster, allocation, needle, tmp_path, capsys):
    text = (REPO / "configs" / "parallel" / "dense_7b_32gpu.yaml").read_text()
    text = text.replace("allocation_mode: vllm:d8t2+megatron:d2p2t4", f"allocation_mode: {allocation}")
    text = text.replace(
        "  n_nodes: 4\n  n_gpus_per_node: 8", f"  {cluster}" + ("" if "gpus" in cluster else "\n  n_gpus_per_node: 8")
    )
    preset = tmp_path / "my_preset.yaml"
    preset.write_text(text)
    assert main(["config", "--config", "configs/gsm8k_grpo_qwen2.5-7b_128gpu.yaml", "--config", str(preset)]) == 2
    err = capsys.readouterr().err
    assert "config error at 'allocation_mode'" in err and needle in err
    assert f"config file {preset}: allocation_mode='{allocation}', cluster.n_nodes=" in err


def test_run_takes_an_experiment_then_presets(tmp_path, monkeypatch):
    """``megarl run EXPERIMENT.yaml PRESET.yaml`` and ``... --config PRESET.yaml``: later files win."""
    import megarl.launcher.local as local

    ran = []
    monkeypatch.setattr(local, "check_local", lambda config: None)
    monkeypatch.setattr(local, "run_local", lambda config, out: ran.append(config) or 0)
    fileroot = f"cluster.fileroot={tmp_path}"
    assert main(["run", "configs/gsm8k_grpo_cpu.yaml", "configs/parallel/dense_7b_8gpu.yaml", fileroot]) == 0
    assert (
        main(["run", "configs/gsm8k_grpo_cpu.yaml", "--config", "configs/parallel/dense_7b_8gpu.yaml", fileroot]) == 0
    )
    for config in ran:
        assert config.allocation_mode == "vllm:d4t1+megatron:d2p2t1" and config.cluster.n_gpus_per_node == 8
        assert config.experiment_name == "gsm8k-grpo-cpu"
    # the run's launcher.log is closed when the run returns (nothing keeps writing into its directory)
    handlers = logging.getLogger("megarl").handlers
    assert not [h for h in handlers if isinstance(h, logging.FileHandler)], handlers


def test_launch_scripts_are_rendered_from_presets(tmp_path):
    """launch/*.sbatch are what launch/render.sh renders now, each from an experiment and a preset."""
    recipe = (REPO / "launch" / "render.sh").read_text()
    renders = [line.split() for line in recipe.splitlines() if line.startswith("render ")]
    shipped = sorted(p.name for p in (REPO / "launch").glob("*.sbatch"))
    assert sorted(f"{r[1]}.sbatch" for r in renders) == shipped
    assert all(r[3] in PRESETS and r[2] in EXPERIMENTS for r in renders)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["bash", "launch/render.sh", str(tmp_path)], env=env, check=True, capture_output=True, text=True)
    for name in shipped:
        assert (tmp_path / name).read_text() == (REPO / "launch" / name).read_text(), f"launch/{name} is stale"


def test_the_user_page_lists_every_preset_with_its_allocation():
    page = (REPO / "docs" / "guides" / "parallel-strategies.md").read_text()
    for name in PRESETS:
        row = next((line for line in page.splitlines() if line.startswith(f"| `configs/parallel/{name}.yaml`")), None)
        assert row is not None, f"docs/guides/parallel-strategies.md has no row for {name}"
        assert f"`{preset_yaml(name)['allocation_mode']}`" in row
