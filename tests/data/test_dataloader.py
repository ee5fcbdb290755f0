"""create_dataloader: batches of rows, deterministic reshuffles, state that survives a restart."""

from __future__ import annotations

import itertools
import pickle

import datasets
import pytest
import torch

from megarl.data import create_dataloader, load_rl_dataset
from megarl.data.dataloader import collate_rows

N_ROWS, BATCH = 22, 4  # 5 full batches per epoch, 2 rows dropped


@pytest.fixture
def rows():
    return datasets.Dataset.from_dict({"id": list(range(N_ROWS))})


def ids(batches):
    return [[row["id"] for row in batch] for batch in batches]


def epochs(loader, n):
    """``n`` consecutive epochs of ``loader``, each a list of batches of row ids."""
    return [ids(loader) for _ in range(n)]


def restart(loader, tmp_path, **kwargs):
    """A fresh loader restored from ``loader``'s state, saved and loaded like a checkpoint."""
    torch.save(loader.state_dict(), tmp_path / "loader.pt")
    fresh = create_dataloader(kwargs.pop("dataset"), batch_size=BATCH, **kwargs)
    fresh.load_state_dict(torch.load(tmp_path / "loader.pt", weights_only=False))
    return fresh


def test_batches_are_lists_of_rows_and_drop_last(rows):
    (epoch,) = epochs(create_dataloader(rows, batch_size=BATCH), 1)
    assert len(epoch) == N_ROWS // BATCH and all(len(b) == BATCH for b in epoch)
    assert len(set(itertools.chain(*epoch))) == N_ROWS // BATCH * BATCH
    kept = epochs(create_dataloader(rows, batch_size=BATCH, drop_last=False), 1)[0]
    assert sorted(itertools.chain(*kept)) == list(range(N_ROWS))


def test_gsm8k_rows_come_out_as_dicts():
    loader = create_dataloader(load_rl_dataset("gsm8k", "test"), batch_size=8, shuffle=False)
    first = next(iter(loader))
    assert isinstance(first, list) and len(first) == 8
    assert {"messages", "answer", "solution"} <= set(first[0])


def test_shuffle_is_seeded_and_reshuffles_each_epoch(rows):
    one, two = epochs(create_dataloader(rows, batch_size=BATCH, seed=7), 2)
    assert one != two  # a new order each epoch
    assert epochs(create_dataloader(rows, batch_size=BATCH, seed=7), 2) == [one, two]
    assert epochs(create_dataloader(rows, batch_size=BATCH, seed=8), 1)[0] != one
    ordered = epochs(create_dataloader(rows, batch_size=BATCH, shuffle=False), 1)[0]
    assert list(itertools.chain(*ordered)) == list(range(N_ROWS // BATCH * BATCH))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("epochs_before", [0, 1])
@pytest.mark.parametrize("consumed", [0, 2, 5])  # 5: every full batch of the epoch taken
def test_state_round_trips_mid_epoch_and_across_epochs(rows, tmp_path, num_workers, epochs_before, consumed):
    reference = epochs(create_dataloader(rows, batch_size=BATCH, num_workers=num_workers), 3)
    loader = create_dataloader(rows, batch_size=BATCH, num_workers=num_workers)
    assert epochs(loader, epochs_before) == reference[:epochs_before]
    head = ids(itertools.islice(iter(loader), consumed))

    resumed = restart(loader, tmp_path, dataset=rows, num_workers=num_workers)
    assert head + ids(resumed) == reference[epochs_before]  # the rest of the epoch
    assert ids(resumed) == reference[epochs_before + 1]  # and the next, reshuffled


def test_state_saved_after_a_finished_epoch_starts_the_next(rows, tmp_path):
    reference = epochs(create_dataloader(rows, batch_size=BATCH), 2)
    loader = create_dataloader(rows, batch_size=BATCH)
    epochs(loader, 1)
    assert ids(restart(loader, tmp_path, dataset=rows)) == reference[1]


def test_a_resume_in_another_order_says_so(rows, tmp_path, caplog):
    """A resumed run with another seed follows its own order from the restored row: the rest of the epoch
    skips some prompts and repeats others, which the warning says (the same seed says nothing)."""
    loader = create_dataloader(rows, batch_size=BATCH, seed=1)
    batches = iter(loader)
    next(batches), next(batches)
    with caplog.at_level("WARNING", logger="megarl.data.dataloader"):
        next(iter(restart(loader, tmp_path, dataset=rows, seed=1)))  # the sampler's state is read at iter()
        assert "dataset order differs" not in caplog.text
        next(iter(restart(loader, tmp_path, dataset=rows, seed=2)))
    assert "differs from the recover point's (seed 1 -> 2): the rest of epoch 0 follows" in caplog.text


def test_a_new_iterator_after_an_abandoned_one_is_a_new_epoch(rows):
    reference = epochs(create_dataloader(rows, batch_size=BATCH), 2)
    loader = create_dataloader(rows, batch_size=BATCH)
    next(iter(loader))
    assert ids(loader) == reference[1]


def shares(world_size: int, **kwargs) -> list:
    """A loader per data-parallel rank, each over the whole dataset, of ``BATCH // world_size`` rows a batch."""
    return [
        create_dataloader(batch_size=BATCH // world_size, rank=r, world_size=world_size, **kwargs)
        for r in range(world_size)
    ]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_data_parallel_ranks_share_each_global_batch(rows, num_workers):
    """Rank r's k-th batch is the r-th part of the k-th batch one rank would get: the same prompts per
    step at any data-parallel size, no row twice, and the state alike on every rank."""
    reference = epochs(create_dataloader(rows, batch_size=BATCH, num_workers=num_workers), 2)
    for world_size in (2, 4):
        loaders = shares(world_size, dataset=rows, num_workers=num_workers)
        per_rank = [epochs(loader, 2) for loader in loaders]
        for epoch in range(2):
            steps = zip(*(share[epoch] for share in per_rank), strict=True)
            assert [list(itertools.chain(*parts)) for parts in steps] == reference[epoch]
        assert len({str(loader.state_dict()) for loader in loaders}) == 1


@pytest.mark.parametrize("saved_world,resumed_world", [(2, 1), (1, 4), (4, 2)])
def test_a_state_resumes_at_another_data_parallel_size(rows, tmp_path, saved_world, resumed_world):
    """A recover point written by ``saved_world`` ranks after 2 steps continues at step 3 of the same
    order with ``resumed_world`` ranks, and the epoch after it is the uninterrupted run's."""
    reference = epochs(create_dataloader(rows, batch_size=BATCH), 2)
    saved = shares(saved_world, dataset=rows)
    for loader in saved:
        list(itertools.islice(iter(loader), 2))
    torch.save(saved[-1].state_dict(), tmp_path / "loader.pt")
    resumed = shares(resumed_world, dataset=rows)
    for loader in resumed:
        loader.load_state_dict(torch.load(tmp_path / "loader.pt", weights_only=False))
    for epoch, want in ((0, reference[0][2:]), (1, reference[1])):
        steps = zip(*(ids(loader) for loader in resumed), strict=True)
        assert [list(itertools.chain(*parts)) for parts in steps] == want, epoch


def test_collate_is_picklable_and_bad_sizes_are_rejected(rows):
    assert pickle.loads(pickle.dumps(collate_rows))([{"a": 1}]) == [{"a": 1}]
    with pytest.raises(ValueError, match="batch_size=30 x world_size=1 exceeds the 22 rows"):
        create_dataloader(rows, batch_size=30)
    with pytest.raises(ValueError, match="batch_size=6 x world_size=4 exceeds the 22 rows"):
        create_dataloader(rows, batch_size=6, rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank=2 must satisfy 0 <= rank < world_size=2"):
        create_dataloader(rows, batch_size=2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size=2: ranks share whole global batches only"):
        create_dataloader(rows, batch_size=2, rank=0, world_size=2, drop_last=False)
    with pytest.raises(ValueError, match="batch_size=0"):
        create_dataloader(rows, batch_size=0)
