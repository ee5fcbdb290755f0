"""Typed experiment configs, YAML + override loading, and the allocation-mode grammar.

The loader (``build_config_values``, ``load_config_values``, ``save_config``, ``to_yaml``: the
config's values checked; ``megarl.run.prelaunch.load_expr_config`` also checks what it names) is imported on
first use: it needs omegaconf, which the trainer's and the kernels' modules do not (they import
``megarl.config.train``), so they run where only torch is installed (a lent GPU machine).
"""

from megarl.api.io_struct import GenerationHyperparameters
from megarl.config.allocation import (
    AllocationError,
    AllocationMode,
    InferenceAllocation,
    ModelShape,
    TrainingAllocation,
    validate_allocation,
)
from megarl.config.base import ConfigError
from megarl.config.experiment import BaseExperimentConfig, GRPOConfig
from megarl.config.ppo import AlgorithmConfig, NormConfig, PPOActorConfig, PPOCriticConfig
from megarl.config.rollout import InferenceEngineConfig, SGLangConfig, VLLMConfig
from megarl.config.run import (
    ClusterConfig,
    DatasetConfig,
    EvaluatorConfig,
    RecoverConfig,
    SaverConfig,
    StatsLoggerConfig,
)
from megarl.config.train import MicroBatchSpec, OptimizerConfig, TrainEngineConfig

__all__ = [
    "AlgorithmConfig",
    "AllocationError",
    "AllocationMode",
    "BaseExperimentConfig",
    "ClusterConfig",
    "ConfigError",
    "DatasetConfig",
    "EvaluatorConfig",
    "GRPOConfig",
    "GenerationHyperparameters",
    "InferenceAllocation",
    "InferenceEngineConfig",
    "MicroBatchSpec",
    "ModelShape",
    "NormConfig",
    "OptimizerConfig",
    "PPOActorConfig",
    "PPOCriticConfig",
    "RecoverConfig",
    "SGLangConfig",
    "SaverConfig",
    "StatsLoggerConfig",
    "TrainEngineConfig",
    "TrainingAllocation",
    "VLLMConfig",
    "build_config_values",
    "load_config_values",
    "save_config",
    "to_yaml",
    "validate_allocation",
]


_LOADER = ("build_config_values", "load_config_values", "save_config", "to_yaml")
_RENAMED = ("build_config", "load_expr_config")  # megarl.config.loader.RENAMED: the old names, with a warning


def __getattr__(name: str):
    if name in _LOADER:
        from megarl.config import loader

        return getattr(loader, name)
    if name in _RENAMED:
        from megarl.config import loader

        return loader.renamed_loader(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
