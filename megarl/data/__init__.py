"""Datasets for RL: GSM8K (bundled) and custom jsonl/HF data, per-rank splits, stateful loaders.

The loaders (torch, ``datasets``) are imported on first use, so that the config checks can read
:mod:`megarl.data.rows` (the row types) in a light process.
"""

import importlib

from megarl.data.rows import DatasetRowError

_LAZY = {
    "create_dataloader": "megarl.data.dataloader",
    "HubUnreachableError": "megarl.data.rl_dataset",
    "load_rl_dataset": "megarl.data.rl_dataset",
}
__all__ = ["DatasetRowError", "HubUnreachableError", "create_dataloader", "load_rl_dataset"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megarl.data' has no attribute {name!r}")
