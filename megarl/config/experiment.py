"""The whole experiment: the config a run script loads with ``load_expr_config``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from megarl.config.allocation import AllocationError, AllocationMode, ModelShape, validate_allocation, validate_model
from megarl.config.base import ConfigError, require
from megarl.config.bridge import WeightUpdateConfig
from megarl.config.rollout import GenerationHyperparameters, InferenceEngineConfig, SGLangConfig, VLLMConfig
from megarl.config.run import (
    ClusterConfig,
    DatasetConfig,
    EvaluatorConfig,
    LauncherConfig,
    RecoverConfig,
    SaverConfig,
    StatsLoggerConfig,
)
from megarl.config.train import PPOActorConfig, TrainEngineConfig


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

    def check(self) -> None:
        for name in ("experiment_name", "trial_name"):
            value = getattr(self, name)
            require(
                bool(value) and "/" not in value and value not in (".", ".."),
                name,
                value,
                "must be a non-empty name without '/' (it becomes a directory)",
            )
        require(self.total_train_epochs >= 1, "total_train_epochs", self.total_train_epochs, "must be >= 1")
        if self.total_train_steps is not None:
            require(self.total_train_steps >= 1, "total_train_steps", self.total_train_steps, "must be >= 1")
        try:
            alloc = AllocationMode.from_str(self.allocation_mode)
            validate_allocation(alloc, n_nodes=self.cluster.n_nodes, n_gpus_per_node=self.cluster.n_gpus_per_node)
        except AllocationError as err:
            raise ConfigError("allocation_mode", str(err)) from None

    @property
    def allocation(self) -> AllocationMode:
        """The parsed ``allocation_mode``."""
        return AllocationMode.from_str(self.allocation_mode)

    @property
    def run_dir(self) -> Path:
        """``{fileroot}/{experiment_name}/{trial_name}``: where everything of this run goes."""
        return Path(self.cluster.fileroot) / self.experiment_name / self.trial_name


@dataclass
class GRPOConfig(BaseExperimentConfig):
    """GRPO / PPO with asynchronous rollouts (AReaL's ``GRPOConfig``)."""

    experiment_name: str = "gsm8k-grpo"
    """Experiment name: groups trials under ``{fileroot}/{experiment_name}``."""
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    """Sampling of training rollouts."""
    rollout: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    """Inference client and rollout pool."""
    actor: PPOActorConfig = field(default_factory=PPOActorConfig)
    """The policy."""
    ref: TrainEngineConfig | None = None
    """Frozen reference model for the KL penalty; None uses the actor's initial weights when ``actor.kl_ctl > 0``."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """vLLM server options (when ``allocation_mode`` starts with ``vllm:``)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """SGLang server options (when ``allocation_mode`` starts with ``sglang:``)."""
    weight_update: WeightUpdateConfig = field(default_factory=WeightUpdateConfig)
    """How new weights reach the servers after each step (``megarl.bridge``)."""

    def check(self) -> None:
        super().check()
        alloc = self.allocation
        require(
            alloc.train is not None and alloc.inference is not None,
            "allocation_mode",
            self.allocation_mode,
            "GRPO needs an inference part and a training part, e.g. 'vllm:d1t1+megatron:d1p1t1'",
        )
        dp = alloc.train.dp
        bs = self.train_dataset.batch_size
        require(
            bs % dp == 0,
            "train_dataset.batch_size",
            bs,
            f"must be divisible by the trainer's data-parallel size d{dp} so every rank gets whole groups",
        )
        n_mb = self.actor.ppo_n_minibatches
        require(
            bs % (dp * n_mb) == 0,
            "train_dataset.batch_size",
            bs,
            f"must be divisible by data-parallel d{dp} x actor.ppo_n_minibatches {n_mb} = {dp * n_mb}",
        )
        require(
            self.actor.temperature == self.gconfig.temperature or self.gconfig.greedy,
            "actor.temperature",
            self.actor.temperature,
            f"must equal gconfig.temperature={self.gconfig.temperature} (logprobs are scored at the sampling temperature)",
        )
        require(
            self.actor.group_size == self.gconfig.n_samples,
            "actor.group_size",
            self.actor.group_size,
            f"must equal gconfig.n_samples={self.gconfig.n_samples} (write `group_size: ${{gconfig.n_samples}}`)",
        )
        shape = read_model_shape(self.actor.path)
        if shape is not None:
            try:
                validate_model(alloc, shape)
            except AllocationError as err:
                raise ConfigError("allocation_mode", f"{err} (model {self.actor.path})") from None
        require(
            alloc.inference.backend == "vllm" or "sharded" not in self.weight_update.modes,
            "weight_update.mode",
            self.weight_update.mode,
            f"sharded transfer needs vLLM servers; SGLang ({self.allocation_mode}) takes 'broadcast' or 'disk'",
        )
        if self.ref is not None:
            require(self.ref.optimizer is None, "ref.optimizer", "set", "the reference model is frozen: leave it null")


def read_model_shape(path: str) -> ModelShape | None:
    """The model's :class:`ModelShape` when ``path`` is a local HF directory, else None."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return None
    with open(config_file) as f:
        return ModelShape.from_hf_config(json.load(f))
