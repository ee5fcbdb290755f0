"""Row mappings: turn a raw dataset row into ``{"messages", "answer", ...}``.

Every dataset type maps its rows to the one shape the rollout workflows read:
``messages`` (a chat, the prompt to complete) and ``answer`` (the reference final answer
a reward function compares against, as a string). Other columns pass through so that a
reward function receiving ``**data`` can use them.

A type is a built-in (:data:`ROW_MAPPERS`) or a *row adapter*: a user's function
``fn(row: dict) -> dict`` named like any plug-in (``my_rows.py:to_row``), whose output is
read as a ``chat`` row. Every row that comes out is checked (:func:`row_mapper`); a row that
fails raises :class:`DatasetRowError` naming the file and the row.
"""

from __future__ import annotations

import logging
import math
import re
import types
from collections.abc import Callable, Mapping
from typing import Any

from megarl.data.files import jsonl_row_line
from megarl.utils.errors import ConfigError
from megarl.utils.plugins import FORMS, import_plugin, is_plugin_path, signature_problem

logger = logging.getLogger(__name__)

RowMapper = Callable[[dict, int, str], dict]
"""``mapper(raw_row, index, source) -> row``; raises :class:`DatasetRowError` for a bad row."""

# AReaL's GSM8K prompt suffix, so that reward functions written for AReaL keep working.
GSM8K_INSTRUCTION = "\nPlease put your final answer within \\boxed{}."
CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles a chat message may have (those chat templates know)."""
REWARD_ARGUMENTS = ("prompt", "completions", "prompt_ids", "completion_ids")
"""What a reward function receives positionally: a row column of the same name would collide with it."""
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")


class DatasetRowError(ValueError):
    """A dataset row lacks a field its dataset type needs (or holds a bad value)."""


def _where(source: str, index: int) -> str:
    """``source: row N``, and the file's line where it has lines (``row 14 (line 15)``: rows count from 0)."""
    line = jsonl_row_line(source, index)
    return f"{source}: row {index}" + (f" (line {line})" if line is not None else "")


def _require(row: Mapping[str, Any], key: str, index: int, source: str, expected: str) -> Any:
    value = row.get(key)
    if value is None and key in row:
        raise DatasetRowError(f"{_where(source, index)}: {key!r} is null; expected {expected}")
    if value is None:
        raise DatasetRowError(f"{_where(source, index)} has no {key!r} field (keys present: {sorted(row)})")
    return value


def _require_text(row: Mapping[str, Any], key: str, index: int, source: str) -> str:
    value = _require(row, key, index, source, "non-empty text")
    if not isinstance(value, str) or not value.strip():
        raise DatasetRowError(f"{_where(source, index)}: {key!r} must be non-empty text, got {value!r:.80}")
    return value


def _answer_text(row: Mapping[str, Any], index: int, source: str) -> str:
    answer = _require(row, "answer", index, source, "a non-empty string or number")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise DatasetRowError(
            f"{_where(source, index)}: 'answer' must be a non-empty string or number, got {answer!r:.80}"
        )
    if isinstance(answer, float) and not math.isfinite(answer):
        raise DatasetRowError(f"{_where(source, index)}: 'answer' must be a finite number, got {answer!r}")
    return str(answer)


def gsm8k_final_answer(solution: str) -> str:
    """The final answer of a GSM8K solution: the number after its last ``####``, commas removed.

    GSM8K writes large numbers as ``1,080``; the reference answer is kept comma-free so
    that plain string or numeric comparison works. ValueError when there is no ``####`` or
    what follows it is blank or not a number (an integer, a decimal or a fraction).
    """
    if "####" not in solution:
        raise ValueError(f"GSM8K solution has no '#### <answer>' line: {solution[-80:]!r}")
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not answer:
        raise ValueError(f"GSM8K solution's final answer after '####' is blank: {solution[-80:]!r}")
    if not _NUMBER.fullmatch(answer):
        raise ValueError(f"GSM8K solution's final answer after '####' is not a number: {answer!r:.80}")
    return answer


def map_gsm8k_row(row: dict, index: int, source: str) -> dict:
    """GSM8K ``{question, answer}`` → user message (question + instruction), answer, solution."""
    question = _require_text(row, "question", index, source)
    solution = _require_text(row, "answer", index, source)
    try:
        answer = gsm8k_final_answer(solution)
    except ValueError as exc:
        raise DatasetRowError(f"{_where(source, index)}: {exc}") from exc
    rest = {k: v for k, v in row.items() if k != "question"}
    return {
        **rest,
        "messages": [{"role": "user", "content": question + GSM8K_INSTRUCTION}],
        "answer": answer,
        "solution": solution,
    }


def map_chat_row(row: dict, index: int, source: str) -> dict:
    """Rows already holding ``messages`` (a chat) or ``prompt`` (a string), plus ``answer``."""
    answer = _answer_text(row, index, source)
    messages = row.get("messages")
    if messages is None:
        if row.get("prompt") is None:
            raise DatasetRowError(
                f"{_where(source, index)} has neither 'messages' nor 'prompt' (keys present: {sorted(row)})"
            )
        messages = [{"role": "user", "content": _require_text(row, "prompt", index, source)}]
    if not isinstance(messages, list) or not messages or not all(_is_turn(m) for m in messages):
        raise DatasetRowError(
            f"{_where(source, index)}: 'messages' must be a non-empty list of "
            f"{{'role', 'content'}} dicts with text, got {messages!r:.200}"
        )
    unknown = next(((i, m["role"]) for i, m in enumerate(messages) if m["role"] not in CHAT_ROLES), None)
    if unknown is not None:
        raise DatasetRowError(
            f"{_where(source, index)}: message {unknown[0]} has role {unknown[1]!r}; a role is one of {list(CHAT_ROLES)}"
        )
    if not any(m["content"].strip() for m in messages):
        raise DatasetRowError(f"{_where(source, index)}: every message of 'messages' is empty")
    rest = {k: v for k, v in row.items() if k != "prompt"}  # the chat now; a 'prompt' column would reach the reward
    return {**rest, "messages": messages, "answer": answer}


def _is_turn(message: Any) -> bool:
    return (
        isinstance(message, Mapping)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
    )


# Read-only: a new built-in type is one function plus one entry here (and in DatasetConfig's docstring).
ROW_MAPPERS: Mapping[str, RowMapper] = types.MappingProxyType({"gsm8k": map_gsm8k_row, "chat": map_chat_row})


def row_mapper(type: str, key: str = "type") -> RowMapper:
    """The row mapping of dataset ``type``: a built-in, or a row adapter's (see :func:`adapter_mapper`).

    Every row it maps is checked for columns a reward function receives itself
    (:data:`REWARD_ARGUMENTS`). ``key`` names the config key in errors: a :class:`ConfigError`
    for a type that is neither.
    """
    mapper = ROW_MAPPERS.get(type)
    if mapper is None:
        if not is_plugin_path(type):
            raise ConfigError(
                key, f"unknown dataset type {type!r}: one of {sorted(ROW_MAPPERS)} or a row adapter ({FORMS})"
            )
        mapper = adapter_mapper(type, key)

    def map_row(row: dict, index: int, source: str) -> dict:
        out = mapper(row, index, source)
        clash = sorted(set(out) & set(REWARD_ARGUMENTS))
        if clash:
            raise DatasetRowError(
                f"{_where(source, index)} has column(s) {clash}, which a reward function receives as its own "
                f"arguments {list(REWARD_ARGUMENTS)}: rename them"
            )
        return out

    return map_row


def adapter_mapper(path: str, key: str = "type") -> RowMapper:
    """The row mapping of a user's row adapter ``fn(row: dict) -> dict`` named by ``path``.

    What ``fn`` returns is read as a ``chat`` row (``messages`` or ``prompt``, and ``answer``;
    its other keys pass through to the reward). An exception ``fn`` raises on a row, or an output
    that is not such a row, is a :class:`DatasetRowError` naming file, row and adapter.
    """
    fn = import_plugin(path, key)
    problem = signature_problem(fn, ({},))
    if problem is not None:
        raise ConfigError(key, f"{path!r}: a row adapter is fn(row: dict) -> dict: {problem}")

    def map_adapted_row(row: dict, index: int, source: str) -> dict:
        try:
            out = fn(dict(row))
        except Exception as exc:  # noqa: BLE001 -- the user's code, on this row: name both
            raise DatasetRowError(
                f"{_where(source, index)}: row adapter {path} raised {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(out, Mapping):
            raise DatasetRowError(
                f"{_where(source, index)}: row adapter {path} returned {type(out).__name__} {out!r:.80}, "
                "expected a dict with 'messages' (or 'prompt') and 'answer'"
            )
        try:
            return map_chat_row(dict(out), index, source)
        except DatasetRowError as err:
            raise DatasetRowError(f"{err} (in what row adapter {path} returned)") from None

    return map_adapted_row
