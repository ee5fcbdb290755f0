"""TRL reward functions as megarl rewards, called the way TRL's ``GRPOTrainer`` calls them.

A TRL reward scores a batch by keyword: ``fn(prompts=[...], completions=[...], completion_ids=[...],
**columns)`` where each dataset column comes as a list, and returns a list of floats (``None``: "no
score for this sample"). In a conversational run, prompts are message lists and each completion is
a one-message list ``[{"role": "assistant", "content": text}]``. megarl's reward scores one sample:
``fn(prompt, completions, prompt_ids, completion_ids, **row)``. :func:`from_trl` makes one from the
other, in a module of yours::

    from trl.rewards import accuracy_reward
    from megarl.reward.trl import from_trl

    accuracy = from_trl(accuracy_reward, conversational=True)  # reward_fn: my_rewards.accuracy

The row's ``answer`` is also passed as ``solution``, the name TRL's rewards read the reference by
(``columns`` changes or extends that renaming). A ``None`` score counts as 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

TRL_REFERENCE_COLUMNS = {"answer": "solution"}
"""megarl's row name -> TRL's, passed under both names."""


class TRLReward:
    """A TRL reward function called for one sample, as TRL would call it for a batch of one.

    Picklable when ``fn`` is (a module-level function): rewards run in worker processes.
    """

    def __init__(self, fn: Callable[..., list], conversational: bool, columns: Mapping[str, str]):
        self.fn, self.conversational, self.columns = fn, conversational, dict(columns)
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], **row) -> float:
        columns = {key: [value] for key, value in row.items()}
        for ours, theirs in self.columns.items():
            if ours in row and theirs not in row:
                columns[theirs] = [row[ours]]
        if self.conversational:
            prompts: list[Any] = [row.get("messages") or [{"role": "user", "content": prompt}]]
            samples: list[Any] = [[{"role": "assistant", "content": completions}]]
        else:
            prompts, samples = [prompt], [completions]
        scores = self.fn(prompts=prompts, completions=samples, completion_ids=[list(completion_ids)], **columns)
        if not isinstance(scores, (list, tuple)) or len(scores) != 1:
            raise TypeError(f"TRL reward {self.__name__} returned {scores!r:.80}; expected a list of one score")
        return 0.0 if scores[0] is None else float(scores[0])


def from_trl(
    fn: Callable[..., list], conversational: bool = False, columns: Mapping[str, str] | None = None
) -> TRLReward:
    """A megarl reward calling TRL reward ``fn`` (see the module doc). ``conversational``: completions
    and prompts as message lists (TRL's conversational datasets; ``trl.rewards``' functions need it);
    ``columns``: row names passed under TRL's names too (default ``{"answer": "solution"}``)."""
    return TRLReward(fn, conversational, TRL_REFERENCE_COLUMNS if columns is None else columns)
