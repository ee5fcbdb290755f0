"""Row mappings: turn a raw dataset row into ``{"messages", "answer", ...}``.

Every dataset type maps its rows to the one shape the rollout workflows read:
``messages`` (a chat, the prompt to complete) and ``answer`` (the reference final answer
a reward function compares against, as a string). Other columns pass through so that a
reward function receiving ``**data`` can use them.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

# AReaL's GSM8K prompt suffix, so that reward functions written for AReaL keep working.
GSM8K_INSTRUCTION = "\nPlease put your final answer within \\boxed{}."


class DatasetRowError(ValueError):
    """A dataset row lacks a field its dataset type needs (or holds a bad value)."""


def _require(row: Mapping[str, Any], key: str, index: int, source: str) -> Any:
    value = row.get(key)
    if value is None:
        raise DatasetRowError(f"{source}: row {index} has no {key!r} field (keys present: {sorted(row)})")
    return value


def _require_text(row: Mapping[str, Any], key: str, index: int, source: str) -> str:
    value = _require(row, key, index, source)
    if not isinstance(value, str) or not value.strip():
        raise DatasetRowError(f"{source}: row {index}: {key!r} must be non-empty text, got {value!r:.80}")
    return value


def _answer_text(row: Mapping[str, Any], index: int, source: str) -> str:
    answer = _require(row, "answer", index, source)
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise DatasetRowError(
            f"{source}: row {index}: 'answer' must be a non-empty string or number, got {answer!r:.80}"
        )
    return str(answer)


def gsm8k_final_answer(solution: str) -> str:
    """The final answer of a GSM8K solution: the text after its last ``####``, commas removed.

    GSM8K writes large numbers as ``1,080``; the reference answer is kept comma-free so
    that plain string or numeric comparison works.
    """
    if "####" not in solution:
        raise ValueError(f"GSM8K solution has no '#### <answer>' line: {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def map_gsm8k_row(row: dict, index: int, source: str) -> dict:
    """GSM8K ``{question, answer}`` → user message (question + instruction), answer, solution."""
    question = _require_text(row, "question", index, source)
    solution = _require_text(row, "answer", index, source)
    try:
        answer = gsm8k_final_answer(solution)
    except ValueError as exc:
        raise DatasetRowError(f"{source}: row {index}: {exc}") from exc
    return {
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
                f"{source}: row {index} has neither 'messages' nor 'prompt' (keys present: {sorted(row)})"
            )
        messages = [{"role": "user", "content": _require_text(row, "prompt", index, source)}]
    if not isinstance(messages, list) or not messages or not all(_is_turn(m) for m in messages):
        raise DatasetRowError(
            f"{source}: row {index}: 'messages' must be a non-empty list of "
            f"{{'role', 'content'}} dicts with text, got {messages!r:.200}"
        )
    if not any(m["content"].strip() for m in messages):
        raise DatasetRowError(f"{source}: row {index}: every message of 'messages' is empty")
    return {"messages": messages, "answer": answer}


def _is_turn(message: Any) -> bool:
    return (
        isinstance(message, Mapping)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
    )


# Read-only: a new type is one function plus one entry here.
ROW_MAPPERS: Mapping[str, Callable[[dict, int, str], dict]] = types.MappingProxyType(
    {"gsm8k": map_gsm8k_row, "chat": map_chat_row}
)
# Raw columns a mapping consumes, dropped after it ran.
CONSUMED_COLUMNS: Mapping[str, tuple[str, ...]] = types.MappingProxyType({"gsm8k": ("question",), "chat": ()})


def row_mapper(type: str) -> Callable[[dict, int, str], dict]:
    """The row mapping registered for dataset ``type``; ValueError naming the known types."""
    try:
        return ROW_MAPPERS[type]
    except KeyError:
        raise ValueError(f"unknown dataset type {type!r}; known types: {sorted(ROW_MAPPERS)}") from None
