"""Small CPU tensors made and read on a thread that shares the interpreter with the trainer.

The rollout pool's event loop runs in a thread of the trainer's process. Nearly every dispatched
torch operation (``reshape``, ``sum``, ``t >= 0``, indexing, ``torch.ones``, ``detach``) releases the
interpreter lock while it runs; while the trainer's Python holds the lock (a step between its
kernels), the pool's thread then waits for it again, up to the interpreter's switch interval (5 ms)
per operation, for an operation on a few hundred numbers. A dozen of them per episode stalled the
pool's loop for hundreds of milliseconds at a few hundred episodes a second
(``benchmarks/scale_sim.py``'s ``loop_lag_p99_ms``). Building a tensor from a list through numpy and
reading one with ``tolist`` keep the lock: the per-episode paths of the pool (the trajectory, its
checks, the stats) use these two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_NUMPY_DTYPES = {
    torch.bool: np.bool_,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float32: np.float32,
    torch.float64: np.float64,
}


def host_tensor(values: Sequence[Any], dtype: torch.dtype) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` (nested lists give more dimensions), built in numpy."""
    return torch.from_numpy(np.array(values, dtype=_NUMPY_DTYPES[dtype]))


def host_list(tensor: torch.Tensor) -> list[Any]:
    """The elements of a CPU ``tensor`` in order, as a flat list of Python numbers."""
    values = tensor.tolist()
    for _ in range(tensor.dim() - 1):
        values = [v for row in values for v in row]
    return values if isinstance(values, list) else [values]
