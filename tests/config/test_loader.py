"""load_expr_config: YAML + overrides into typed, validated configs with key-path errors."""

from pathlib import Path

import pytest

from megarl.config import ConfigError, GRPOConfig, save_config, to_yaml
from megarl.config.train import OptimizerConfig
from megarl.run.prelaunch import load_expr_config
from tests.config.bad_files import MODEL_FIELDS, write_model_dir

REPO = Path(__file__).resolve().parents[2]
CPU_YAML = str(REPO / "configs" / "gsm8k_grpo_cpu.yaml")


def load(*overrides, files=(CPU_YAML,)):
    argv = [a for f in files for a in ("--config", f)] + list(overrides)
    return load_expr_config(argv, GRPOConfig)


def test_acceptance_call_applies_override(monkeypatch):
    monkeypatch.chdir(REPO)
    config, rest = load_expr_config(["--config", "configs/gsm8k_grpo_cpu.yaml", "actor.optimizer.lr=2e-6"], GRPOConfig)
    assert isinstance(config, GRPOConfig)
    assert isinstance(config.actor.optimizer, OptimizerConfig)
    assert config.actor.optimizer.lr == 2e-6
    assert rest == []


def test_yaml_values_and_defaults_are_typed():
    config, _ = load("gconfig.n_samples=8", 'gconfig.stop=["Question:", "\\n\\n"]')
    assert config.experiment_name == "gsm8k-grpo-cpu"  # from the YAML
    assert config.gconfig.n_samples == 8  # override wins
    assert config.gconfig.stop == ["Question:", "\n\n"]
    assert config.actor.eps_clip == 0.2 and isinstance(config.actor.eps_clip, float)
    assert config.rollout.request_retries == 3
    assert config.allocation.train.dp == 1
    assert config.run_dir == Path("outputs/gsm8k-grpo-cpu/trial0")


def test_unrecognised_args_are_returned():
    _, rest = load("--local-rank", "0", "actor.optimizer.lr=1e-5", "script.py")
    assert rest == ["--local-rank", "0", "script.py"]


def test_later_files_override_earlier(tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("allocation_mode: vllm:d2t1+megatron:d2p1t1\ncluster:\n  n_gpus_per_node: 4\n")
    config, _ = load(files=(CPU_YAML, str(preset)))
    assert config.allocation_mode == "vllm:d2t1+megatron:d2p1t1"
    assert config.cluster.n_gpus_per_node == 4
    assert config.gconfig.max_new_tokens == 128  # untouched keys keep the first file's values


@pytest.mark.parametrize(
    "override,key,needle",
    [
        ("actor.optimizer.lrr=1e-5", "actor.optimizer.lrr", "Did you mean: 'lr'"),
        ("actr.path=x", "actr", "Key 'actr' not in 'GRPOConfig'"),
        ("actor.optimizer.lr=fast", "actor.optimizer.lr", "'fast'"),
        ("gconfig.n_samples=2.5", "gconfig.n_samples", "'2.5'"),
        ("actor.adv_norm.mean_level=grp", "actor.adv_norm.mean_level", "expected one of ['group', 'batch', 'none']"),
        ("rollout.max_staleness=-1", "rollout.max_staleness", "-1 is invalid"),
        ("gconfig.top_p=1.5", "gconfig.top_p", "1.5 is invalid"),
        ("actor.c_clip=0.5", "actor.c_clip", "dual-clip constant must be > 1"),
        ("rollout.server_addrs=[localhost]", "rollout.server_addrs[0]", "expected 'host:port'"),
        ("allocation_mode=vllm:d2t1+megatron:d1p1t1", "allocation_mode", "= 3 devices, but the cluster has"),
        ("allocation_mode=vllm:d1t1+megatron:d1p1x1", "allocation_mode", "unknown size 'x'1"),
        ("train_dataset.batch_size=0", "train_dataset.batch_size", "0 is invalid"),
        ("experiment_name=a/b", "experiment_name", "without '/'"),
        ("actor.temperature=0.7", "actor.temperature", "must equal gconfig.temperature=1.0"),
        ("actor.optimizer=null", "actor.optimizer", "needs an optimizer"),
        ("actor.group_size=2", "actor.group_size", "must equal gconfig.n_samples=4"),
        ("ref.path=smollm2", "ref.optimizer", None),  # a ref with no optimizer is fine
    ],
)
def test_bad_values_name_their_key(override, key, needle):
    if needle is None:
        config, _ = load(override)
        assert config.ref.optimizer is None
        return
    with pytest.raises(ConfigError) as err:
        load(override)
    assert err.value.key == key
    assert key in str(err.value) and needle in str(err.value)


def test_batch_size_must_split_over_dp_and_minibatches():
    with pytest.raises(ConfigError, match="divisible by the trainer's data-parallel size d2"):
        load("allocation_mode=vllm:d1t1+megatron:d2p1t1", "cluster.n_gpus_per_node=3", "train_dataset.batch_size=3")
    with pytest.raises(ConfigError, match=r"d1 x actor.ppo_n_minibatches 3 = 3"):
        load("actor.ppo_n_minibatches=3")


def test_model_dir_is_checked_against_layout(tmp_path):
    config = {**MODEL_FIELDS, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}
    model = write_model_dir(tmp_path / "model", config)
    with pytest.raises(ConfigError, match="t2 does not divide the model's 9 attention heads"):
        load(f"actor.path={model}", "allocation_mode=vllm:d1t1+megatron:d1p1t2", "cluster.n_gpus_per_node=3")
    config, _ = load(f"actor.path={model}", "allocation_mode=vllm:d1t1+megatron:d1p1t3", "cluster.n_gpus_per_node=4")
    assert config.allocation.train.tp == 3


@pytest.mark.parametrize(
    "content,needle",
    [
        ("actor: [1, 2\n", "not valid YAML"),
        ("- a\n- b\n", "must hold a mapping"),
        ("actor:\n  optimizer:\n    lr: [1]\n", "actor.optimizer.lr"),
        ("unknown_section:\n  x: 1\n", "Key 'unknown_section' not in 'GRPOConfig'"),
    ],
)
def test_bad_yaml_files(tmp_path, content, needle):
    bad = tmp_path / "bad.yaml"
    bad.write_text(content)
    with pytest.raises(ConfigError) as err:
        load(files=(CPU_YAML, str(bad)))
    assert needle in str(err.value)


def test_missing_file_and_malformed_override():
    with pytest.raises(ConfigError, match="cannot parse the value of override 'gconfig.stop=\\[a:,b\\]'"):
        load("gconfig.stop=[a:,b]")
    with pytest.raises(ConfigError, match="does not exist"):
        load(files=("no/such/file.yaml",))
    with pytest.raises(ConfigError, match="not of the form key.path=value"):
        load("actor..path=x")


def test_save_config_round_trips(tmp_path):
    config, _ = load("actor.optimizer.lr=3e-6", f"cluster.fileroot={tmp_path}", "gconfig.stop=['a: b', '#']")
    written = save_config(config)
    assert written == tmp_path / "gsm8k-grpo-cpu" / "trial0" / "config.yaml"
    reloaded, _ = load_expr_config(["--config", str(written)], GRPOConfig)
    assert reloaded == config
    assert to_yaml(reloaded) == written.read_text()


def test_group_size_follows_n_samples_by_interpolation():
    config, _ = load("gconfig.n_samples=8")
    assert config.actor.group_size == 8


def test_defaults_alone_are_valid():
    config, _ = load_expr_config([], GRPOConfig)
    assert config.allocation_mode == "vllm:d1t1+megatron:d1p1t1"


def test_every_shipped_config_loads():
    shipped = sorted((REPO / "configs").glob("*.yaml"))
    assert shipped, "configs/ holds no experiment YAML"
    for path in shipped:
        config, _ = load_expr_config(["--config", str(path)], GRPOConfig)
        assert config.allocation.world_size == config.cluster.n_nodes * config.cluster.n_gpus_per_node


AREAL_ROLLOUT_SECTION = """\
tokenizer_path: ${actor.path}
rollout:
  fileroot: ${cluster.fileroot}
  tokenizer_path: ${tokenizer_path}
  dump_to_file: true
  group_size: 2
actor:
  group_size: 8  # gconfig.n_samples 4 x 2 runs per prompt
"""


def test_areal_rollout_keys_in_a_yaml_file(tmp_path, caplog):
    """The rollout section of AReaL's own GSM8K YAML (plus the documented ``group_size``) loads."""
    areal = tmp_path / "areal.yaml"
    areal.write_text(AREAL_ROLLOUT_SECTION)
    with caplog.at_level("INFO", logger="megarl.config"):
        config, _ = load(files=(CPU_YAML, str(areal)))
    assert config.rollout.dump_trajectories is True
    assert config.workflow.group_size == 2 and config.group_size == 8
    assert config.cluster.fileroot == "outputs" and config.tokenizer_path == "smollm2-135m-instruct"
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AReaL key")]
    assert notes == [
        f"AReaL key rollout.dump_to_file is megarl's rollout.dump_trajectories (in config file {areal})",
        f"AReaL key rollout.fileroot is megarl's cluster.fileroot (in config file {areal})",
        f"AReaL key rollout.tokenizer_path is megarl's tokenizer_path (in config file {areal})",
        f"AReaL key rollout.group_size is megarl's workflow.group_size (in config file {areal})",
    ]


def test_areal_rollout_keys_on_the_command_line(tmp_path, caplog):
    with caplog.at_level("INFO", logger="megarl.config"):
        config, _ = load(
            "rollout.dump_to_file=true",
            f"rollout.fileroot={tmp_path}",
            "rollout.tokenizer_path=smollm2-135m-instruct",
            "rollout.group_size=2",
            "+actor.group_size=8",  # Hydra's "add the key", as AReaL's commands write some overrides
            "rollout.max_head_offpolicyness=3",
        )
    assert config.rollout.dump_trajectories is True and config.rollout.max_staleness == 3
    assert config.cluster.fileroot == str(tmp_path) and config.run_dir == tmp_path / "gsm8k-grpo-cpu" / "trial0"
    assert config.tokenizer_path == "smollm2-135m-instruct"
    assert config.workflow.group_size == 2 and config.group_size == 8
    assert "AReaL key rollout.group_size is megarl's workflow.group_size (in command-line overrides)" in caplog.text


def test_an_areal_key_contradicting_its_megarl_key_is_an_error():
    contradiction = r"rollout.group_size=2 contradicts workflow.group_size=3 .*: keep workflow.group_size only"
    with pytest.raises(ConfigError, match=contradiction):
        load("rollout.group_size=2", "workflow.group_size=3")
    config, _ = load("rollout.group_size=2", "workflow.group_size=2", "actor.group_size=8")  # said twice: fine
    assert config.workflow.group_size == 2


def test_the_values_only_loaders_old_names_still_load_and_warn(tmp_path):
    """``megarl.config.load_expr_config`` / ``build_config`` were renamed for what they check (the
    values only); the old names give the same functions, with a warning naming both loaders."""
    import megarl.config as config_module
    from megarl.config import loader

    for old, new in loader.RENAMED.items():
        for module in (config_module, loader):
            with pytest.warns(DeprecationWarning, match=rf"now megarl\.config\.{new}.*megarl\.run\.prelaunch\.{old}"):
                assert getattr(module, old) is getattr(loader, new)
    model = tmp_path / "not-a-model"  # the values-only loader reads nothing the config names
    config, _ = loader.load_config_values(["--config", CPU_YAML, f"actor.path={model}"], GRPOConfig)
    assert config.actor.path == str(model)
    with pytest.raises(ConfigError, match="actor.path"):
        load(f"actor.path={model}")
