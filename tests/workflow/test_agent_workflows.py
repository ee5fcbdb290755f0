"""AReaL's agent-style workflows (``async def run(data, **extra_kwargs)``), passed as an AReaL user does.

Every form of passing one (class, instance, string path, through the pool) runs it behind
the OpenAI-compatible proxy (:class:`OpenAIAgentWorkflow`).
"""

from __future__ import annotations

import pytest
from openai import AsyncOpenAI

from megarl.config.rollout import InferenceEngineConfig
from megarl.rollout import RolloutPool
from megarl.rollout.pool import RolloutError
from megarl.workflow import OpenAIAgentWorkflow, resolve_workflow
from megarl.workflow.openai_agent import AgentRunError
from tests.workflow.scripted_llm import ScriptedLLM

ROW = {"messages": [{"role": "user", "content": "Natalia sold 48 clips..."}], "answer": "72"}
AGENT_PATH = "tests.workflow.test_agent_workflows.MathAgent"


class MathAgent:
    """AReaL's agent example, reduced: an OpenAI client on the proxy AReaL passes in, a reward back."""

    def __init__(self, temperature: float = 1.0):
        self.temperature = temperature

    async def run(self, data, **extra_kwargs):
        client = AsyncOpenAI(
            base_url=extra_kwargs["base_url"],
            api_key=extra_kwargs["api_key"],
            http_client=extra_kwargs["http_client"],
            max_retries=0,
        )
        completion = await client.chat.completions.create(
            messages=data["messages"], model="default", temperature=self.temperature
        )
        return float(data["answer"] in completion.choices[0].message.content)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.parametrize(
    "workflow,kwargs",
    [(MathAgent, {"temperature": 0.5}), (MathAgent(0.5), None), (AGENT_PATH, {"temperature": 0.5})],
    ids=["class", "instance", "string"],
)
def test_an_agent_runs_behind_the_proxy(workflow, kwargs):
    resolved = resolve_workflow(workflow, kwargs)
    assert isinstance(resolved, OpenAIAgentWorkflow) and resolved.agent.temperature == 0.5
    assert resolved.gconfig.n_samples == 1, "one run per episode: group_size makes the group, as in AReaL"


def test_an_agent_instance_takes_no_workflow_kwargs():
    with pytest.raises(ValueError, match=r"workflow_kwargs \['temperature'\] given with an already built MathAgent"):
        resolve_workflow(MathAgent(), {"temperature": 0.5})


def test_agents_run_through_the_pool(tokenizer):
    engine = ScriptedLLM(tokenizer, reply=lambda req: "It is 72.")  # the engine's tokenizer renders the chat
    pool = RolloutPool(engine, InferenceEngineConfig(), batch_size=2).start()
    try:
        batch = pool.rollout_batch([ROW, ROW], workflow=AGENT_PATH, group_size=2)
        assert batch["input_ids"].shape[0] == 4 and batch["rewards"].tolist() == [1.0] * 4
        # a temperature other than the training one is refused: the episode fails, saying why
        with pytest.raises(RolloutError) as err:
            pool.rollout_batch([ROW], workflow=MathAgent, workflow_kwargs={"temperature": 0.5})
        assert isinstance(err.value.__cause__, AgentRunError) and "temperature=0.5" in str(err.value.__cause__)
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


def test_an_agent_calls_row_keeps_its_routed_experts():
    """``rollout.return_routed_experts`` (MoE replay): a per-call row carries the call's prompt and answer routes,
    token-aligned (row ``i``: the forward that produced token ``i``; none for the first token)."""
    from types import SimpleNamespace

    from megarl.api.io_struct import ModelResponse
    from megarl.workflow.openai_agent import _call_trajectory

    response = ModelResponse(
        input_tokens=[1, 2, 3],
        output_tokens=[4, 5],
        output_logprobs=[-0.1, -0.2],
        output_versions=[0, 0],
        input_routed_experts=[[0, 1], [1, 2]],
        output_routed_experts=[[2, 3], [3, 0]],
    )
    row = _call_trajectory(SimpleNamespace(response=response), reward=1.0)
    assert row["routed_experts"][0].tolist() == [[-1, -1], [0, 1], [1, 2], [2, 3], [3, 0]]
