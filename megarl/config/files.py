"""Config checks that look at files: a model's ``config.json``, a dataset's first rows and size,
directories a run writes.

They run when the config is loaded (before any process starts), so their errors name the key
and the file: a malformed ``config.json`` or a dataset of the wrong type fails in a second, not
after the servers came up. Only the standard library is used here (no torch, no datasets).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megarl.config.base import ConfigError

MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe")
"""``model_type`` values megarl builds (``megarl.models.families.FAMILIES``; a test checks they agree)."""
MODEL_INT_FIELDS = ("num_attention_heads", "num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")
"""Fields of ``config.json`` the Megatron build reads and HF gives no safe default for."""
DATASET_SUFFIXES = (".jsonl", ".json", ".parquet")
"""Dataset files megarl reads, in the order a directory's ``{split}{suffix}`` is looked for."""
_ROWS_CHECKED = 3


def read_model_config(path: str, key: str) -> dict | None:
    """The ``config.json`` of the model directory ``path`` (None when it has none), checked for the
    fields the build needs. A :class:`ConfigError` naming ``key`` and the file otherwise."""
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(key, f"{path!r}: cannot read {file}: {err}") from None
    if not isinstance(config, dict):
        raise ConfigError(key, f"{path!r}: {file} holds a {type(config).__name__}, expected a JSON object")
    problems = []
    if config.get("model_type") not in MODEL_TYPES:
        problems.append(f"model_type {config.get('model_type')!r} is not one of {list(MODEL_TYPES)}")
    for name in (*MODEL_INT_FIELDS, "num_key_value_heads"):
        value = config.get(name)
        if (value is not None or name != "num_key_value_heads") and not (type(value) is int and value >= 1):
            problems.append(f"{name}={value!r} (expected an integer >= 1)")
    if problems:
        raise ConfigError(key, f"{path!r}: {file} cannot build a model: {'; '.join(problems)}")
    return config


def writable_dir_problem(path: str) -> str | None:
    """Why a run cannot create and write files under the directory ``path``, or None.

    Tried for real (a temporary file in ``path`` or in its nearest existing parent), since
    permission bits say nothing for root or a read-only mount.
    """
    directory = Path(path).expanduser().absolute()
    existing = next((p for p in (directory, *directory.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        return f"{existing} is a file, not a directory" if existing else "no parent directory exists"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return f"cannot write in {existing}: {err.strerror or err}"
    return None


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

        batches = pq.ParquetFile(file).iter_batches(batch_size=n)
        return next(batches).to_pylist() if file.stat().st_size else []
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


def machine_memory_gib() -> float | None:
    """Physical memory of this machine in GiB (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None
