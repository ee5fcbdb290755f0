"""TRL reward functions as megarl rewards, called the way TRL's ``GRPOTrainer`` calls them.

A TRL reward scores a batch by keyword and returns a list of floats (``None``: "no score for this
sample"); megarl's reward scores one sample: ``fn(prompt, completions, prompt_ids, completion_ids,
**row)``. :func:`from_trl` makes one from the other, in a module of yours::

    from trl.rewards import accuracy_reward
    from megarl.reward.trl import from_trl

    accuracy = from_trl(accuracy_reward)  # reward_fn: my_rewards.accuracy

Each sample is a batch of one, passed as TRL 1.16 passes it (``docs/name-mapping.md`` tells the whole
contract): ``prompts``, ``completions``, ``completion_ids``, every row column as a list (the row's
``answer`` also as ``solution``), ``trainer_state``, ``log_extra`` and ``log_metric``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from megarl.reward.call import current_trainer_state, log_extra, log_metric

TRL_REFERENCE_COLUMNS = {"answer": "solution"}
"""megarl's row name -> TRL's, passed under both names."""

TRL_OWN_KEYS = ("prompt", "completion", "completion_ids")
"""Row columns TRL does not pass as columns (it passes the batch's own under its names)."""
CONVERSATIONAL_KEYS = ("prompt", "chosen", "rejected", "completion", "messages")
"""The columns TRL's ``is_conversational`` looks at for message lists."""
PROMPT_KEYS = ("prompt", "messages")
"""Where a conversational prompt is read from, first found first."""


def is_message_list(value: Any) -> bool:
    """A list of chat messages, as TRL recognises one: its first item a dict with a ``role``."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def is_conversational(row: Mapping[str, Any]) -> bool:
    """TRL's ``is_conversational`` on a row: one of :data:`CONVERSATIONAL_KEYS` holds a message list."""
    return any(is_message_list(row[key]) for key in CONVERSATIONAL_KEYS if key in row)


class TRLReward:
    """A TRL reward function called for one sample, as TRL would call it for a batch of one.

    Picklable when ``fn`` is (a module-level function): rewards run in worker processes.
    """

    def __init__(self, fn: Callable[..., list], conversational: bool | None, columns: Mapping[str, str]):
        self.fn, self.conversational, self.columns = fn, conversational, dict(columns)
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__qualname__ = f"from_trl({self.__name__})"  # how errors and logs name the reward

    def __call__(self, prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], **row) -> float:
        return self._score(self.fn(**self._arguments(prompt, completions, completion_ids, row)))

    def _arguments(self, prompt: str, completion: str, completion_ids: list[int], row: Mapping[str, Any]) -> dict:
        """The keyword arguments TRL passes a reward for a batch of this one sample."""
        prompts, samples = self._prompt_and_completion(prompt, completion, row)
        run = {"trainer_state": current_trainer_state(), "log_extra": log_extra, "log_metric": log_metric}
        batch = {"prompts": prompts, "completions": samples, "completion_ids": [list(completion_ids)]}
        return {**batch, **self._columns(row), **run}

    def _score(self, scores: Any) -> float:
        if not isinstance(scores, (list, tuple)) or len(scores) != 1:
            raise TypeError(f"TRL reward {self.__name__} returned {scores!r:.80}; expected a list of one score")
        return 0.0 if scores[0] is None else float(scores[0])

    def _prompt_and_completion(self, prompt: str, completion: str, row: Mapping[str, Any]) -> tuple[list, list]:
        """Batches of one: plain text, or message lists when the row (or ``conversational``) says so."""
        conversational = is_conversational(row) if self.conversational is None else self.conversational
        if not conversational:
            return [prompt], [completion]
        messages = next((row[key] for key in PROMPT_KEYS if is_message_list(row.get(key))), None)
        return [messages or [{"role": "user", "content": prompt}]], [[{"role": "assistant", "content": completion}]]

    def _columns(self, row: Mapping[str, Any]) -> dict[str, list]:
        """Each row column as a list of one, under megarl's name and TRL's (:data:`TRL_REFERENCE_COLUMNS`)."""
        columns = {key: [value] for key, value in row.items() if key not in TRL_OWN_KEYS}
        for ours, theirs in self.columns.items():
            if ours in row and theirs not in row:
                columns[theirs] = [row[ours]]
        return columns


class AsyncTRLReward(TRLReward):
    """An ``async def`` TRL reward (an LLM judge, say; TRL awaits those side by side) called for one
    sample: awaited on the rollout's event loop, as megarl awaits its own ``async def`` rewards."""

    async def __call__(  # type: ignore[override]
        self, prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], **row
    ) -> float:
        return self._score(await self.fn(**self._arguments(prompt, completions, completion_ids, row)))


def from_trl(
    fn: Callable[..., list], conversational: bool | None = None, columns: Mapping[str, str] | None = None
) -> TRLReward:
    """A megarl reward calling TRL reward ``fn`` (see the module doc), an :class:`AsyncTRLReward` when
    ``fn`` is an ``async def``. ``conversational``: prompts and completions as message lists or as text;
    None (the default) decides per row as TRL does (a ``messages`` or ``prompt`` column holding a message
    list: conversational). ``columns``: row names passed under TRL's names too (default
    ``{"answer": "solution"}``)."""
    kind = AsyncTRLReward if inspect.iscoroutinefunction(fn) else TRLReward
    return kind(fn, conversational, TRL_REFERENCE_COLUMNS if columns is None else columns)
