"""Bad experiment configs fail at load time, before any process starts, naming key and value.

Every case is a few overrides of ``configs/gsm8k_grpo_cpu.yaml``, run through the loader the
run scripts call and through ``megarl config`` (exit status 2, one line on stderr). Cases
already in ``test_loader.py`` are not repeated here.
"""

import json
from pathlib import Path

import pytest

from megarl.config import ConfigError, GRPOConfig, load_expr_config
from megarl.config.experiment import (
    DATASET_SHORT_NAMES,
    MODEL_SHORT_NAMES,
    read_model_shape,
)
from megarl.launcher.cli import main

REPO = Path(__file__).resolve().parents[2]
CPU_YAML = "configs/gsm8k_grpo_cpu.yaml"
SGLANG_ON_GPU = ["allocation_mode=sglang:d1t1+megatron:d1p1t1", "cluster.device=cuda", "weight_update.mode=broadcast"]


@pytest.fixture(autouse=True)
def in_repo_offline(monkeypatch):
    """Relative paths resolve against the repository; the hub counts as unreachable."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)


def case(id, overrides, key, fragment):
    return pytest.param(overrides, key, fragment, id=id)


# (overrides of the CPU YAML, key path the error names, text of the bad value in the message)
BAD = [
    # the reward: a module that cannot be imported
    case("reward-module-missing", ["reward_fn=megarl.reward.nope.fn"], "reward_fn", "megarl.reward.nope.fn"),
    case("reward-not-a-path", ["reward_fn=gsm8k"], "reward_fn", "gsm8k"),
    # allocation mode vs cluster and model (SmolLM2-135M: 9 heads, 3 KV heads, 30 layers)
    case("devices-vs-cluster", ["cluster.n_gpus_per_node=4"], "allocation_mode", "nodes x 4 GPUs per node = 4"),
    case(
        "part-not-whole-nodes",
        ["cluster.n_nodes=2", "allocation_mode=vllm:d1t1+megatron:d3p1t1"],
        "allocation_mode",
        "'vllm:d1t1' uses 1 devices",
    ),
    case("malformed-allocation", ["allocation_mode=vllm:d1t1,megatron:d1p1t1"], "allocation_mode", "'d1t1,megatron"),
    case("no-inference-part", ["allocation_mode=megatron:d2p1t1"], "allocation_mode", "'megatron:d2p1t1'"),
    case(
        "sglang-on-cpu",
        ["allocation_mode=sglang:d1t1+megatron:d1p1t1", "weight_update.mode=broadcast"],
        "allocation_mode",
        "'sglang:d1t1+megatron:d1p1t1'",
    ),
    case(
        "trainer-tp-vs-heads",
        ["allocation_mode=vllm:d1t1+megatron:d1p1t2", "cluster.n_gpus_per_node=3"],
        "allocation_mode",
        "megatron tensor parallel t2 does not divide the model's 9 attention heads",
    ),
    case(
        "trainer-tp-vs-kv-heads",
        ["allocation_mode=vllm:d1t1+megatron:d1p1t9", "cluster.n_gpus_per_node=10"],
        "allocation_mode",
        "t9 does not divide the model's 3 key/value heads",
    ),
    case(
        "server-tp-vs-heads",
        ["allocation_mode=vllm:d1t2+megatron:d1p1t1", "cluster.n_gpus_per_node=3"],
        "allocation_mode",
        "vllm tensor parallel t2 does not divide the model's 9 attention heads",
    ),
    case(
        "pp-vs-layers",
        ["allocation_mode=vllm:d1t1+megatron:d1p4t1", "cluster.n_gpus_per_node=5"],
        "allocation_mode",
        "pipeline p4 x virtual v1 = 4 does not divide the model's 30 layers",
    ),
    # missing model
    case("model-short-name-typo", ["actor.path=smolm2-135m"], "actor.path", "'smolm2-135m'"),
    case("model-relative-path", ["actor.path=./models/no-such-model"], "actor.path", "'./models/no-such-model'"),
    case("model-absolute-path", ["actor.path=/no/such/model"], "actor.path", "'/no/such/model'"),
    case("model-hub-id", ["actor.path=HuggingFaceTB/SmolLM2-135M"], "actor.path", "'HuggingFaceTB/SmolLM2-135M'"),
    case("model-dir-without-config", ["actor.path=configs"], "actor.path", "'configs'"),
    case("model-is-a-file", [f"actor.path={CPU_YAML}"], "actor.path", f"'{CPU_YAML}'"),
    case("ref-model-missing", ["ref.path=smollm3"], "ref.path", "'smollm3'"),
    case("tokenizer-missing", ["tokenizer_path=./tok"], "tokenizer_path", "'./tok'"),
    # unknown keys, wrong types, bad choices
    case("unknown-nested-key", ["actor.optimzer.lr=1"], "actor.optimzer", "Did you mean: 'optimizer'"),
    case("unknown-key-in-optional", ["valid_dataset.spilt=test"], "valid_dataset.spilt", "'spilt'"),
    case("unknown-top-level-key", ["seeed=3"], "seeed", "'seeed'"),
    case("wrong-type", ["train_dataset.batch_size=abc"], "train_dataset.batch_size", "'abc'"),
    case("bad-choice", ["actor.optimizer.lr_scheduler_type=foo"], "actor.optimizer.lr_scheduler_type", "'foo'"),
    case("bad-recover-mode", ["recover.mode=sometimes"], "recover.mode", "'sometimes'"),
    # batch shapes
    case(
        "batch-vs-dp-x-minibatches",
        ["allocation_mode=vllm:d1t1+megatron:d2p1t1", "cluster.n_gpus_per_node=3", "actor.ppo_n_minibatches=4"],
        "train_dataset.batch_size",
        "d2 x actor.ppo_n_minibatches 4 = 8",
    ),
    case("minibatches-over-batch", ["actor.ppo_n_minibatches=8"], "train_dataset.batch_size", "ppo_n_minibatches 8"),
    case("group-vs-n-samples", ["gconfig.n_samples=8", "actor.group_size=4"], "actor.group_size", "n_samples=8"),
    case(
        "leave-one-out-group-of-one",
        ["gconfig.n_samples=1", "actor.adv_norm.mean_leave1out=true"],
        "actor.adv_norm.mean_leave1out",
        "group_size=1",
    ),
    # context length of the servers
    case("prompt-plus-generation", ["gconfig.max_new_tokens=900"], "vllm.max_model_len", "max_new_tokens=900 = 1412"),
    case(
        "generation-fills-context",
        ["train_dataset.max_prompt_tokens=null", "gconfig.max_new_tokens=1024"],
        "vllm.max_model_len",
        "gconfig.max_new_tokens=1024",
    ),
    case(
        "sglang-context",
        [*SGLANG_ON_GPU, "sglang.context_length=512"],
        "sglang.context_length",
        "max_prompt_tokens=512 + gconfig.max_new_tokens=128",
    ),
    # datasets
    case("dataset-missing-file", ["train_dataset.path=./data/no.jsonl"], "train_dataset.path", "'./data/no.jsonl'"),
    case("dataset-name-typo", ["train_dataset.path=gsm8kk"], "train_dataset.path", "'gsm8kk'"),
    case("dataset-hub-offline", ["train_dataset.path=openai/gsm8k"], "train_dataset.path", "'openai/gsm8k'"),
    case("dataset-wrong-suffix", [f"train_dataset.path={CPU_YAML}"], "train_dataset.path", f"'{CPU_YAML}'"),
    case("valid-split-missing", ["valid_dataset.split=validation"], "valid_dataset.split", "'validation'"),
    # sampling
    case("temperature-zero", ["gconfig.temperature=0"], "gconfig.temperature", "0.0 is invalid"),
    case("temperature-mismatch", ["gconfig.temperature=0.7"], "actor.temperature", "gconfig.temperature=0.7"),
    case("greedy-groups", ["gconfig.greedy=true"], "gconfig.greedy", "n_samples=4"),
    case("negative-sampling-seed", ["gconfig.seed=-1"], "gconfig.seed", "-1"),
    # weight updates
    case("sharded-with-sglang", [*SGLANG_ON_GPU, "weight_update.mode=sharded"], "weight_update.mode", "'sharded'"),
    case("disk-without-path", ["weight_update.mode=disk"], "weight_update.disk_path", "disk mode needs a directory"),
    # run utilities, optimizer, rollout
    case("saver-frequency", ["saver.freq_steps=0"], "saver.freq_steps", "0 is invalid"),
    case("evaluator-frequency", ["evaluator.freq_steps=-5"], "evaluator.freq_steps", "-5"),
    case("negative-lr", ["actor.optimizer.lr=-1e-6"], "actor.optimizer.lr", "-1e-06"),
    case("negative-staleness", ["rollout.max_staleness=-2"], "rollout.max_staleness", "-2"),
    case("no-concurrent-rollouts", ["rollout.max_concurrent_rollouts=0"], "rollout.max_concurrent_rollouts", "0"),
    # PPO with a critic
    case("gae-without-critic", ["algorithm.adv_estimator=gae"], "critic", "give a critic block"),
    case("critic-without-gae", ["critic={}"], "algorithm.adv_estimator", "only algorithm.adv_estimator=gae uses one"),
    case("critic-path-missing", ["algorithm.adv_estimator=gae", "critic.path=/no/such/critic"], "critic.path", "'/no/such/critic'"),
    case("critic-value-clip", ["algorithm.adv_estimator=gae", "critic.eps_clip=0"], "critic.eps_clip", "must be > 0"),
    case("critic-minibatches", ["algorithm.adv_estimator=gae", "critic.ppo_n_minibatches=3"], "train_dataset.batch_size",
         "critic.ppo_n_minibatches 3"),
]


@pytest.mark.parametrize("overrides,key,fragment", BAD)
def test_loader_names_key_and_value(overrides, key, fragment):
    with pytest.raises(ConfigError) as err:
        load_expr_config(["--config", CPU_YAML, *overrides], GRPOConfig)
    message = str(err.value)
    assert err.value.key == key, message
    assert f"'{key}'" in message and fragment in message, message
    assert "\n" not in message


@pytest.mark.parametrize("overrides,key,fragment", BAD)
def test_cli_exits_2_with_one_line(overrides, key, fragment, capsys):
    assert main(["config", "--config", CPU_YAML, *overrides]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith("megarl config: error: ") and f"'{key}'" in err and fragment in err, err


@pytest.mark.parametrize("path", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_shipped_configs_pass_offline(path, capsys):
    config, _ = load_expr_config(["--config", f"configs/{path}"], GRPOConfig)
    assert config.experiment_name
    assert main(["config", "--config", f"configs/{path}"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "overrides",
    [
        ["actor.path=SmolLM2"],  # short names ignore case, as resolve_model_path does
        ["ref.path=smollm2", "actor.kl_ctl=0.1"],
        ["cluster.n_nodes=2", "cluster.n_gpus_per_node=1", "actor.path=/shared/models/SmolLM2"],  # read on the nodes
        ["valid_dataset.path=megarl/data/gsm8k", "valid_dataset.split=dev"],  # a directory's splits are read late
        ["gconfig.greedy=true", "gconfig.n_samples=1", "gconfig.temperature=0"],
        ["gconfig.max_new_tokens=512"],  # 512 + 512 fills max_model_len 1024 exactly
        ["algorithm.adv_estimator=gae", "critic={}", "gconfig.n_samples=1", "actor.group_size=1"],  # PPO, one sample
    ],
    ids=str,
)
def test_good_edge_cases_pass(overrides):
    load_expr_config(["--config", CPU_YAML, *overrides], GRPOConfig)


def test_hub_dataset_passes_when_online(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    config, _ = load_expr_config(["--config", CPU_YAML, "train_dataset.path=openai/gsm8k:main"], GRPOConfig)
    assert config.train_dataset.path == "openai/gsm8k:main"


def test_local_model_dir_is_accepted_and_checked(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4})
    )
    load_expr_config(["--config", CPU_YAML, f"actor.path={tmp_path}"], GRPOConfig)
    with pytest.raises(ConfigError, match="t4 does not divide the model's 2 key/value heads"):
        load_expr_config(
            ["--config", CPU_YAML, f"actor.path={tmp_path}", "allocation_mode=vllm:d1t1+megatron:d1p1t4",
             "cluster.n_gpus_per_node=5"],
            GRPOConfig,
        )  # fmt: skip


def test_short_names_match_the_loaders():
    """The config layer's copies of the short names agree with the modules that resolve them."""
    from megarl.data.rl_dataset import SHORT_NAMES
    from megarl.models.provision import ALIASES, KNOWN_MODELS, default_cache_dir

    assert set(MODEL_SHORT_NAMES) == set(KNOWN_MODELS) | set(ALIASES)
    assert SHORT_NAMES is DATASET_SHORT_NAMES
    for name in KNOWN_MODELS:
        provisioned = default_cache_dir() / name
        if (provisioned / "config.json").is_file():
            assert read_model_shape(str(provisioned)) == MODEL_SHORT_NAMES[name]


def test_hub_model_id_says_it_is_not_downloaded():
    with pytest.raises(ConfigError, match="hub ids are not downloaded: fetch the model and give its directory"):
        load_expr_config(["--config", CPU_YAML, "actor.path=HuggingFaceTB/SmolLM2-135M"], GRPOConfig)
