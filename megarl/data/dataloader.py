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

    With ``world_size`` > 1 every epoch's order is cut into global batches of
    ``world_size * batch_size`` rows, and ``rank`` gets the ``rank``-th ``batch_size`` rows of
    each (whole global batches only): the ranks' shares are disjoint, and which rows a global
    batch holds does not depend on how many ranks share it.

    Its state is ``(epoch, rows yielded in that epoch)``, the rows counted over all ranks, so a
    restored sampler resumes at the same row, with another ``world_size`` too, and every later
    epoch has the same order as in an uninterrupted run. (torchdata's own RandomSampler restores
    mid-epoch, but later epochs then differ: the loader draws its worker base seed from the same
    generator.) Each ``iter()`` is a new epoch, except the first one after ``load_state_dict``,
    which finishes the restored epoch.
    """

    def __init__(
        self, num_rows: int, *, shuffle: bool, seed: int, batch_size: int = 1, rank: int = 0, world_size: int = 1
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must satisfy 0 <= rank < world_size={world_size}")
        self.num_rows = num_rows
        self.shuffle = shuffle
        self.seed = seed
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.epoch = 0
        self.yielded = 0  # this rank's rows
        self._resuming = False

    @property
    def _global_batch(self) -> int:
        return self.batch_size * self.world_size

    def __len__(self) -> int:
        if self.world_size == 1:
            return self.num_rows
        return self.num_rows // self._global_batch * self.batch_size

    def epoch_order(self, epoch: int) -> list[int]:
        """The row order of ``epoch`` (all ranks')."""
        if not self.shuffle:
            return list(range(self.num_rows))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_rows, generator=generator).tolist()

    def _row(self, position: int) -> int:
        """Where this rank's ``position``-th row of an epoch is in the epoch's order."""
        batch, offset = divmod(position, self.batch_size)
        return batch * self._global_batch + self.rank * self.batch_size + offset

    def __iter__(self) -> Iterator[int]:
        if self.yielded and not self._resuming:  # the previous iterator was abandoned
            self.epoch, self.yielded = self.epoch + 1, 0
        self._resuming = False
        epoch, start = self.epoch, self.yielded
        order = self.epoch_order(epoch)
        for position in range(start, len(self)):
            self.yielded = position + 1
            yield order[self._row(position)]
        self.epoch, self.yielded = epoch + 1, 0

    def state_dict(self) -> dict:
        """Epoch in progress and rows already yielded in it, over all ranks; and what the order depends on."""
        batches, offset = divmod(self.yielded, self.batch_size)
        yielded = batches * self._global_batch + offset * self.world_size
        return {"epoch": self.epoch, "yielded": yielded, **self._order_settings()}

    def _order_settings(self) -> dict:
        return {"num_rows": self.num_rows, "shuffle": self.shuffle, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the row after the last one yielded when ``state`` was taken (by any number of ranks).

        Another order than the state's (another ``seed``, ``shuffle`` or number of rows) is followed from
        the restored position, with a warning: the rest of the epoch then skips some rows and repeats others.
        """
        changed = {k: (state[k], v) for k, v in self._order_settings().items() if k in state and state[k] != v}
        if changed and self.rank == 0:
            logger.warning(
                "the dataset order differs from the recover point's (%s): the rest of epoch %d follows this "
                "run's order from row %d, so some of its prompts are skipped and others trained twice",
                ", ".join(f"{k} {was} -> {now}" for k, (was, now) in changed.items()),
                int(state["epoch"]),
                int(state["yielded"]),
            )
        batches, rest = divmod(int(state["yielded"]), self._global_batch)
        self.epoch, self.yielded = int(state["epoch"]), batches * self.batch_size + rest // self.world_size
        self._resuming = True


def create_dataloader(
    dataset,
    *,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 1,
    drop_last: bool = True,
    num_workers: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> StatefulDataLoader:
    """A ``StatefulDataLoader`` yielding lists of ``batch_size`` rows.

    Rows come in the order of an :class:`EpochSampler`; ``state_dict()`` holds its
    position, so a loader restored with ``load_state_dict`` continues with exactly the
    batches the original would have produced, mid-epoch and in later (reshuffled) epochs.
    ``rank`` of ``world_size`` data-parallel ranks, each with a loader over the whole
    ``dataset``: its ``batch_size`` rows of every global batch of ``world_size * batch_size``
    (``drop_last`` only); the state is the same on every rank and resumes at another ``world_size``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be >= 0")
    if world_size > 1 and not drop_last:
        raise ValueError(f"world_size={world_size}: ranks share whole global batches only (drop_last=True)")
    if drop_last and len(dataset) < batch_size * world_size:
        # Such a loader yields nothing, and a training loop waiting on it never steps.
        raise ValueError(
            f"batch_size={batch_size} x world_size={world_size} exceeds the {len(dataset)} rows of the dataset "
            "with drop_last=True: no batch would ever be produced"
        )
    sampler = EpochSampler(
        len(dataset), shuffle=shuffle, seed=seed, batch_size=batch_size, rank=rank, world_size=world_size
    )
    with warnings.catch_warnings():
        # torchdata 0.11 calls torch.set_vital, which torch >= 2.10 deprecates: noise only.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return _stateful_loader(dataset, batch_size, sampler, seed, drop_last, num_workers)


def _stateful_loader(dataset, batch_size, sampler, seed, drop_last, num_workers):
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        # Only seeds workers; a private generator leaves the global torch RNG untouched.
        generator=torch.Generator().manual_seed(seed),
        drop_last=drop_last,
        num_workers=num_workers,
        collate_fn=collate_rows,
    )
