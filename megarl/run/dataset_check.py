"""Pre-launch checks of a dataset (``train_dataset``, ``valid_dataset``): what ``megarl.data`` would load.

Part of :mod:`megarl.run.prelaunch`: the name resolves (a bundled dataset and its splits, a local file or
directory and the split in it, a hub name that can be downloaded), and the first rows fit the row ``type``,
with at least one batch of them under ``drop_last``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from megarl.config.base import ConfigError, require
from megarl.config.run import DatasetConfig
from megarl.data.files import DATASET_SHORT_NAMES, DATASET_SUFFIXES, count_rows, dataset_file, first_rows
from megarl.data.rows import ROW_MAPPERS, DatasetRowError, row_mapper

_HUB_DATASET_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""``owner/name``: a hub repository id (a dataset's, before an optional ``:config``)."""
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_TRUE = frozenset({"1", "on", "yes", "true"})


def check_dataset(key: str, data: DatasetConfig, multi_node: bool) -> dict | None:
    """Raise unless ``megarl.data.load_rl_dataset`` can load ``data.path`` and ``data.split``; the first
    row as the run will see it, when rows can be read here (else None).

    Mirrors its lookup: a bundled short name (whose splits are known here), an existing
    local file or directory, else a hub name ``owner/name[:config]``, which fails when an
    offline variable is set (the loader refuses the hub then). As for models, an absolute
    path that does not exist here is accepted on a multi-node cluster. A row adapter
    (``type``) is imported and its signature checked, whether or not rows can be read here.
    """
    row_mapper(data.type, f"{key}.type")
    bundled = DATASET_SHORT_NAMES.get(data.path)
    if bundled is not None:
        splits = sorted(f.stem for f in bundled.glob("*") if f.suffix in DATASET_SUFFIXES)
        require(data.split in splits, f"{key}.split", data.split, f"the bundled {data.path!r} has splits {splits}")
        return _check_rows(key, data, dataset_file(data.path, data.split, bundled))
    local = Path(data.path).expanduser()
    if local.is_file():
        suffixes = ", ".join(DATASET_SUFFIXES)
        require(local.suffix in DATASET_SUFFIXES, f"{key}.path", data.path, f"a dataset file must end in {suffixes}")
        return _check_rows(key, data, local)
    if local.is_dir() or (local.is_absolute() and multi_node):
        file = dataset_file(data.path, data.split, None)
        if file is not None:
            return _check_rows(key, data, file)
        if local.is_dir():  # read as datasets.load_dataset reads it (a hub snapshot); else on the nodes
            splits = directory_splits(local)
            require(bool(splits), f"{key}.path", data.path, "the directory holds no data files")
            require(
                data.split in splits,
                f"{key}.split",
                data.split,
                f"{data.path} has no {data.split}.jsonl/.json/.parquet, and the splits datasets.load_dataset "
                f"finds in it are {splits}",
            )
        return None
    looks_local = data.path.startswith(("/", ".", "~")) or local.suffix in DATASET_SUFFIXES
    require(not looks_local, f"{key}.path", data.path, "no such file or directory")
    require(
        _HUB_DATASET_ID.fullmatch(data.path.partition(":")[0]) is not None,
        f"{key}.path",
        data.path,
        f"neither a bundled dataset {sorted(DATASET_SHORT_NAMES)}, a local file or directory, "
        "nor a hub name 'owner/name[:config]'",
    )
    offline = next((var for var in _OFFLINE_VARS if os.environ.get(var, "").strip().lower() in _TRUE), None)
    require(
        offline is None,
        f"{key}.path",
        data.path,
        f"a hub dataset, but {offline} is set so it cannot be downloaded; "
        f"use a bundled dataset {sorted(DATASET_SHORT_NAMES)} or a local .jsonl/.json/.parquet file or directory",
    )


def _check_rows(key: str, data: DatasetConfig, file: Path) -> dict | None:
    """The first rows of ``file`` fit ``data.type``, and a ``drop_last`` loader gets at least one batch;
    the first row that maps, as the run sees it."""
    try:
        rows = first_rows(file)
        n_rows = count_rows(file) if data.drop_last else None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        if data.bad_rows == "skip" and not isinstance(err, OSError):
            return None  # unreadable lines are skipped at load
        raise ConfigError(f"{key}.path", f"{data.path!r}: cannot read {file}: {err}") from None
    require(bool(rows), f"{key}.path", data.path, f"{file} holds no rows")
    mapper, failures, mapped = row_mapper(data.type, f"{key}.type"), [], []
    for index, row in enumerate(rows):
        require(
            isinstance(row, dict),
            f"{key}.path",
            data.path,
            f"{file} row {index} is a {type(row).__name__}, expected a mapping of fields",
        )
        try:
            mapped.append(mapper(row, index, str(file)))
        except DatasetRowError as err:
            failures.append((row, err))
    # under bad_rows=skip a bad row is dropped at load: the check fails only when none of the first rows maps
    if failures and (data.bad_rows == "raise" or len(failures) == len(rows)):
        row, err = failures[0]
        fits = [name for name, mapper in ROW_MAPPERS.items() if name != data.type and _maps(mapper, row)]
        hint = f"; its rows fit type {fits[0]!r}" if fits else ""
        raise ConfigError(f"{key}.type", f"{data.type!r} is invalid for these rows: {err}{hint}")
    if n_rows is not None:
        require(
            n_rows >= data.batch_size,
            f"{key}.batch_size",
            data.batch_size,
            f"{file} has {n_rows} rows, fewer than one batch (drop_last would leave no step)",
        )
    return mapped[0] if mapped else None


def _maps(mapper, row: dict) -> bool:
    try:
        mapper(row, 0, "")
    except DatasetRowError:
        return False
    return True


def directory_splits(directory: Path) -> list[str]:
    """The splits ``datasets.load_dataset(directory)`` finds by its file names (``train-00000-of-00002.parquet``,
    ``data/test.jsonl``, ...; every file is ``train`` when no name says otherwise)."""
    from datasets.data_files import EmptyDatasetError, get_data_patterns

    try:
        return sorted(str(split) for split in get_data_patterns(str(directory)))
    except EmptyDatasetError:
        return []
