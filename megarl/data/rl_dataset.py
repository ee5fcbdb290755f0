"""Load an RL prompt dataset, map its rows to chat messages + answer, and split it by DP rank.

``path`` may be the short name ``"gsm8k"`` (the copy bundled with megarl), a local
``.jsonl`` / ``.json`` / ``.parquet`` file, a local directory holding ``{split}.jsonl``
(or any layout ``datasets.load_dataset`` reads, e.g. a hub snapshot), or a hub dataset
name ``"owner/name[:config]"``. The hub is tried only for names that are not local paths,
and a hub that cannot be reached fails fast with :class:`HubUnreachableError`.

``type`` is a built-in row format or a user's row adapter (:func:`megarl.data.rows.row_mapper`).
A row that its type cannot map (a missing or empty field, a wrong type, a GSM8K answer without
its ``#### <number>`` line, a chat role that is not one of ``CHAT_ROLES``, a row adapter that
raises or returns no chat row; in a ``.jsonl`` file also a line that is not JSON, not an object,
or not UTF-8) raises :class:`~megarl.data.rows.DatasetRowError` naming the file and row, or
with ``bad_rows="skip"`` is dropped: the count and the first one are logged and handed to the
caller (``skipped``), whose console shows them.
"""

from __future__ import annotations

import logging
import os
import types
from pathlib import Path

import datasets
from datasets.distributed import split_dataset_by_node

from megarl.data.files import DATASET_SHORT_NAMES, dataset_file, jsonl_lines
from megarl.data.rows import DatasetRowError, row_mapper

logger = logging.getLogger(__name__)

GSM8K_DIR = Path(__file__).resolve().parent / "gsm8k"
# Short names win over same-named relative paths; write "./gsm8k" to mean a local folder.
SHORT_NAMES = DATASET_SHORT_NAMES  # defined in megarl.data.files, which the pre-launch checks read without ``datasets``
FILE_BUILDERS = types.MappingProxyType({".jsonl": "json", ".json": "json", ".parquet": "parquet"})
HUB_PROBE_TIMEOUT_S = 5.0
BAD_ROW_POLICIES = ("raise", "skip")
_TRUE = frozenset({"1", "on", "yes", "true"})


class HubUnreachableError(ConnectionError):
    """A dataset named on the Hugging Face hub was asked for, and the hub cannot be reached."""


def load_rl_dataset(
    path: str,
    split: str,
    *,
    rank: int = 0,
    world_size: int = 1,
    type: str = "gsm8k",
    max_prompt_tokens: int | None = None,
    tokenizer=None,
    bad_rows: str = "raise",
    skipped: list[str] | None = None,
) -> datasets.Dataset:
    """Load ``split`` of dataset ``path`` as rows ``{"messages", "answer", ...}`` for DP ``rank``.

    Rows are mapped by the row mapping of ``type`` (see :mod:`megarl.data.rows`), then, if
    ``max_prompt_tokens`` is set, rows whose chat-templated prompt is longer are dropped
    (needs ``tokenizer``). The result is the ``rank``-th of ``world_size`` contiguous
    shards: shards are disjoint and their union is the whole (filtered) dataset. ``bad_rows``:
    ``raise`` (the default) or ``skip`` rows that cannot be read or mapped; ``skipped``, when
    given, receives why each skipped row was (over the whole file, before sharding).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must satisfy 0 <= rank < world_size={world_size}")
    if max_prompt_tokens is not None and tokenizer is None:
        raise ValueError(f"max_prompt_tokens={max_prompt_tokens} needs a tokenizer to count tokens")
    if bad_rows not in BAD_ROW_POLICIES:
        raise ValueError(f"bad_rows={bad_rows!r} must be one of {BAD_ROW_POLICIES}")
    mapper = row_mapper(type)
    rows, source, bad = _load_rows(path, split, type, bad_rows)
    dataset = _map_rows(rows, mapper, source, bad_rows, bad)  # adds the rows it skips to bad
    if skipped is not None:
        skipped.extend(bad)
    if max_prompt_tokens is not None:
        dataset = _filter_prompt_length(dataset, tokenizer, max_prompt_tokens, source)
    logger.info("%s [%s]: %d rows, rank %d of %d", source, split, len(dataset), rank, world_size)
    return split_dataset_by_node(dataset, rank=rank, world_size=world_size)


def _map_rows(rows: list, mapper, source: str, bad_rows: str, skipped: list[str]) -> datasets.Dataset:
    """Apply ``mapper`` to every row; rows it rejects are raised or, under ``skip``, added to ``skipped``."""
    mapped, total = [], len(rows) + len(skipped)
    for index, row in enumerate(rows):
        try:
            out = mapper(row, index, source)
        except DatasetRowError as err:
            if bad_rows == "raise":
                raise
            skipped.append(str(err))
            continue
        mapped.append(out)
    if skipped:
        logger.warning(
            "%s: skipped %d bad rows of %d (bad_rows=skip); the first: %s", source, len(skipped), total, skipped[0]
        )
    if not mapped:
        raise ValueError(
            f"{source}: no usable rows" + (f" ({len(skipped)} bad; the first: {skipped[0]})" if skipped else "")
        )
    try:
        return datasets.Dataset.from_list(mapped)
    except (TypeError, ValueError) as err:  # pyarrow: a column whose rows hold different types
        why = _mixed_column(mapped) or "a column of mixed types?"
        raise ValueError(f"{source}: its rows cannot form one table ({why}): {err}") from None


def _mixed_column(rows: list[dict]) -> str | None:
    """The first field whose rows hold values of two types (nulls aside), with a row of each, or None."""
    first: dict[str, tuple[str, int]] = {}  # field -> (type, row) of its first value
    for index, row in enumerate(rows):
        for key, value in row.items():
            if value is None:
                continue
            kind = "number" if type(value) in (int, float) else type(value).__name__  # ints and floats mix
            seen = first.setdefault(key, (kind, index))
            if seen[0] != kind:
                return f"field {key!r} is {seen[0]} in row {seen[1]} and {kind} in row {index}"
    return None


def _load_rows(path: str, split: str, type: str, bad_rows: str) -> tuple[list, str, list[str]]:
    """The raw rows of ``path``, where they came from (for errors), and the lines skipped as unreadable."""
    local = SHORT_NAMES.get(path) or Path(path).expanduser()
    file = dataset_file(str(local), split, None)  # the file itself, or a directory's {split}.jsonl/.json/.parquet
    if file is not None and file.suffix == ".jsonl":
        rows, skipped = _read_jsonl(file, bad_rows)
        return rows, str(file), skipped
    if file is not None:
        return _load_file(file).to_list(), str(file), []
    if local.is_dir():
        raw, source = _load_dir(local, split)
        return raw.to_list(), source, []
    if _looks_local(path):
        raise ValueError(f"dataset path {path!r} does not exist (no such file or directory)")
    return _load_hub(path, split, type).to_list(), f"hub:{path}", []


def _read_jsonl(file: Path, bad_rows: str) -> tuple[list[dict], list[str]]:
    """The objects of a JSON-lines file and the reasons of lines skipped (``bad_rows="skip"``)."""
    rows, skipped = [], []
    for number, value, error in jsonl_lines(file):
        if error is None and not isinstance(value, dict):
            error = f"a JSON {type(value).__name__}, not an object"
        if error is None:
            rows.append(value)
            continue
        problem = DatasetRowError(f"{file}: line {number} is not a JSON object: {error}")
        if bad_rows == "raise":
            raise problem
        skipped.append(str(problem))
    return rows, skipped


def _looks_local(path: str) -> bool:
    return path.startswith(("/", ".", "~")) or Path(path).suffix in FILE_BUILDERS


def _load_file(file: Path) -> datasets.Dataset:
    builder = FILE_BUILDERS.get(file.suffix)
    if builder is None:
        raise ValueError(f"dataset file {str(file)!r} has suffix {file.suffix!r}; supported: {sorted(FILE_BUILDERS)}")
    return datasets.load_dataset(builder, data_files=str(file), split="train")


def _load_dir(directory: Path, split: str) -> tuple[datasets.Dataset, str]:
    """A directory without a ``{split}`` file: a layout ``datasets.load_dataset`` reads (a hub snapshot)."""
    try:
        return datasets.load_dataset(str(directory), split=split), f"{directory} [{split}]"
    except (ValueError, FileNotFoundError) as exc:
        raise ValueError(
            f"dataset directory {str(directory)!r} has no {split}.jsonl/.json/.parquet and "
            f"datasets.load_dataset could not read split {split!r} from it: {exc}"
        ) from exc


def _load_hub(name: str, split: str, type: str) -> datasets.Dataset:
    """``owner/name[:config]`` from the hub; GSM8K's hub copy needs config ``main``."""
    repo, _, config = name.partition(":")
    if not config and type == "gsm8k":
        config = "main"
    _check_hub_reachable(name)
    try:
        return datasets.load_dataset(repo, config or None, split=split)
    except ConnectionError as exc:
        raise _unreachable(name, str(exc)) from exc


def _check_hub_reachable(name: str) -> None:
    """Fail in seconds rather than after ``load_dataset``'s minute of retries."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            raise _unreachable(name, f"{var} is set")
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT_S)
    except Exception as exc:  # any transport failure means the same thing here
        raise _unreachable(name, f"{constants.ENDPOINT}: {exc}") from exc


def _unreachable(name: str, why: str) -> HubUnreachableError:
    return HubUnreachableError(
        f"dataset {name!r} is not a local path, and the Hugging Face hub cannot be reached "
        f"from here ({why}). Use the bundled copy with path 'gsm8k', or a local "
        f".jsonl/.json/.parquet file or directory."
    )


def _filter_prompt_length(
    dataset: datasets.Dataset, tokenizer, max_prompt_tokens: int, source: str = "the dataset"
) -> datasets.Dataset:
    """Drop rows whose prompt, as the rollout sends it (chat template applied), is too long; a ValueError
    naming the limit and the shortest prompt when none is left."""
    dropped: list[int] = []  # the lengths of the prompts dropped

    def short_enough(batch: dict) -> list[bool]:
        if getattr(tokenizer, "chat_template", None):
            texts = [
                tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in batch["messages"]
            ]
        else:
            texts = ["\n".join(turn["content"] for turn in m) for m in batch["messages"]]
        lengths = [len(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        dropped.extend(n for n in lengths if n > max_prompt_tokens)
        return [n <= max_prompt_tokens for n in lengths]

    before = len(dataset)
    dataset = dataset.filter(short_enough, batched=True, keep_in_memory=True)
    if len(dataset) == 0:
        raise ValueError(
            f"{source}: max_prompt_tokens={max_prompt_tokens} drops all {before} rows (the shortest prompt has "
            f"{min(dropped)} tokens, chat template applied): raise max_prompt_tokens (and the servers' "
            f"max_model_len with it) or shorten the prompts"
        )
    log = logger.warning if dropped else logger.info
    log("%s: prompt length filter (<= %d tokens) kept %d of %d rows", source, max_prompt_tokens, len(dataset), before)
    return dataset
