"""Multi-turn reflection: on a wrong answer, ask the model to try again (the AReaL notebook).

Each turn appends the model's answer, an end-of-sequence token if it did not stop
with one, and a reflection prompt given as token ids (the chat template's ids of that
user turn, computed once up front: decoding and re-encoding a sequence does not always
give back the same ids; see :mod:`megarl.workflow.chat`). The
trajectory is the whole conversation; only the model's tokens are trained on. The
reward of a correct answer at turn ``t`` (0-based) is ``turn_discount ** t``.

A reflection prompt holding ``{feedback}`` quotes what the reward said about the wrong answer (its
:class:`~megarl.reward.ScoredReward`'s ``feedback``: the code reward's failing test, say), so the model
retries with execution feedback (:data:`FEEDBACK_REFLECTION_PROMPT`); its ids are then computed each turn.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import uuid
from collections.abc import Callable
from typing import Any

from megarl.api.engine_api import GenerationEngine
from megarl.api.io_struct import GenerationHyperparameters, ModelRequest
from megarl.api.trajectory import concat_padded_tensors
from megarl.api.workflow_api import RolloutWorkflow
from megarl.config.rollout import RewardConfig
from megarl.utils import stats_tracker
from megarl.utils.logging import WarnOnce
from megarl.workflow.chat import Episode, end_turn, next_turn_ids
from megarl.workflow.rlvr import (
    RLVRWorkflow,
    default_data_extract_prompt_fn,
    default_get_input_ids_fn,
)

logger = logging.getLogger(__name__)

DEFAULT_REFLECTION_PROMPT = (
    "\nYour answer is either wrong or not parsable to the reward function. Please try to answer it again."
)


FEEDBACK_REFLECTION_PROMPT = "\nYour answer is wrong: {feedback}\nPlease fix it and answer again."
"""A reflection prompt that quotes the reward's feedback (what ``workflow.kwargs.reflection_prompt`` may be)."""


def reflection_token_ids(tokenizer, prompt: str = DEFAULT_REFLECTION_PROMPT, **template_kwargs: Any) -> list[int]:
    """Token ids that follow an answer's end-of-sequence token: the user turn ``prompt`` and the
    next generation prompt, as the chat template renders them with ``template_kwargs`` (those of the
    first prompt, e.g. ``enable_thinking``; :func:`next_turn_ids`)."""
    return next_turn_ids(tokenizer, [{"role": "user", "content": prompt}], **template_kwargs)


class MultiTurnReflectionWorkflow(RolloutWorkflow):
    """Up to ``max_turns`` attempts per sample; ``gconfig.n_samples`` samples run concurrently.

    Args:
        reward_fn: As for :class:`RLVRWorkflow`.
        gconfig: Sampling settings per turn.
        tokenizer: HF tokenizer with a chat template.
        max_turns: Attempts before giving up.
        turn_discount: Reward factor per extra turn.
        reflection_prompt: User message injected after a wrong answer; a ``{feedback}`` in it is replaced
            by the reward's feedback on that answer (:data:`FEEDBACK_REFLECTION_PROMPT`).
        max_context_len: Stop before a turn whose prompt plus ``max_new_tokens`` would
            exceed this (the server's context length); None: no limit. A first prompt that
            leaves no room for an answer rejects the episode (None), with a warning.
        enable_thinking: Passed to the chat template for every turn's prompt (Qwen3-style thinking).
        reward_config: As for :class:`RLVRWorkflow`.
    """

    def __init__(
        self,
        reward_fn: Callable[..., float],
        gconfig: GenerationHyperparameters,
        tokenizer,
        max_turns: int = 5,
        turn_discount: float = 0.9,
        reflection_prompt: str = DEFAULT_REFLECTION_PROMPT,
        max_context_len: int | None = None,
        enable_thinking: bool = False,
        get_input_ids_fn: Callable[..., list[int]] = default_get_input_ids_fn,
        data_extract_prompt_fn: Callable[[dict[str, Any]], Any] = default_data_extract_prompt_fn,
        reward_config: RewardConfig | None = None,
    ):
        if max_turns < 1:
            raise ValueError(f"MultiTurnReflectionWorkflow: max_turns must be >= 1, got {max_turns}")
        if not 0 < turn_discount <= 1:
            raise ValueError(f"MultiTurnReflectionWorkflow: turn_discount must be in (0, 1], got {turn_discount}")
        self.rlvr = RLVRWorkflow(
            reward_fn,
            gconfig,
            tokenizer,
            enable_thinking,
            get_input_ids_fn,
            data_extract_prompt_fn,
            reward_config,
        )
        self.gconfig = gconfig
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.turn_discount = turn_discount
        self.max_context_len = max_context_len
        self.reflection_prompt, self.enable_thinking = reflection_prompt, enable_thinking
        self.reflection_ids = reflection_token_ids(tokenizer, reflection_prompt, enable_thinking=enable_thinking)
        self._warn_prompt_too_long = WarnOnce(logger)  # an episode rejected: its prompt leaves no room

    def _turn_budget(self, prompt_len: int) -> int:
        if self.max_context_len is None:
            return self.gconfig.max_new_tokens
        return min(self.gconfig.max_new_tokens, self.max_context_len - prompt_len)

    async def _run_one(
        self, engine: GenerationEngine, data: dict[str, Any], prompt_ids: list[int], index: int
    ) -> dict[str, Any]:
        episode = Episode()
        rid = uuid.uuid4().hex  # every turn on the same server: the conversation is its cached prefix
        next_prompt = list(prompt_ids)
        reward, discount, turns = 0.0, 1.0, 0
        while turns < self.max_turns:
            budget = self._turn_budget(len(next_prompt))
            if budget < 1:
                break
            gconfig = self.gconfig.for_sample(next_prompt, index).new(max_new_tokens=budget)
            resp = await engine.agenerate(ModelRequest(rid=rid, input_ids=next_prompt, gconfig=gconfig))
            episode.add_model_response(resp)
            reward = await self.rlvr.score(resp, data)
            turns += 1
            if reward > 0 or turns == self.max_turns:
                break
            discount *= self.turn_discount
            next_prompt = end_turn(episode.input_ids, self.tokenizer.eos_token_id) + self._reflection(reward)
        stats_tracker.scalar(turns=turns)
        final = reward * discount
        return episode.to_trajectory(final)

    def _reflection(self, reward: float) -> list[int]:
        """The reflection turn's ids after a wrong answer scored ``reward``, its feedback quoted when the
        prompt asks for it (none given: "no details")."""
        if "{feedback}" not in self.reflection_prompt:
            return self.reflection_ids
        feedback = getattr(reward, "feedback", "") or "no details"
        prompt = self.reflection_prompt.replace("{feedback}", feedback)
        return reflection_token_ids(self.tokenizer, prompt, enable_thinking=self.enable_thinking)

    async def arun_episode(self, engine: GenerationEngine, data: dict[str, Any]) -> dict[str, Any] | None:
        rlvr = self.rlvr
        prompt_ids = rlvr.get_input_ids_fn(rlvr.data_extract_prompt_fn(data), self.tokenizer, rlvr.enable_thinking)
        if self._turn_budget(len(prompt_ids)) < 1:
            self._warn_prompt_too_long(
                "MultiTurnReflectionWorkflow: a prompt of %d tokens leaves no room for an answer in "
                "max_context_len=%d; its episode is rejected (this warning is not repeated for later ones)",
                len(prompt_ids),
                self.max_context_len,
            )
            return None
        samples = range(self.gconfig.n_samples)
        trajs = await asyncio.gather(*(self._run_one(engine, data, prompt_ids, i) for i in samples))
        return concat_padded_tensors(trajs)

    def with_gconfig(self, gconfig: GenerationHyperparameters) -> MultiTurnReflectionWorkflow:
        """This workflow sampling with ``gconfig`` (e.g. greedy evaluation); it shares the reward workers."""
        twin = copy.copy(self)
        twin.rlvr = self.rlvr.with_gconfig(gconfig)
        twin.gconfig = gconfig
        return twin

    def warm_up(self) -> None:
        """Start the reward workers now (see ``RLVRWorkflow.warm_up``)."""
        self.rlvr.warm_up()

    def close(self) -> None:
        """Stop the reward worker processes."""
        self.rlvr.close()
