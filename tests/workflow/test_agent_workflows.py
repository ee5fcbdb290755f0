"""AReaL's agent-style workflows (``async def run(data, **extra_kwargs)``), passed as an AReaL user does.

They need an OpenAI-compatible proxy that megarl does not have yet: every form of
passing one (class, instance, string path, through the pool) must fail at once with a
``TypeError`` that says so and names what to write instead.
"""

from __future__ import annotations

import pytest

from megarl.config.rollout import InferenceEngineConfig
from megarl.rollout import RolloutPool
from megarl.workflow import resolve_workflow
from tests.rollout.sim import SimEngine


class MathAgent:
    """AReaL's agent example, reduced: an OpenAI client on the proxy AReaL passes in, a reward back."""

    def __init__(self, temperature: float = 1.0):
        self.temperature = temperature

    async def run(self, data, **extra_kwargs):
        from openai import AsyncOpenAI  # never reached: megarl refuses the agent first

        client = AsyncOpenAI(base_url=extra_kwargs["base_url"], http_client=extra_kwargs["http_client"])
        completion = await client.chat.completions.create(messages=data["messages"], model="default")
        return float(data["answer"] in completion.choices[0].message.content)


AGENT_ERROR = (
    r"MathAgent is an agent-style workflow .*OpenAI-compatible proxy.*async def arun_episode\(self, engine, data\)"
)


@pytest.mark.parametrize(
    "workflow,kwargs",
    [
        (MathAgent, {"temperature": 0.5}),
        (MathAgent(), None),
        ("tests.workflow.test_agent_workflows.MathAgent", {"temperature": 0.5}),
    ],
    ids=["class", "instance", "string"],
)
def test_agent_workflow_is_refused_with_what_to_write(workflow, kwargs):
    with pytest.raises(TypeError, match=AGENT_ERROR):
        resolve_workflow(workflow, kwargs)


def test_agent_workflow_fails_at_submit_not_in_an_episode():
    pool = RolloutPool(SimEngine(), InferenceEngineConfig(), batch_size=2).start()
    try:
        with pytest.raises(TypeError, match=AGENT_ERROR):
            pool.submit({"messages": []}, workflow="tests.workflow.test_agent_workflows.MathAgent", workflow_kwargs={})
        with pytest.raises(TypeError, match=AGENT_ERROR):
            pool.rollout_batch([{"messages": []}], workflow=MathAgent, group_size=4)
        assert pool.staleness.get_stats().submitted == 0
    finally:
        pool.destroy()


class BothKinds:
    """Has ``arun_episode`` as well as a ``run``: a RolloutWorkflow, whatever else it offers."""

    async def run(self, data, **extra_kwargs):
        return 0.0

    async def arun_episode(self, engine, data):
        return None


def test_a_workflow_with_a_run_method_too_is_still_a_workflow():
    instance = BothKinds()
    assert resolve_workflow(instance) is instance
