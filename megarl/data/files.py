"""Dataset files on disk: which file a dataset name and split mean, and their rows.

The bundled datasets (:data:`DATASET_SHORT_NAMES`) and local ``.jsonl`` / ``.json`` / ``.parquet``
files or directories; :mod:`megarl.data.rl_dataset` loads them, and the pre-launch checks
(``megarl.run.prelaunch``) read their first rows and size before anything starts. Only the
standard library and pyarrow (parquet) are used here: no torch, no ``datasets``.
"""

from __future__ import annotations

import functools
import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DATASET_SUFFIXES = (".jsonl", ".json", ".parquet")
"""Dataset files megarl reads, in the order a directory's ``{split}{suffix}`` is looked for."""
_HERE = Path(__file__).resolve().parent
DATASET_SHORT_NAMES = types.MappingProxyType({"gsm8k": _HERE / "gsm8k", "arithmetic": _HERE / "arithmetic"})
"""Bundled datasets: short name -> directory of ``{split}.jsonl`` files."""
_ROWS_CHECKED = 3


def dataset_file(path: str, split: str, bundled: Path | None) -> Path | None:
    """The local file ``megarl.data`` reads for ``path`` and ``split``, when it is one file."""
    if bundled is not None:
        return bundled / f"{split}.jsonl"
    local = Path(path).expanduser()
    if local.is_file():
        return local
    if local.is_dir():
        return next((f for f in (local / f"{split}{s}" for s in DATASET_SUFFIXES) if f.is_file()), None)
    return None


def first_rows(file: Path, n: int = _ROWS_CHECKED) -> list[Any]:
    """The first ``n`` rows of a ``.jsonl``, ``.json`` or ``.parquet`` file; ValueError naming row and file."""
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        batch = next(pq.ParquetFile(file).iter_batches(batch_size=n), None)  # None: a schema but no rows
        return batch.to_pylist() if batch is not None else []
    if file.suffix == ".json":
        rows = _load_json(file)
        return rows[:n]
    rows = []
    for number, value, error in jsonl_lines(file):
        if len(rows) == n:
            break
        if error is not None:
            raise ValueError(f"{file} line {number} is not JSON: {error}")
        rows.append(value)
    return rows


def jsonl_lines(file: Path) -> Iterator[tuple[int, Any, str | None]]:
    """``(line number, value, None)`` for each non-blank line of a JSON-lines file, or
    ``(line number, None, why)`` for a line that is not UTF-8 JSON."""
    with open(file, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                value, error = json.loads(raw.decode("utf-8")), None
            except (UnicodeDecodeError, ValueError) as err:
                value, error = None, str(err)
            yield number, value, error


def jsonl_row_line(file: str, index: int) -> int | None:
    """The line of ``file`` holding its row ``index`` (0-based, counting its JSON objects as
    ``megarl.data`` reads them); None when ``file`` is no ``.jsonl`` file (a parquet has no lines)."""
    path = Path(file)
    if path.suffix != ".jsonl" or not path.is_file():
        return None
    stat = path.stat()
    lines = _object_lines(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    return lines[index] if 0 <= index < len(lines) else None


@functools.lru_cache(maxsize=4)
def _object_lines(file: str, mtime_ns: int, size: int) -> tuple[int, ...]:
    """The line numbers of the JSON objects of ``file`` (its modification time and size key the cache)."""
    return tuple(number for number, value, _ in jsonl_lines(Path(file)) if isinstance(value, dict))


def count_rows(file: Path) -> int:
    """Rows of a dataset file (non-empty lines of a ``.jsonl``)."""
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(file).metadata.num_rows
    if file.suffix == ".json":
        return len(_load_json(file))
    with open(file, "rb") as f:
        return sum(1 for line in f if line.strip())


def _load_json(file: Path) -> list:
    try:
        rows = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not JSON: {err}") from None
    if not isinstance(rows, list):
        raise ValueError(f"{file} holds a {type(rows).__name__}, expected a JSON list of rows")
    return rows
