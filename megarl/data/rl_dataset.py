"""Load an RL prompt dataset, map its rows to chat messages + answer, and split it by DP rank.

``path`` may be the short name ``"gsm8k"`` (the copy bundled with megarl), a local
``.jsonl`` / ``.json`` / ``.parquet`` file, a local directory holding ``{split}.jsonl``
(or any layout ``datasets.load_dataset`` reads, e.g. a hub snapshot), or a hub dataset
name ``"owner/name[:config]"``. The hub is tried only for names that are not local paths,
and a hub that cannot be reached fails fast with :class:`HubUnreachableError`.
"""

from __future__ import annotations

import logging
import os
import types
from pathlib import Path

import datasets
from datasets.distributed import split_dataset_by_node

from megarl.config.experiment import DATASET_SHORT_NAMES
from megarl.data.rows import CONSUMED_COLUMNS, row_mapper

logger = logging.getLogger(__name__)

GSM8K_DIR = Path(__file__).resolve().parent / "gsm8k"
# Short names win over same-named relative paths; write "./gsm8k" to mean a local folder.
SHORT_NAMES = DATASET_SHORT_NAMES  # defined with the config checks, which must not import ``datasets``
FILE_BUILDERS = types.MappingProxyType({".jsonl": "json", ".json": "json", ".parquet": "parquet"})
HUB_PROBE_TIMEOUT_S = 5.0
_TMP_PREFIX = "__megarl_mapped_"
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
) -> datasets.Dataset:
    """Load ``split`` of dataset ``path`` as rows ``{"messages", "answer", ...}`` for DP ``rank``.

    Rows are mapped by the row mapping of ``type`` (see :mod:`megarl.data.rows`), then, if
    ``max_prompt_tokens`` is set, rows whose chat-templated prompt is longer are dropped
    (needs ``tokenizer``). The result is the ``rank``-th of ``world_size`` contiguous
    shards: shards are disjoint and their union is the whole (filtered) dataset.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must satisfy 0 <= rank < world_size={world_size}")
    if max_prompt_tokens is not None and tokenizer is None:
        raise ValueError(f"max_prompt_tokens={max_prompt_tokens} needs a tokenizer to count tokens")
    mapper = row_mapper(type)
    raw, source = _load_raw(path, split, type)
    dataset = _map_rows(raw, mapper, CONSUMED_COLUMNS[type], source)
    if max_prompt_tokens is not None:
        dataset = _filter_prompt_length(dataset, tokenizer, max_prompt_tokens)
    logger.info("%s [%s]: %d rows, rank %d of %d", source, split, len(dataset), rank, world_size)
    return split_dataset_by_node(dataset, rank=rank, world_size=world_size)


def _prefixed_row(row: dict, index: int, mapper, source: str) -> dict:
    return {_TMP_PREFIX + key: value for key, value in mapper(row, index, source).items()}


def _map_rows(raw: datasets.Dataset, mapper, consumed, source: str) -> datasets.Dataset:
    """Apply ``mapper`` to every row, dropping the ``consumed`` raw columns.

    Outputs are written to fresh columns, then renamed: ``map`` keeps the type of a column
    it overwrites, and a numeric raw ``answer`` must become a string.
    """
    mapped = raw.map(
        _prefixed_row,
        with_indices=True,
        fn_kwargs={"mapper": mapper, "source": source},
        keep_in_memory=True,  # prompt sets are small; no cache files shared between ranks
        desc=f"mapping {source}",
    )
    outputs = [c[len(_TMP_PREFIX):] for c in mapped.column_names if c.startswith(_TMP_PREFIX)]
    mapped = mapped.remove_columns([c for c in raw.column_names if c in outputs or c in consumed])
    return mapped.rename_columns({_TMP_PREFIX + c: c for c in outputs})


def _load_raw(path: str, split: str, type: str) -> tuple[datasets.Dataset, str]:
    """The raw rows of ``path`` and a description of where they came from (for errors)."""
    local = SHORT_NAMES.get(path) or Path(path).expanduser()
    if local.is_file():
        return _load_file(local), str(local)
    if local.is_dir():
        return _load_dir(local, split)
    if _looks_local(path):
        raise ValueError(f"dataset path {path!r} does not exist (no such file or directory)")
    return _load_hub(path, split, type), f"hub:{path}"


def _looks_local(path: str) -> bool:
    return path.startswith(("/", ".", "~")) or Path(path).suffix in FILE_BUILDERS


def _load_file(file: Path) -> datasets.Dataset:
    builder = FILE_BUILDERS.get(file.suffix)
    if builder is None:
        raise ValueError(
            f"dataset file {str(file)!r} has suffix {file.suffix!r}; "
            f"supported: {sorted(FILE_BUILDERS)}"
        )
    return datasets.load_dataset(builder, data_files=str(file), split="train")


def _load_dir(directory: Path, split: str) -> tuple[datasets.Dataset, str]:
    for suffix in FILE_BUILDERS:
        file = directory / f"{split}{suffix}"
        if file.is_file():
            return _load_file(file), str(file)
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
    dataset: datasets.Dataset, tokenizer, max_prompt_tokens: int
) -> datasets.Dataset:
    """Drop rows whose prompt, as the rollout sends it (chat template applied), is too long."""

    def short_enough(batch: dict) -> list[bool]:
        if getattr(tokenizer, "chat_template", None):
            texts = [
                tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                for m in batch["messages"]
            ]
        else:
            texts = ["\n".join(turn["content"] for turn in m) for m in batch["messages"]]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [len(x) <= max_prompt_tokens for x in ids]

    before = len(dataset)
    dataset = dataset.filter(short_enough, batched=True, keep_in_memory=True)
    logger.info("prompt length filter (<= %d tokens) kept %d of %d rows",
                max_prompt_tokens, len(dataset), before)
    return dataset
