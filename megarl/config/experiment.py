"""The whole experiment: the config a run script loads with ``load_expr_config``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megarl.api.io_struct import GenerationHyperparameters
from megarl.config.allocation import AllocationError, AllocationMode, validate_allocation
from megarl.config.base import ConfigError, require
from megarl.config.bridge import WeightUpdateConfig
from megarl.config.rollout import (
    MAX_SERVED_LORA_RANK,
    InferenceEngineConfig,
    RewardConfig,
    SGLangConfig,
    VLLMConfig,
    WorkflowConfig,
)
from megarl.config.run import (
    ClusterConfig,
    DatasetConfig,
    EvaluatorConfig,
    LauncherConfig,
    RecoverConfig,
    SaverConfig,
    StatsLoggerConfig,
    WatchdogConfig,
)
from megarl.config.train import (
    ADV_ESTIMATOR_PRESETS,
    LOSS_PRESETS,
    AlgorithmConfig,
    PPOActorConfig,
    PPOCriticConfig,
    TrainEngineConfig,
)
from megarl.utils.hardware import machine_memory_gib
from megarl.utils.logging import is_rank0

logger = logging.getLogger("megarl.config")


@dataclass
class BaseExperimentConfig:
    """What every megarl experiment has: names, cluster, layout, data and run utilities."""

    experiment_name: str = "megarl"
    """Experiment name: groups trials under ``{fileroot}/{experiment_name}``."""
    trial_name: str = "trial0"
    """Trial name: one run of the experiment."""
    seed: int = 1
    """Seed of data order, initialisation and sampling."""
    total_train_epochs: int = 1
    """Epochs over the training set."""
    total_train_steps: int | None = None
    """Stop after this many steps (None: run ``total_train_epochs``)."""
    allocation_mode: str = "vllm:d1t1+megatron:d1p1t1"
    """Parallel strategy: inference servers + Megatron trainer (see ``megarl.config.allocation``)."""
    tokenizer_path: str = ""
    """Tokenizer directory or short name; empty means the actor's ``path``."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Machines."""
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """Training prompts."""
    valid_dataset: DatasetConfig | None = None
    """Evaluation prompts; None disables evaluation."""
    saver: SaverConfig = field(default_factory=SaverConfig)
    """Checkpoints."""
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    """Periodic evaluation."""
    recover: RecoverConfig = field(default_factory=RecoverConfig)
    """Crash recovery."""
    stats_logger: StatsLoggerConfig = field(default_factory=StatsLoggerConfig)
    """Metrics output."""
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    """How the launchers start servers and trainer."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """The hang watchdog: heartbeats of the trainer ranks, budgets per phase, what to do on a stall."""

    def check(self) -> None:
        for name in ("experiment_name", "trial_name"):
            value = getattr(self, name)
            require(
                bool(value) and "/" not in value and value not in (".", "..") and not any(c.isspace() for c in value),
                name,
                value,
                "must be a non-empty name without '/' or spaces (it becomes a directory, a job and a run name)",
            )
        require(0 <= self.seed < 2**32, "seed", self.seed, "must be in [0, 2**32) (numpy's seed range)")
        require(self.total_train_epochs >= 1, "total_train_epochs", self.total_train_epochs, "must be >= 1")
        if self.watchdog.action == "restart":
            require(
                self.recover.mode == "auto" and self.recover.retries > 0,
                "watchdog.action",
                "restart",
                f"restarts from a recover point: needs recover.mode=auto and recover.retries > 0 (got "
                f"mode={self.recover.mode!r}, retries={self.recover.retries})",
            )
        if self.total_train_steps is not None:
            require(self.total_train_steps >= 1, "total_train_steps", self.total_train_steps, "must be >= 1")
        try:
            alloc = AllocationMode.from_str(self.allocation_mode)
            validate_allocation(alloc, n_nodes=self.cluster.n_nodes, n_gpus_per_node=self.cluster.n_gpus_per_node)
        except AllocationError as err:
            raise ConfigError("allocation_mode", str(err)) from None
        self._check_schedules()

    def _check_schedules(self) -> None:
        """Recovery on needs recover points; evaluation asked for without data is said (it is skipped)."""
        evaluator = self.evaluator
        asked = [n for n in ("freq_epochs", "freq_steps", "freq_secs") if getattr(evaluator, n) is not None]
        if self.valid_dataset is None and (asked or evaluator.before_training) and is_rank0():
            logger.warning(
                "valid_dataset is null: no evaluation, although evaluator.%s is set", (asked or ["before_training"])[0]
            )
        recover = self.recover
        require(
            recover.mode == "disabled" or recover.freq_steps is not None or recover.freq_secs is not None,
            "recover.mode",
            recover.mode,
            "no recover point would ever be written (recover.freq_steps and freq_secs are null): set one, "
            "or recover.mode=disabled",
        )

    @property
    def allocation(self) -> AllocationMode:
        """The parsed ``allocation_mode``."""
        return AllocationMode.from_str(self.allocation_mode)

    @property
    def run_dir(self) -> Path:
        """``{fileroot}/{experiment_name}/{trial_name}``: where everything of this run goes."""
        return Path(self.cluster.fileroot) / self.experiment_name / self.trial_name


GROUP = 4
"""The default GRPO group: samples per prompt (``gconfig.n_samples``, ``actor.group_size``)."""


@dataclass
class GRPOConfig(BaseExperimentConfig):
    """GRPO / PPO with asynchronous rollouts (AReaL's ``GRPOConfig``)."""

    experiment_name: str = "gsm8k-grpo"
    """Experiment name: groups trials under ``{fileroot}/{experiment_name}``."""
    gconfig: GenerationHyperparameters = field(default_factory=lambda: GenerationHyperparameters(n_samples=GROUP))
    """Sampling of training rollouts (a GRPO group of :data:`GROUP` samples per prompt by default: a
    group of one is refused, its advantages are all 0)."""
    rollout: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    """Inference client and rollout pool."""
    actor: PPOActorConfig = field(default_factory=lambda: PPOActorConfig(group_size=GROUP))
    """The policy."""
    ref: TrainEngineConfig | None = None
    """Frozen reference model for the KL penalty; None uses the actor's initial weights when ``actor.kl_ctl > 0``."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """GRPO (group baseline) or PPO with a critic (GAE): ``algorithm.adv_estimator``."""
    critic: PPOCriticConfig | None = None
    """The value model of ``algorithm.adv_estimator: gae`` (required then, and only then)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """vLLM server options (when ``allocation_mode`` starts with ``vllm:``)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """SGLang server options (when ``allocation_mode`` starts with ``sglang:``)."""
    weight_update: WeightUpdateConfig = field(default_factory=WeightUpdateConfig)
    """How new weights reach the servers after each step (``megarl.bridge``)."""
    reward_fn: str = "megarl.reward.gsm8k.gsm8k_reward_fn"
    """The reward, ``fn(prompt, completions, prompt_ids, completion_ids, **row) -> float`` (handed to
    the workflows that take a ``reward_fn``): ``package.module.fn`` or ``path/to/file.py:fn``, found in
    the installed packages, then beside the config file, then in the working directory
    (:mod:`megarl.utils.plugins`)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How ``reward_fn`` is called: its timeout, and when its failures stop the run."""
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    """The rollout workflow of training: a built-in (``rlvr``, ``multi_turn``) or a user's class."""
    eval_workflow: WorkflowConfig | None = None
    """The workflow of evaluation; None: ``workflow`` with greedy decoding and one sample per prompt."""
    dynamic_filter: Literal["none", "uniform_reward"] = "none"
    """Reject groups before training: ``uniform_reward`` drops groups whose rewards are all equal
    (no learning signal under group-normalised advantages; DAPO's dynamic sampling) and samples
    others in their place. Without it such groups stay in the batch but cost no forward or backward
    (``actor.skip_zero_advantage``)."""

    @classmethod
    def preset_layers(cls, merged) -> list[tuple[str, dict]]:
        """The settings of ``algorithm.adv_estimator`` and of the built-in ``actor.loss`` named in
        ``merged`` (:data:`ADV_ESTIMATOR_PRESETS`, :data:`LOSS_PRESETS`), in that order."""
        from omegaconf import OmegaConf

        layers = []
        for key, presets in (("algorithm.adv_estimator", ADV_ESTIMATOR_PRESETS), ("actor.loss", LOSS_PRESETS)):
            name = OmegaConf.select(merged, key)
            preset = presets.get(name) if isinstance(name, str) else None
            if not preset:
                continue
            if is_rank0():
                logger.info(
                    "%s=%s sets %s where the config does not",
                    key,
                    name,
                    OmegaConf.to_container(OmegaConf.create(preset)),
                )
            layers.append((f"the {key}={name} preset", preset))
        return layers

    def check(self) -> None:
        super().check()
        alloc = self.allocation
        require(
            alloc.train is not None and alloc.inference is not None,
            "allocation_mode",
            self.allocation_mode,
            "GRPO needs an inference part and a training part, e.g. 'vllm:d1t1+megatron:d1p1t1'",
        )
        self._check_batching(alloc)
        self._check_sampling()
        self._check_servers(alloc)
        self._check_rollout(alloc)
        if self.ref is not None:
            require(self.ref.optimizer is None, "ref.optimizer", "set", "the reference model is frozen: leave it null")
        self._check_critic(alloc)
        self._check_lora()

    @property
    def adapter_sync(self) -> bool:
        """The servers serve the actor's LoRA adapters as an adapter (``weight_update.lora: adapter``)."""
        return self.actor.lora.enabled and self.weight_update.lora == "adapter"

    def _check_lora(self) -> None:
        """LoRA adapters run on the actor (not on ref or critic yet); adapter sync serves what servers can load."""
        if self.adapter_sync:
            experts = [m for m in self.actor.lora.target_modules if m.startswith("experts.")]
            require(
                not experts,
                "weight_update.lora",
                self.weight_update.lora,
                f"adapters on expert linears ({', '.join(experts)}) have no PEFT form the servers load yet: "
                "use 'merged' (docs/guides/lora.md)",
            )
            require(
                self.actor.lora.rank <= MAX_SERVED_LORA_RANK,
                "actor.lora.rank",
                self.actor.lora.rank,
                f"adapter sync: vLLM serves LoRA ranks up to {MAX_SERVED_LORA_RANK}; use 'merged' above that",
            )
        for key, cfg in (("ref", self.ref), ("critic", self.critic)):
            if cfg is not None:
                require(
                    not cfg.lora.enabled,
                    f"{key}.lora.rank",
                    cfg.lora.rank,
                    f"LoRA adapters on the {key} model are not supported yet (the actor's are): set rank 0 "
                    "(docs/guides/lora.md)",
                )

    def resolve_auto(self) -> None:
        """Turn every ``auto`` that depends on this machine into its choice, once, and log it in one line.

        ``cluster.device`` (CUDA if torch sees it), then the dtypes: trainer (actor, ref) and
        servers get the hardware's (:func:`megarl.utils.hardware.auto_dtype`; SGLang serves on
        CUDA, in bf16), the wire follows the servers. A saved config holds the concrete values,
        so the processes a launcher starts never decide again. An explicit bfloat16 on a CPU
        without native bf16 is kept, with a warning.
        """
        from megarl.utils.hardware import auto_dtype

        self.cluster.device = self.device
        chosen, why = auto_dtype(self.cluster.device)
        server_key, server = self._server_config()
        before = self.dtypes()
        for cfg in (self.actor, self.ref, self.critic, self.vllm):
            if cfg is not None and cfg.dtype == "auto":
                cfg.dtype = chosen
        if self.sglang.dtype == "auto":
            self.sglang.dtype = "bfloat16"
        if self.weight_update.dtype == "auto":
            self.weight_update.dtype = server.dtype
        wire = self.weight_update.dtype
        require(
            wire in (server.dtype, "float32"),
            "weight_update.dtype",
            wire,
            f"the servers hold {server_key}={server.dtype} weights: a {wire} wire would round them "
            f"({'and overflow bf16 range ' if wire == 'float16' else ''}so the consistency probe fails); use auto "
            f"(= the servers' dtype) or float32",
        )
        if self.adapter_sync and not self.weight_update.disk_path:  # where the servers read each version
            self.weight_update.disk_path = str(self.run_dir / "weight_updates")
        if self.adapter_sync and self.cluster.device == "cpu" and is_rank0():
            logger.warning(
                "weight_update.lora=adapter on CPU: vLLM-CPU decodes through its LoRA kernels several times "
                "slower than the merged model; weight_update.lora=merged is faster here "
                "(docs/guides/lora.md#learning-and-cost)"
            )
        resolved = [key for key, value in before.items() if value == "auto"]
        if resolved and is_rank0():
            logger.info("dtype %s for %s (auto on %s: %s)", chosen, ", ".join(resolved), self.cluster.device, why)
        forced = [key for key, value in before.items() if value == "bfloat16"]
        if self.cluster.device == "cpu" and chosen != "bfloat16" and forced and is_rank0():
            logger.warning(
                "%s set to bfloat16 on a CPU without native bf16 (%s); 'auto' picks %s", ", ".join(forced), why, chosen
            )

    def dtypes(self) -> dict[str, str]:
        """Every dtype of the run by key: trainer (actor[, ref]), servers, wire."""
        server_key, server = self._server_config()
        out = {"actor.dtype": self.actor.dtype}
        if self.ref is not None:
            out["ref.dtype"] = self.ref.dtype
        if self.critic is not None:
            out["critic.dtype"] = self.critic.dtype
        out[server_key] = server.dtype
        out["weight_update.dtype"] = self.weight_update.dtype
        return out

    def _server_config(self) -> tuple[str, VLLMConfig | SGLangConfig]:
        """The dtype key and the config of the servers ``allocation_mode`` starts."""
        if self.allocation_mode.startswith("sglang"):
            return "sglang.dtype", self.sglang
        return "vllm.dtype", self.vllm

    @property
    def device(self) -> str:
        """``cpu`` or ``cuda``: ``cluster.device``, where ``auto`` (before ``resolve_auto``) asks torch."""
        if self.cluster.device != "auto":
            return self.cluster.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def _check_critic(self, alloc: AllocationMode) -> None:
        gae = self.algorithm.adv_estimator == "gae"
        require(
            self.actor.adv_estimator == self.algorithm.adv_estimator,
            "actor.adv_estimator",
            self.actor.adv_estimator,
            f"must be algorithm.adv_estimator ({self.algorithm.adv_estimator}), which sets it: unset it",
            related=("algorithm.adv_estimator",),
        )
        require(
            not gae or self.critic is not None,
            "critic",
            None,
            "algorithm.adv_estimator=gae learns a value model: give a critic block (e.g. `critic: {}` for the actor's model)",
        )
        require(
            gae or self.critic is None,
            "algorithm.adv_estimator",
            self.algorithm.adv_estimator,
            "a critic is configured but only algorithm.adv_estimator=gae uses one: set it to gae, or critic: null",
        )
        if self.critic is None:
            return
        dp, n_mb, bs = alloc.train.dp, self.critic.ppo_n_minibatches, self.train_dataset.batch_size
        require(
            bs % (dp * n_mb) == 0,
            "train_dataset.batch_size",
            bs,
            f"must be divisible by data-parallel d{dp} x critic.ppo_n_minibatches {n_mb} = {dp * n_mb}",
            related=("allocation_mode", "critic.ppo_n_minibatches"),
        )

    def _check_batching(self, alloc: AllocationMode) -> None:
        dp = alloc.train.dp
        bs = self.train_dataset.batch_size
        require(
            bs % dp == 0,
            "train_dataset.batch_size",
            bs,
            f"must be divisible by the trainer's data-parallel size d{dp} so every rank gets whole groups",
            related=("allocation_mode",),
        )
        n_mb = self.actor.ppo_n_minibatches
        require(
            bs % (dp * n_mb) == 0,
            "train_dataset.batch_size",
            bs,
            f"must be divisible by data-parallel d{dp} x actor.ppo_n_minibatches {n_mb} = {dp * n_mb}",
            related=("allocation_mode", "actor.ppo_n_minibatches"),
        )
        n, g = self.gconfig.n_samples, self.workflow.group_size
        require(
            self.actor.group_size == self.group_size,
            "actor.group_size",
            self.actor.group_size,
            f"must equal gconfig.n_samples={n}"
            + (f" x workflow.group_size={g} = {n * g}" if g > 1 else "")
            + " (write `group_size: ${gconfig.n_samples}`)",
        )

    @property
    def group_size(self) -> int:
        """Trajectories per prompt (the GRPO group): ``gconfig.n_samples`` per workflow run, ``workflow.group_size`` runs."""
        return self.gconfig.n_samples * self.workflow.group_size

    @property
    def context_length(self) -> int:
        """Tokens the inference servers hold per sequence (prompt and answers of every turn)."""
        return self.sglang.context_length if self.allocation_mode.startswith("sglang") else self.vllm.max_model_len

    def _check_rollout(self, alloc: AllocationMode) -> None:
        """The pool's queue holds a batch; group-level statistics have groups of more than one (else a warning)."""
        queue, per_rank = self.rollout.queue_size, self.train_dataset.batch_size // alloc.train.dp
        require(
            queue is None or queue >= per_rank,
            "rollout.queue_size",
            queue,
            f"must hold one batch of a trainer rank: train_dataset.batch_size / d{alloc.train.dp} = {per_rank}",
            related=("train_dataset.batch_size", "allocation_mode"),
        )
        backend = alloc.inference.backend
        require(
            not self.rollout.return_routed_experts or backend == "sglang" or self.device == "cuda",
            "rollout.return_routed_experts",
            True,
            f"{backend} servers on CPU cannot report the experts they routed to (vLLM returns them through "
            "its Model Runner V2, which needs Triton: on CUDA only); SGLang servers, or vLLM on CUDA, can",
            related=("allocation_mode", "cluster.device"),
        )
        require(
            self.actor.routing_replay != "R3" or self.rollout.return_routed_experts,
            "actor.routing_replay",
            "R3",
            "replays the servers' routes: set rollout.return_routed_experts: true (servers that report them)",
            related=("rollout.return_routed_experts",),
        )
        require(
            not (alloc.colocated and self.device == "cuda") or self.weight_update.modes == ("disk",),
            "weight_update.mode",
            self.weight_update.mode,
            "a colocated allocation on GPU puts a trainer rank and a server worker on one GPU, and NCCL cannot "
            "join two ranks on the same GPU: use weight_update.mode=disk with weight_update.disk_path on local "
            "storage (e.g. /dev/shm/megarl) and no extra_modes",
            related=("allocation_mode",),
        )
        single = self.group_size == 1
        require(
            not (single and self.dynamic_filter == "uniform_reward"),
            "dynamic_filter",
            self.dynamic_filter,
            "a group of one sample always has a uniform reward, so every group would be dropped: "
            "sample gconfig.n_samples > 1, or dynamic_filter=none",
        )
        require(
            not (single and self.algorithm.adv_estimator == "grpo" and self.actor.adv_norm.mean_level == "group"),
            "gconfig.n_samples",
            self.gconfig.n_samples,
            "a GRPO group of one sample is its own baseline, so every advantage is 0 and nothing is learned: "
            "sample > 1 per prompt, or set actor.adv_norm.mean_level=batch (or algorithm.adv_estimator=gae)",
            related=("actor.adv_norm.mean_level", "algorithm.adv_estimator"),
        )

    def _check_sampling(self) -> None:
        require(
            self.actor.temperature == self.gconfig.temperature or self.gconfig.greedy,
            "actor.temperature",
            self.actor.temperature,
            f"must equal gconfig.temperature={self.gconfig.temperature} "
            "(logprobs are scored at the sampling temperature)",
        )
        for key in ("top_p", "top_k", "min_p"):
            ours, theirs = getattr(self.actor, key), getattr(self.gconfig, key)
            require(
                ours == theirs or not self.actor.replay_truncation or self.gconfig.greedy,
                f"actor.{key}",
                ours,
                f"must equal gconfig.{key}={theirs} (write `{key}: ${{gconfig.{key}}}`): the trainer replays the "
                "sampling's truncation; or set actor.replay_truncation=false to train on the full softmax",
            )
        require(
            not (self.gconfig.greedy and self.gconfig.n_samples > 1 and self.actor.adv_norm.mean_level == "group"),
            "gconfig.greedy",
            self.gconfig.greedy,
            f"greedy training rollouts make the gconfig.n_samples={self.gconfig.n_samples} samples of a group "
            "identical, so every group-normalised advantage is 0; sample with a temperature instead",
        )

    def _check_servers(self, alloc: AllocationMode) -> None:
        backend = alloc.inference.backend
        require(
            backend == "vllm" or self.cluster.device != "cpu",
            "allocation_mode",
            self.allocation_mode,
            "SGLang servers need CUDA, but cluster.device is 'cpu'; use 'vllm:' on CPU",
        )
        require(
            backend == "vllm" or "sharded" not in self.weight_update.modes,
            "weight_update.mode",
            self.weight_update.mode,
            f"sharded transfer needs vLLM servers; SGLang ({self.allocation_mode}) takes 'broadcast' or 'disk'",
        )
        self._check_server_args(backend)
        context_key = "vllm.max_model_len" if backend == "vllm" else "sglang.context_length"
        context = self.context_length
        probe = self.weight_update.probe_tokens
        require(
            self.weight_update.probe_sequences == 0 or probe < context,
            "weight_update.probe_tokens",
            probe,
            f"the probe generates this many tokens after a prompt: must be below {context_key}={context}",
        )
        new = self.gconfig.max_new_tokens
        for name, data in (("train_dataset", self.train_dataset), ("valid_dataset", self.valid_dataset)):
            if data is None:
                continue
            prompt = data.max_prompt_tokens
            if prompt is None:
                why = f"must exceed gconfig.max_new_tokens={new} to leave room for a prompt"
            else:
                why = (
                    f"must hold {name}.max_prompt_tokens={prompt} + gconfig.max_new_tokens={new} = "
                    f"{prompt + new} tokens (the server rejects longer requests)"
                )
            require((prompt or 1) + new <= context, context_key, context, why)

    def _check_server_args(self, backend: str) -> None:
        """``extra_args`` do not set what megarl sets; on CPU the KV cache fits the machine and its blocks."""
        dtype_key, server = self._server_config()
        key = dtype_key.partition(".")[0]
        owned = MANAGED_SERVER_FLAGS[backend]
        clash = [a.split("=", 1)[0] for a in server.extra_args if a.split("=", 1)[0] in owned]
        require(
            not clash,
            f"{key}.extra_args",
            server.extra_args,
            f"{clash} are set by megarl from its own keys ({', '.join(owned[f] for f in clash)}): set those instead",
        )
        if backend != "vllm" or self.device != "cpu":
            return
        block = self.vllm.block_size
        require(block is None or block % 32 == 0, "vllm.block_size", block, "vLLM-CPU takes multiples of 32")
        memory = machine_memory_gib()
        per_node = -(-self.allocation.inference.dp // self.cluster.n_nodes)
        kv = self.vllm.cpu_kvcache_space_gb * per_node
        require(
            memory is None or self.cluster.n_nodes > 1 or kv < memory,
            "vllm.cpu_kvcache_space_gb",
            self.vllm.cpu_kvcache_space_gb,
            f"{per_node} server(s) x {self.vllm.cpu_kvcache_space_gb} GiB of KV cache exceed this machine's "
            f"{memory:.0f} GiB of memory",
        )


MANAGED_SERVER_FLAGS = {
    "vllm": {
        "--model": "actor.path",
        "--host": "the launcher",
        "--port": "the launcher",
        "--dtype": "vllm.dtype",
        "--max-model-len": "vllm.max_model_len",
        "--max-num-seqs": "vllm.max_num_seqs",
        "--seed": "vllm.seed",
        "--tensor-parallel-size": "allocation_mode",
        "--block-size": "vllm.block_size",
        "--gpu-memory-utilization": "vllm.gpu_memory_utilization",
        "--api-key": "the launcher",
        "--enable-lora": "weight_update.lora",
        "--max-lora-rank": "actor.lora.rank",
    },
    "sglang": {
        "--model-path": "actor.path",
        "--host": "the launcher",
        "--port": "the launcher",
        "--dtype": "sglang.dtype",
        "--context-length": "sglang.context_length",
        "--tp-size": "allocation_mode",
        "--random-seed": "sglang.random_seed",
        "--mem-fraction-static": "sglang.mem_fraction_static",
        "--enable-lora": "weight_update.lora",
        "--max-lora-rank": "actor.lora.rank",
    },
}
"""Server flags megarl sets from a config key (flag -> key): ``extra_args`` may not repeat them."""
