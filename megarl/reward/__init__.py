"""Rewards: math answer extraction and equivalence, the GSM8K reward, a process-pool runner.

A reward function has AReaL's signature
``reward_fn(prompt, completions, prompt_ids, completion_ids, **data) -> float`` and lives
at module level (it is sent to worker processes by reference); an ``async def`` one is awaited
on the rollout's event loop instead (a reward service: :mod:`megarl.reward.remote`; an LLM judge:
:mod:`megarl.reward.judge`).
"""

from megarl.reward.base import OUTCOMES, ScoredReward
from megarl.reward.executor import AsyncRewardWrapper
from megarl.reward.gsm8k import gsm8k_reward_fn, math_reward
from megarl.reward.math_parser import extract_answer, math_equal

__all__ = [
    "OUTCOMES",
    "AsyncRewardWrapper",
    "ScoredReward",
    "extract_answer",
    "gsm8k_reward_fn",
    "math_equal",
    "math_reward",
]
