"""A stateful dataloader over RL prompt rows, resumable mid-epoch from a checkpoint."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

logger = logging.getLogger(__name__)


def collate_rows(batch: list[dict]) -> list[dict]:
    """Keep a batch as the list of its rows (AReaL's ``lambda x: x``, but picklable for workers)."""
    return batch


class EpochSampler(Sampler[int]):
    """Row indices, epoch after epoch; epoch ``e`` is shuffled with seed ``seed + e``.

    Its state is ``(epoch, rows yielded in that epoch)``, so a restored sampler resumes at
    the same row, and every later epoch has the same order as in an uninterrupted run.
    (torchdata's own RandomSampler restores mid-epoch, but later epochs then differ:
    the loader draws its worker base seed from the same generator.) Each ``iter()`` is
    a new epoch, except the first one after ``load_state_dict``, which finishes the
    restored epoch.
    """

    def __init__(self, num_rows: int, *, shuffle: bool, seed: int):
        self.num_rows = num_rows
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.yielded = 0
        self._resuming = False

    def __len__(self) -> int:
        return self.num_rows

    def epoch_order(self, epoch: int) -> list[int]:
        """The row order of ``epoch``."""
        if not self.shuffle:
            return list(range(self.num_rows))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_rows, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        if self.yielded and not self._resuming:  # the previous iterator was abandoned
            self.epoch, self.yielded = self.epoch + 1, 0
        self._resuming = False
        epoch, start = self.epoch, self.yielded
        order = self.epoch_order(epoch)
        for position in range(start, len(order)):
            self.yielded = position + 1
            yield order[position]
        self.epoch, self.yielded = epoch + 1, 0

    def state_dict(self) -> dict:
        """Epoch in progress and rows already yielded in it."""
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the row after the last one yielded when ``state`` was taken."""
        self.epoch, self.yielded = int(state["epoch"]), int(state["yielded"])
        self._resuming = True


def create_dataloader(
    dataset,
    *,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 1,
    drop_last: bool = True,
    num_workers: int = 0,
) -> StatefulDataLoader:
    """A ``StatefulDataLoader`` yielding lists of ``batch_size`` rows.

    Rows come in the order of an :class:`EpochSampler`; ``state_dict()`` holds its
    position, so a loader restored with ``load_state_dict`` continues with exactly the
    batches the original would have produced, mid-epoch and in later (reshuffled) epochs.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be >= 0")
    if drop_last and len(dataset) < batch_size:
        # Such a loader yields nothing, and a training loop waiting on it never steps.
        raise ValueError(
            f"batch_size={batch_size} exceeds the {len(dataset)} rows of this rank's dataset "
            "with drop_last=True: no batch would ever be produced"
        )
    with warnings.catch_warnings():
        # torchdata 0.11 calls torch.set_vital, which torch >= 2.10 deprecates: noise only.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return _stateful_loader(dataset, batch_size, shuffle, seed, drop_last, num_workers)


def _stateful_loader(dataset, batch_size, shuffle, seed, drop_last, num_workers):
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=EpochSampler(len(dataset), shuffle=shuffle, seed=seed),
        # Only seeds workers; a private generator leaves the global torch RNG untouched.
        generator=torch.Generator().manual_seed(seed),
        drop_last=drop_last,
        num_workers=num_workers,
        collate_fn=collate_rows,
    )
