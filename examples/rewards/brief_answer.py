"""A user reward in one file: the right number, and a bonus for saying nothing else.

Run it by config alone (no edit in megarl/):

    megarl run configs/arithmetic_grpo_cpu.yaml reward_fn=examples.rewards.brief_answer.brief_answer_reward

A reward is a module-level function ``fn(prompt, completions, prompt_ids, completion_ids, **row)``
(AReaL's names: ``completions`` is the completion's text) returning a float; ``row`` holds the dataset row's fields (here ``answer``). It runs in a worker
process with a timeout (a timeout or an exception scores 0), so keep it picklable: top level, no
closures.
"""

from __future__ import annotations

import re


def brief_answer_reward(prompt: str, completions: str, prompt_ids, completion_ids, answer: str, **row) -> float:
    """1 for the right final number; 0.2 less when anything but the number was written."""
    numbers = re.findall(r"-?\d+", completions)
    if not numbers or numbers[-1] != str(answer).strip():
        return 0.0
    return 1.0 if completions.strip() == numbers[-1] else 0.8
