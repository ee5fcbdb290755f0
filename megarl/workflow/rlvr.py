"""RLVR: sample ``n_samples`` answers per prompt and score each with a verifiable reward."""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections.abc import Callable
from typing import Any

from megarl.api.engine_api import GenerationEngine
from megarl.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from megarl.api.trajectory import concat_padded_tensors, response_trajectory
from megarl.api.workflow_api import RolloutWorkflow
from megarl.config.rollout import RewardConfig
from megarl.reward.base import ScoredReward
from megarl.reward.executor import AsyncRewardWrapper
from megarl.utils import stats_tracker


def default_data_extract_prompt_fn(data: dict[str, Any]) -> list[dict[str, str]]:
    """The chat messages of a dataset row (``row["messages"]``)."""
    try:
        return data["messages"]
    except KeyError:
        raise KeyError(f"dataset row has no 'messages' (keys: {sorted(data)}); pass data_extract_prompt_fn") from None


def default_get_input_ids_fn(messages: list[dict[str, str]], tokenizer, enable_thinking: bool) -> list[int]:
    """Prompt token ids: the chat template with the generation prompt appended."""
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, enable_thinking=enable_thinking, return_dict=False
    )
    return list(ids)


class RLVRWorkflow(RolloutWorkflow):
    """Generates ``gconfig.n_samples`` completions concurrently and scores each.

    Returns ``[n_samples, seq_len]`` tensors (see :mod:`megarl.api.trajectory`).
    Rewards run in worker processes with a timeout (:class:`AsyncRewardWrapper`; an ``async def`` one is
    awaited on the loop); a reward function that is broken stops the run (:mod:`megarl.reward.failures`).

    Args:
        reward_fn: Module-level ``fn(prompt, completions, prompt_ids, completion_ids, **data) -> float``
            (or ``async def``).
        gconfig: Sampling settings; ``n_samples`` is the group size.
        tokenizer: HF tokenizer (chat template, decoding).
        enable_thinking: Passed to the chat template (Qwen3-style thinking).
        get_input_ids_fn: ``(prompt, tokenizer, enable_thinking) -> token ids``.
        data_extract_prompt_fn: ``row -> prompt`` handed to ``get_input_ids_fn``.
        reward_config: The reward's timeout and when its failures stop the run (the ``reward`` section;
            None: its defaults).
        reward_max_workers: Reward worker processes.
    """

    def __init__(
        self,
        reward_fn: Callable[..., float],
        gconfig: GenerationHyperparameters,
        tokenizer,
        enable_thinking: bool = False,
        get_input_ids_fn: Callable[..., list[int]] = default_get_input_ids_fn,
        data_extract_prompt_fn: Callable[[dict[str, Any]], Any] = default_data_extract_prompt_fn,
        reward_config: RewardConfig | None = None,
        reward_max_workers: int | None = None,
    ):
        gconfig.check()
        self.reward_fn = reward_fn
        self.gconfig = gconfig
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        self.get_input_ids_fn = get_input_ids_fn
        self.data_extract_prompt_fn = data_extract_prompt_fn
        self.async_reward_fn = AsyncRewardWrapper.from_config(reward_fn, reward_config, reward_max_workers)

    def with_gconfig(self, gconfig: GenerationHyperparameters) -> RLVRWorkflow:
        """This workflow sampling with ``gconfig`` (e.g. greedy evaluation); it shares the reward workers."""
        gconfig.check()
        twin = copy.copy(self)
        twin.gconfig = gconfig
        return twin

    def warm_up(self) -> None:
        """Start the reward workers now rather than at the first reward (see ``AsyncRewardWrapper.warm_up``)."""
        self.async_reward_fn.warm_up()

    async def score(self, resp: ModelResponse, data: dict[str, Any]) -> ScoredReward:
        """The reward of one response (decoded, then scored in a worker process), with its outcome and
        feedback."""
        prompt_str = self.tokenizer.decode(resp.input_tokens)
        completion_str = self.tokenizer.decode(resp.output_tokens)
        reward = await self.async_reward_fn(prompt_str, completion_str, resp.input_tokens, resp.output_tokens, **data)
        stats_tracker.scalar(reward=float(reward), completion_len=resp.output_len)
        return reward

    async def arun_episode(self, engine: GenerationEngine, data: dict[str, Any]) -> dict[str, Any]:
        input_ids = self.get_input_ids_fn(self.data_extract_prompt_fn(data), self.tokenizer, self.enable_thinking)
        rid = uuid.uuid4().hex  # one server for the group: the prompt is its cached prefix
        reqs = [
            ModelRequest(
                rid=rid, input_ids=input_ids, gconfig=self.gconfig.for_sample(input_ids, i), tokenizer=self.tokenizer
            )
            for i in range(self.gconfig.n_samples)
        ]
        resps = await asyncio.gather(*(engine.agenerate(req) for req in reqs))
        rewards = await asyncio.gather(*(self.score(resp, data) for resp in resps))
        trajs = [response_trajectory(r, reward) for r, reward in zip(resps, rewards)]
        return concat_padded_tensors(trajs)

    def close(self) -> None:
        """Stop the reward worker processes (those of every ``with_gconfig`` twin: they are shared)."""
        self.async_reward_fn.close()
