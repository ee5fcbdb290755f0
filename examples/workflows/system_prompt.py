"""A user workflow in one file: GRPO samples of a prompt behind a system message of your own.

Run it by config alone (no edit in megarl/):

    megarl run configs/arithmetic_grpo_cpu.yaml workflow.type=examples.workflows.system_prompt.SystemPromptWorkflow \\
        'workflow.kwargs.system_prompt="Think, then give the number."'

The trainer builds it with ``SystemPromptWorkflow(**workflow.kwargs)`` plus the run's ``reward_fn``,
``gconfig`` and ``tokenizer`` (its constructor takes them, so they are filled in). What a workflow
must do: ``async def arun_episode(engine, data)`` returns ``gconfig.n_samples`` trajectories of one
dataset row (or None to reject it), sampled with ``engine.agenerate``.
"""

from __future__ import annotations

import asyncio
import uuid

from megarl.api.io_struct import ModelRequest
from megarl.api.trajectory import concat_padded_tensors, make_trajectory
from megarl.api.workflow_api import RolloutWorkflow
from megarl.reward.executor import AsyncRewardWrapper


class SystemPromptWorkflow(RolloutWorkflow):
    def __init__(
        self, reward_fn, gconfig, tokenizer, system_prompt: str = "You are a careful calculator.", reward_config=None
    ):
        self.gconfig = gconfig
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        # the reward in worker processes, with the config's reward.timeout_seconds; a broken one stops the run
        self.reward = AsyncRewardWrapper.from_config(reward_fn, reward_config)

    async def arun_episode(self, engine, data):
        messages = [{"role": "system", "content": self.system_prompt}, *data["messages"]]
        prompt = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        rid = uuid.uuid4().hex  # the group on one server: the prompt is its cached prefix
        # for_sample: sample i's own seed when gconfig.seed is set, so a group's samples differ
        requests = [
            ModelRequest(rid=rid, input_ids=list(prompt), gconfig=self.gconfig.for_sample(prompt, i))
            for i in range(self.gconfig.n_samples)
        ]
        responses = await asyncio.gather(*(engine.agenerate(req) for req in requests))
        rewards = await asyncio.gather(*(self.score(resp, data) for resp in responses))
        return concat_padded_tensors(
            [
                make_trajectory(r.input_tokens, r.output_tokens, r.output_logprobs, r.output_versions, reward)
                for r, reward in zip(responses, rewards)
            ]
        )

    async def score(self, resp, data) -> float:
        completion = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        prompt = self.tokenizer.decode(resp.input_tokens)
        return float(await self.reward(prompt, completion, resp.input_tokens, resp.output_tokens, **data))

    def close(self) -> None:
        self.reward.close()
