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
from megarl.config.checks import check_experiment
from megarl.config.ppo import ADV_ESTIMATOR_PRESETS, LOSS_PRESETS, AlgorithmConfig, PPOActorConfig, PPOCriticConfig
from megarl.config.rollout import (
    InferenceEngineConfig,
    RewardConfig,
    SGLangConfig,
    TeacherConfig,
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
from megarl.config.train import TrainEngineConfig
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
            "no recover point would be written before the last step (recover.freq_steps and freq_secs are null): set one, "
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
    """Frozen reference model for the KL penalty; None uses the actor's initial weights when ``actor.kl_ctl > 0``
    (a LoRA actor's: its own model with the adapters it started from, no second model)."""
    teacher: TeacherConfig | None = None
    """On-policy distillation: the servers of a teacher model that score each sampled trajectory; the actor's
    advantages gain ``-actor.teacher_coef`` x the per-token reverse KL to it. None: no teacher."""
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
        if self.ref is not None:
            require(self.ref.optimizer is None, "ref.optimizer", "set", "the reference model is frozen: leave it null")
        check_experiment(self, alloc)

    @property
    def adapter_sync(self) -> bool:
        """The servers serve the actor's LoRA adapters as an adapter (``weight_update.lora: adapter``)."""
        return self.actor.lora.enabled and self.weight_update.lora == "adapter"

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
        server_key, server = self.server_config()
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
        server_key, server = self.server_config()
        out = {"actor.dtype": self.actor.dtype}
        if self.ref is not None:
            out["ref.dtype"] = self.ref.dtype
        if self.critic is not None:
            out["critic.dtype"] = self.critic.dtype
        out[server_key] = server.dtype
        out["weight_update.dtype"] = self.weight_update.dtype
        return out

    def server_config(self) -> tuple[str, VLLMConfig | SGLangConfig]:
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

    @property
    def group_size(self) -> int:
        """Trajectories per prompt (the GRPO group): ``gconfig.n_samples`` per workflow run, ``workflow.group_size`` runs."""
        return self.gconfig.n_samples * self.workflow.group_size

    @property
    def context_length(self) -> int:
        """Tokens the inference servers hold per sequence (prompt and answers of every turn)."""
        return self.sglang.context_length if self.allocation_mode.startswith("sglang") else self.vllm.max_model_len
