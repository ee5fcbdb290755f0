"""Datasets for RL: GSM8K (bundled) and custom jsonl/HF data, per-rank splits, stateful loaders."""

from megarl.data.dataloader import create_dataloader
from megarl.data.rl_dataset import HubUnreachableError, load_rl_dataset
from megarl.data.rows import DatasetRowError

__all__ = ["DatasetRowError", "HubUnreachableError", "create_dataloader", "load_rl_dataset"]
