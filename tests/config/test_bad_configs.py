"""Bad experiment configs fail at load time, before any process starts, naming key and value.

Every case is a few overrides of ``configs/gsm8k_grpo_cpu.yaml``, run through the loader the
run scripts call and through ``megarl config`` (exit status 2, one line on stderr). Cases
already in ``test_loader.py`` are not repeated here.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import ConfigError, GRPOConfig
from megarl.data.files import DATASET_SHORT_NAMES
from megarl.launcher.cli import main
from megarl.run.prelaunch import MODEL_SHORT_NAMES, load_expr_config, read_model_shape
from tests.config.bad_files import MODEL_FIELDS, write_bad_files, write_model_dir

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


TOP_K = ["teacher.addresses=[node:8000]", "teacher.top_k=4"]
"""A served teacher's top 4: the forward-KL term of the loss."""

# (overrides of the CPU YAML, key path the error names, text of the bad value in the message)
BAD = [
    # the cluster interface servers bind on Slurm
    case(
        "interface-with-space",
        ["launcher.slurm.network_interface='eth 0'"],
        "launcher.slurm.network_interface",
        "'eth 0'",
    ),
    # failed episodes: how often to run one again, how many in a row end the run
    case("episode-retries-negative", ["rollout.episode_retries=-1"], "rollout.episode_retries", "-1"),
    case("report-every-zero", ["stats_logger.report_every=0"], "stats_logger.report_every", "must be >= 1"),
    case(
        "colocated-gpu-over-nccl",
        ["allocation_mode=vllm:d1t1|megatron:d1p1t1", "cluster.n_gpus_per_node=1", "cluster.device=cuda"],
        "weight_update.mode",
        "NCCL cannot join two ranks on the same GPU",
    ),
    case(
        "colocated-unequal-parts",
        ["allocation_mode=vllm:d2t1|megatron:d1p1t1"],
        "allocation_mode",
        "both must use the same number",
    ),
    case(
        "routed-experts-on-vllm",
        ["rollout.return_routed_experts=true"],
        "rollout.return_routed_experts",
        "on CPU cannot report the experts",
    ),
    case(
        "r3-without-routes",
        ["actor.routing_replay=R3"],
        "actor.routing_replay",
        "set rollout.return_routed_experts: true",
    ),
    case(
        "replay-on-a-dense-model",
        ["actor.routing_replay=R2", "actor.ppo_n_minibatches=2"],
        "actor.routing_replay",
        "has no experts",
    ),
    case(
        "watchdog-phase-budget-zero",
        ["watchdog.phase_budget_s.build=0"],
        "watchdog.phase_budget_s.build",
        "must be > 0 seconds",
    ),
    case(
        "watchdog-silent-below-interval",
        ["watchdog.silent_s=1", "watchdog.interval_s=5"],
        "watchdog.silent_s",
        "longer than interval_s",
    ),
    case("max-failed-episodes-zero", ["rollout.max_failed_episodes=0"], "rollout.max_failed_episodes", "must be >= 1"),
    # the reward: a module that cannot be imported
    case("reward-module-missing", ["reward_fn=megarl.reward.nope.fn"], "reward_fn", "megarl.reward.nope.fn"),
    case("reward-not-a-path", ["reward_fn=gsm8k"], "reward_fn", "gsm8k"),
    case("reward-timeout-zero", ["reward.timeout_seconds=0"], "reward.timeout_seconds", "must be > 0 seconds"),
    case("reward-error-fraction", ["reward.max_error_fraction=0"], "reward.max_error_fraction", "must be in (0, 1]"),
    case("reward-error-window", ["reward.error_window=0"], "reward.error_window", "must be >= 1"),
    # allocation mode vs cluster and model (SmolLM2-135M: 9 heads, 3 KV heads, 30 layers)
    case("devices-vs-cluster", ["cluster.n_gpus_per_node=4"], "allocation_mode", "nodes x 4 GPUs per node = 4"),
    case(
        "part-not-whole-nodes",
        ["cluster.n_nodes=2", "allocation_mode=vllm:d1t1+megatron:d3p1t1"],
        "allocation_mode",
        "'vllm:d1t1' uses 1 devices",
    ),
    case(
        "context-parallel-shared-prefix",
        ["allocation_mode=vllm:d1t1+megatron:d1p1t1c2", "cluster.n_gpus_per_node=3", "actor.mb_spec.share_prefix=true"],
        "actor.mb_spec.share_prefix",
        "context parallel c2 cannot split",
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
    case(
        "critic-path-missing",
        ["algorithm.adv_estimator=gae", "critic.path=/no/such/critic"],
        "critic.path",
        "'/no/such/critic'",
    ),
    case("critic-value-clip", ["algorithm.adv_estimator=gae", "critic.eps_clip=0"], "critic.eps_clip", "must be > 0"),
    case(
        "critic-minibatches",
        ["algorithm.adv_estimator=gae", "critic.ppo_n_minibatches=3"],
        "train_dataset.batch_size",
        "critic.ppo_n_minibatches 3",
    ),
    # on-policy distillation
    case("teacher-no-address", ["teacher={}"], "teacher.addresses", "at least one"),
    case("teacher-bad-address", ["teacher.addresses=[teacher-node]"], "teacher.addresses[0]", "'teacher-node'"),
    case(
        "teacher-unused",
        ["teacher.addresses=[node:8000]", "actor.teacher_coef=0"],
        "actor.teacher_coef",
        "would score every trajectory for nothing",
    ),
    case("teacher-discount", ["actor.teacher_discount=1.5"], "actor.teacher_discount", "must be in [0, 1]"),
    case(
        "teacher-servers-and-path",
        ["teacher.addresses=[node:8000]", "teacher.path=smollm2"],
        "teacher.addresses",
        "takes no servers",
    ),
    case("teacher-path-missing", ["teacher.path=/no/such/teacher"], "teacher.path", "'/no/such/teacher'"),
    case(
        "no-reward-no-teacher",
        ["reward_fn=megarl.reward.base.no_reward_fn"],
        "reward_fn",
        "without a teacher block nothing would be learned",
    ),
    case(
        "no-reward-filtered",
        [
            "reward_fn=megarl.reward.base.no_reward_fn",
            "teacher.addresses=[node:8000]",
            "dynamic_filter=uniform_reward",
            "valid_dataset=null",
        ],
        "dynamic_filter",
        "no batch would ever fill",
    ),
    case("teacher-top-k", ["teacher.addresses=[node:8000]", "teacher.top_k=65"], "teacher.top_k", "must be in [0, 64]"),
    case(
        "teacher-top-k-truncated",
        [*TOP_K, "gconfig.top_p=0.9", "actor.top_p=0.9"],
        "actor.replay_truncation",
        "'top_p': 0.9",
    ),
    case("teacher-top-k-discount", [*TOP_K, "actor.teacher_discount=0.5"], "actor.teacher_discount", "replaces"),
    case(
        "no-reward-evaluated",
        ["reward_fn=megarl.reward.base.no_reward_fn", "teacher.addresses=[node:8000]"],
        "eval_workflow",
        "0 for every answer",
    ),
]


# Cases of the bad-input review (issue 20): each was accepted before launch, ended in a traceback, or
# got an error naming neither key nor value. ``@files`` is a directory of bad files (``bad_files``).
NOT_FINITE = [
    ("lr-inf", "actor.optimizer.lr=inf"),
    ("lr-nan", "actor.optimizer.lr=nan"),
    ("clip-inf", "actor.eps_clip=inf"),
    ("grad-clip-nan", "actor.optimizer.gradient_clipping=nan"),
    ("reward-scaling-nan", "actor.reward_scaling=nan"),
    ("entropy-nan", "actor.entropy_coeff=nan"),
    ("kl-inf", "actor.kl_ctl=inf"),
    ("top-p-nan", "gconfig.top_p=nan"),
    ("bucket-inf", "weight_update.bucket_mb=inf"),
    ("probe-threshold-nan", "weight_update.consistency_threshold=nan"),
    ("update-timeout-minus-inf", "weight_update.update_timeout=-inf"),
    ("request-timeout-inf", "rollout.request_timeout=inf"),
    ("backoff-nan", "rollout.retry_backoff=nan"),
    ("gpu-memory-nan", "vllm.gpu_memory_utilization=nan"),
    ("server-startup-inf", "vllm.startup_timeout=inf"),
    ("correction-upper-inf", "actor.rollout_correction.upper=inf"),
    ("adv-eps-nan", "actor.adv_norm.eps=nan"),
]
BAD += [
    case(f"not-finite-{name}", [override], override.split("=")[0], "must be a finite number")
    for name, override in NOT_FINITE
]
BAD += [
    case("not-finite-temperature", ["gconfig.temperature=inf", "actor.temperature=inf"], "gconfig.temperature", "inf"),
    # values out of their domain
    case("stop-id-negative", ["gconfig.stop_token_ids=[-1]"], "gconfig.stop_token_ids", "token ids are >= 0"),
    case(
        "stop-id-beyond-vocab", ["gconfig.stop_token_ids=[2,60000]"], "gconfig.stop_token_ids", "beyond the vocabulary"
    ),
    case("stop-string-empty", ["gconfig.stop=['']"], "gconfig.stop", "empty stop string"),
    case("server-port-too-big", ["rollout.server_addrs=[localhost:99999]"], "rollout.server_addrs[0]", "[1, 65535]"),
    case("server-port-zero", ["rollout.server_addrs=[10.0.0.1:0]"], "rollout.server_addrs[0]", "'10.0.0.1:0'"),
    case(
        "server-listed-twice",
        ["rollout.server_addrs=[10.0.0.1:8000,10.0.0.2:8000,10.0.0.1:8000]"],
        "rollout.server_addrs[2]",
        "listed twice (also server_addrs[0])",
    ),
    # a GRPO group of one: every advantage 0 (verl refuses it too)
    case("grpo-one-sample", ["gconfig.n_samples=1", "actor.group_size=1"], "gconfig.n_samples", "nothing is learned"),
    # LoRA started from adapters that are not there
    case(
        "lora-init-from-missing",
        ["actor.lora.rank=8", "actor.lora.init_from=/nonexistent/adapter"],
        "actor.lora.init_from",
        "does not exist",
    ),
    case(
        "lora-init-from-not-peft",
        ["actor.lora.rank=8", "actor.lora.init_from=configs"],
        "actor.lora.init_from",
        "without it",
    ),
    case("seed-negative", ["seed=-1"], "seed", "numpy's seed range"),
    case("seed-too-big", ["seed=1099511627776"], "seed", "1099511627776"),
    case("name-with-space", ["experiment_name=my run"], "experiment_name", "'my run'"),
    case("trial-with-space", ["trial_name=a b"], "trial_name", "without '/' or spaces"),
    case("slurm-time", ["launcher.slurm.time_limit=abc"], "launcher.slurm.time_limit", "Slurm's --time"),
    case("slurm-time-hours-only", ["launcher.slurm.time_limit=2h"], "launcher.slurm.time_limit", "'2h'"),
    case("slurm-mem", ["launcher.slurm.mem=lots"], "launcher.slurm.mem", "Slurm's --mem"),
    case(
        "slurm-rendezvous-timeout",
        ["launcher.slurm.rendezvous_timeout=0"],
        "launcher.slurm.rendezvous_timeout",
        "must be >= 1 second",
    ),
    case("env-name", ["launcher.env.1BAD=x"], "launcher.env", "'1BAD'"),
    case(
        "master-address", ["weight_update.master_address=not an address"], "weight_update.master_address", "host name"
    ),
    # cross-field
    case("queue-below-batch", ["rollout.queue_size=1"], "rollout.queue_size", "must hold one batch"),
    case(
        "probe-beyond-context",
        ["weight_update.probe_tokens=5000"],
        "weight_update.probe_tokens",
        "vllm.max_model_len=1024",
    ),
    case("batch-over-dataset", ["train_dataset.batch_size=100000"], "train_dataset.batch_size", "7473 rows"),
    case(
        "wire-narrower-than-server",
        ["weight_update.dtype=bfloat16", "vllm.dtype=float32"],
        "weight_update.dtype",
        "vllm.dtype=float32",
    ),
    case("wire-fp16", ["weight_update.dtype=float16"], "weight_update.dtype", "overflow"),
    case(
        "vllm-pipeline",
        ["allocation_mode=vllm:d1p2t1+megatron:d1p1t1", "cluster.n_gpus_per_node=3"],
        "allocation_mode",
        "pipeline parallel p2",
    ),
    case(
        "filter-groups-of-one",
        ["dynamic_filter=uniform_reward", "gconfig.n_samples=1", "actor.group_size=1"],
        "dynamic_filter",
        "uniform reward",
    ),
    case("recover-never-written", ["recover.mode=auto", "recover.freq_steps=null"], "recover.mode", "no recover point"),
    case("extra-arg-dtype", ["vllm.extra_args=[--dtype,half]"], "vllm.extra_args", "vllm.dtype"),
    case("extra-arg-port", ["vllm.extra_args=[--port=8000]"], "vllm.extra_args", "['--port']"),
    case("cpu-block-size", ["vllm.block_size=48"], "vllm.block_size", "multiples of 32"),
    case("kv-cache-over-memory", ["vllm.cpu_kvcache_space_gb=100000"], "vllm.cpu_kvcache_space_gb", "GiB of memory"),
    # merge and type errors that named neither key nor expected type
    case("block-as-string", ["actor.adv_norm=str"], "actor.adv_norm", "NormConfig block"),
    case(
        "empty-value",
        ["experiment_name="],
        "experiment_name",
        "the value is empty (null); expected a value of type str",
    ),
    case("block-as-int", ["actor=3"], "actor", "PPOActorConfig block"),
    case("block-as-list", ["gconfig=[1]"], "gconfig", "GenerationHyperparameters block"),
    case("env-as-list", ["launcher.env=[a,b]"], "launcher.env", "a mapping of names"),
    case("slurm-as-int", ["launcher.slurm=5"], "launcher.slurm", "SlurmConfig block"),
    # files: models, tokenizers, datasets, output directories
    case("model-config-fields", ["actor.path=@files/no_heads"], "actor.path", "num_attention_heads=None"),
    case("model-config-list", ["actor.path=@files/list"], "actor.path", "holds a list"),
    case("model-config-json", ["actor.path=@files/bad_json"], "actor.path", "bad_json/config.json"),
    case("model-type", ["actor.path=@files/gpt2"], "actor.path", "model_type 'gpt2'"),
    case("model-heads-string", ["actor.path=@files/heads_str"], "actor.path", "num_attention_heads='8'"),
    case("model-attention-bias", ["actor.path=@files/attention_bias"], "actor.path", "attention_bias: true"),
    case("model-qwen2-window", ["actor.path=@files/qwen2_window"], "actor.path", "use_sliding_window: true"),
    case("ref-config-fields", ["ref.path=@files/no_heads", "actor.kl_ctl=0.1"], "ref.path", "cannot build a model"),
    case(
        "critic-config-fields",
        ["algorithm.adv_estimator=gae", "critic.path=@files/list"],
        "critic.path",
        "holds a list",
    ),
    case("tokenizer-without-files", ["tokenizer_path=@files/gpt2"], "tokenizer_path", "no tokenizer.json"),
    case("chat-type-on-gsm8k", ["train_dataset.type=chat"], "train_dataset.type", "its rows fit type 'gsm8k'"),
    case(
        "skipping-rows-of-another-type",
        ["train_dataset.type=chat", "train_dataset.bad_rows=skip"],
        "train_dataset.type",
        "its rows fit type 'gsm8k'",
    ),
    case("gsm8k-type-on-chat", ["train_dataset.path=@files/chat.jsonl"], "train_dataset.type", "'chat'"),
    case("valid-type", ["valid_dataset.path=@files/chat.jsonl"], "valid_dataset.type", "no 'question' field"),
    case(
        "dataset-line-not-json", ["train_dataset.path=@files/broken.jsonl"], "train_dataset.path", "line 2 is not JSON"
    ),
    case("dataset-row-list", ["train_dataset.path=@files/lists.jsonl"], "train_dataset.path", "row 0 is a list"),
    case("dataset-empty", ["train_dataset.path=@files/empty.jsonl"], "train_dataset.path", "holds no rows"),
    case(
        "dataset-parquet-no-rows", ["train_dataset.path=@files/no_rows.parquet"], "train_dataset.path", "holds no rows"
    ),
    case("dataset-json-dict", ["train_dataset.path=@files/dict.json"], "train_dataset.path", "holds a dict"),
    case("dataset-invalid-utf8", ["train_dataset.path=@files/latin1.jsonl"], "train_dataset.path", "utf-8"),
    case(
        "dataset-smaller-than-batch",
        ["train_dataset.path=@files/two_rows.jsonl", "train_dataset.batch_size=4"],
        "train_dataset.batch_size",
        "2 rows",
    ),
    case(
        "dataset-dir-split", ["train_dataset.path=@files", "train_dataset.split=chat"], "train_dataset.type", "'gsm8k'"
    ),
    case(
        "dataset-dir-no-split",
        ["valid_dataset.path=megarl/data/gsm8k", "valid_dataset.split=dev"],
        "valid_dataset.split",
        "finds in it are ['test', 'train']",
    ),
    case(
        "dataset-hub-dir-split",
        ["train_dataset.path=@files/hub_layout", "train_dataset.split=test"],
        "train_dataset.split",
        "finds in it are ['train']",
    ),
    case("dataset-dir-empty", ["train_dataset.path=@files/no_data"], "train_dataset.path", "holds no data files"),
    case("eval-no-samples", ["evaluator.n_samples=0"], "evaluator.n_samples", "must be >= 1"),
    case("eval-temperature-zero", ["evaluator.temperature=0"], "evaluator.temperature", "null decodes greedily"),
    case("fileroot-is-file", ["cluster.fileroot=@files/chat.jsonl/out"], "cluster.fileroot", "is a file"),
    case("fileroot-unwritable", ["cluster.fileroot=/proc/megarl"], "cluster.fileroot", "cannot write in /proc"),
    case("heap-growth-not-above-1", ["cluster.cpu_heap_growth=1.0"], "cluster.cpu_heap_growth", "must be > 1"),
    case(
        "disk-path-unwritable",
        ["weight_update.mode=disk", "weight_update.disk_path=/proc/megarl"],
        "weight_update.disk_path",
        "cannot write",
    ),
    case(
        "resume-nothing", ["cluster.fileroot=@files/runs", "recover.mode=resume"], "recover.mode", "nothing to resume"
    ),
]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> str:
    return write_bad_files(tmp_path_factory.mktemp("bad_files"))


@pytest.mark.parametrize("overrides,key,fragment", BAD)
def test_loader_names_key_and_value(overrides, key, fragment, bad_files):
    overrides = [o.replace("@files", bad_files) for o in overrides]
    with pytest.raises(ConfigError) as err:
        load_expr_config(["--config", CPU_YAML, *overrides], GRPOConfig)
    message = str(err.value)
    assert err.value.key == key, message
    assert f"'{key}'" in message and fragment in message, message
    assert "\n" not in message


@pytest.mark.parametrize("overrides,key,fragment", BAD)
def test_cli_exits_2_with_one_line(overrides, key, fragment, capsys, bad_files):
    overrides = [o.replace("@files", bad_files) for o in overrides]
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
        ["gconfig.greedy=true", "gconfig.n_samples=1", "gconfig.temperature=0", "actor.adv_norm.mean_level=batch"],
        ["gconfig.max_new_tokens=512"],  # 512 + 512 fills max_model_len 1024 exactly
        ["algorithm.adv_estimator=gae", "critic={}", "gconfig.n_samples=1", "actor.group_size=1"],  # PPO, one sample
        ["valid_dataset=null", "evaluator.freq_steps=5"],  # evaluation skipped, with a warning
    ],
    ids=str,
)
def test_good_edge_cases_pass(overrides):
    load_expr_config(["--config", CPU_YAML, *overrides], GRPOConfig)


def test_a_directory_in_a_hub_snapshots_layout_passes(bad_files):
    config, _ = load_expr_config(["--config", CPU_YAML, f"train_dataset.path={bad_files}/hub_layout"], GRPOConfig)
    assert config.train_dataset.split == "train"


def test_hub_dataset_passes_when_online(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    config, _ = load_expr_config(["--config", CPU_YAML, "train_dataset.path=openai/gsm8k:main"], GRPOConfig)
    assert config.train_dataset.path == "openai/gsm8k:main"


def test_local_model_dir_is_accepted_and_checked(tmp_path):
    write_model_dir(
        tmp_path, {**MODEL_FIELDS, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4}
    )
    load_expr_config(["--config", CPU_YAML, f"actor.path={tmp_path}"], GRPOConfig)
    with pytest.raises(ConfigError, match="t4 does not divide the model's 2 key/value heads"):
        load_expr_config(
            [
                "--config",
                CPU_YAML,
                f"actor.path={tmp_path}",
                "allocation_mode=vllm:d1t1+megatron:d1p1t4",
                "cluster.n_gpus_per_node=5",
            ],
            GRPOConfig,
        )


def test_short_names_match_the_loaders():
    """One model-name table (megarl.models.names) for the checks and provisioning; its shapes are the files'."""
    from megarl.data.rl_dataset import SHORT_NAMES
    from megarl.models.families import MODEL_FAMILIES
    from megarl.models.names import ALIASES, MODEL_SHAPES
    from megarl.models.provision import KNOWN_MODELS, default_cache_dir
    from megarl.run.prelaunch import MODEL_TYPES

    assert set(KNOWN_MODELS) == set(MODEL_SHAPES)
    assert set(MODEL_SHORT_NAMES) == set(MODEL_SHAPES) | set(ALIASES)
    assert set(MODEL_TYPES) == set(MODEL_FAMILIES)
    assert SHORT_NAMES is DATASET_SHORT_NAMES
    for name in KNOWN_MODELS:
        provisioned = default_cache_dir() / name
        if (provisioned / "config.json").is_file():
            assert read_model_shape(str(provisioned)) == MODEL_SHORT_NAMES[name]


def test_the_model_name_table_imports_without_torch():
    """The planner and the checks read short names without paying for torch (seconds)."""
    code = "import sys, megarl.models.names, megarl.models.provision; assert 'torch' not in sys.modules, 'torch'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_hub_model_id_offline_and_not_cached_says_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="`megarl models fetch HuggingFaceTB/SmolLM2-135M`"):
        load_expr_config(["--config", CPU_YAML, "actor.path=HuggingFaceTB/SmolLM2-135M"], GRPOConfig)
