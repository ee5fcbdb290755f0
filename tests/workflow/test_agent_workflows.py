"""AReaL's agent-style workflows (``async def run(data, **extra_kwargs)``), passed as an AReaL user does.

Every form of passing one (class, instance, string path, through the pool) runs it behind
the OpenAI-compatible proxy (:class:`OpenAIAgentWorkflow`). How a run's calls make its episode:
their seeds, which call is the last, a call the agent gave up on, a prompt over the context.
"""

from __future__ import annotations

import asyncio
import contextlib

import openai
import pytest
from openai import AsyncOpenAI

from megarl.api.io_struct import GenerationHyperparameters
from megarl.config.rollout import InferenceEngineConfig
from megarl.rollout import RolloutPool
from megarl.rollout.pool import RolloutError
from megarl.utils import stats_tracker
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


def client_of(extra_kwargs, **options) -> AsyncOpenAI:
    """The client an agent builds from AReaL's extra_kwargs (``options``: e.g. its ``timeout``)."""
    keys = ("base_url", "api_key", "http_client")
    return AsyncOpenAI(**{key: extra_kwargs[key] for key in keys}, max_retries=0, **options)


def run_episode(workflow, engine, row=ROW):
    try:
        return asyncio.run(workflow.arun_episode(engine, row))
    finally:
        workflow.close()


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


class AsksAgain:
    """Asks the same messages ``times`` times (e.g. for self-consistency)."""

    def __init__(self, times: int):
        self.times = times

    async def run(self, data, **extra_kwargs):
        client = client_of(extra_kwargs)
        for _ in range(self.times):
            await client.chat.completions.create(model="m", messages=data["messages"])
        return 1.0


def test_each_call_of_a_seeded_episode_draws_its_own_seed(tokenizer):
    """gconfig.seed: the same messages asked again draw another sample; the seeds are alike in every run."""
    gconfig = GenerationHyperparameters(n_samples=2, max_new_tokens=8, seed=7)

    def seeds():
        engine = ScriptedLLM(tokenizer)
        run_episode(OpenAIAgentWorkflow(AsksAgain(3), gconfig, tokenizer), engine)
        return sorted(request.gconfig.seed for request in engine.requests)

    first = seeds()
    assert len(set(first)) == 6 and seeds() == first


class SlowFirstCall:
    """Its first call takes half a second and says "SEVEN", the others say "FIVE" at once; ``first_ended``
    is set when the first call ends, ``first_cancelled`` says whether it was cancelled."""

    def __init__(self, tokenizer):
        self.tokenizer, self.started = tokenizer, 0
        self.first_ended, self.first_cancelled = asyncio.Event(), False

    def get_version(self) -> int:
        return 0

    async def agenerate(self, req):
        self.started += 1
        if self.started > 1:
            return await ScriptedLLM(self.tokenizer, ["FIVE"]).agenerate(req)
        try:
            await asyncio.sleep(0.5)
        except asyncio.CancelledError:
            self.first_cancelled = True
            raise
        finally:
            self.first_ended.set()
        return await ScriptedLLM(self.tokenizer, ["SEVEN"]).agenerate(req)


class AsksAgainMeanwhile:
    """Asks; while that first call runs, asks again; works on until the first call has ended. ``gives_up``:
    the first call's client times out after 0.2 s (the agent gave up on it), else the agent awaits both."""

    def __init__(self, engine: SlowFirstCall, gives_up: bool):
        self.engine, self.gives_up = engine, gives_up

    async def run(self, data, **extra_kwargs):
        client = client_of(extra_kwargs)
        slow = client_of(extra_kwargs, timeout=0.2) if self.gives_up else client
        first = asyncio.ensure_future(slow.chat.completions.create(model="m", messages=data["messages"]))
        while not self.engine.started:
            await asyncio.sleep(0.01)
        await client.chat.completions.create(model="m", messages=data["messages"])
        with contextlib.suppress(openai.APITimeoutError):  # the call it gave up on
            await first
        await self.engine.first_ended.wait()  # e.g. a tool runs meanwhile
        return 1.0


@pytest.mark.parametrize("gives_up", [True, False], ids=["gave-up-on-the-first", "awaited-both"])
def test_the_last_call_is_the_last_started_and_an_abandoned_call_is_cancelled(tokenizer, gives_up):
    engine = SlowFirstCall(tokenizer)
    stats_tracker.export(local=True)  # start clean
    traj = run_episode(OpenAIAgentWorkflow(AsksAgainMeanwhile(engine, gives_up), tokenizer=tokenizer), engine)
    stats = stats_tracker.export(local=True)
    trained = traj["input_ids"][0][traj["loss_mask"][0].bool()].tolist()
    assert tokenizer.decode(trained) == "FIVE<|im_end|>", "the last call started, not the last to finish"
    assert engine.first_cancelled == gives_up, "a call whose client hung up stops generating"
    assert stats["agent_calls"] == (1 if gives_up else 2), "and is not recorded"


class StopsWhenOutOfRoom:
    """Stops (reward 0) when its call is refused for the context length, as the proxy's docs invite."""

    async def run(self, data, **extra_kwargs):
        try:
            await client_of(extra_kwargs).chat.completions.create(model="m", messages=data["messages"])
        except openai.BadRequestError as e:
            if e.code != "context_length_exceeded":
                raise
            return 0.0
        return 1.0


def test_a_prompt_over_the_context_rejects_its_episode_and_the_run_goes_on(tokenizer, caplog):
    gconfig = GenerationHyperparameters(n_samples=2, max_new_tokens=8)
    workflow = OpenAIAgentWorkflow(StopsWhenOutOfRoom(), gconfig, tokenizer, max_context_len=64)
    engine = ScriptedLLM(tokenizer, reply=lambda req: "It is 72.")
    long_row = {"messages": [{"role": "user", "content": "word " * 100}], "answer": "72"}
    pool = RolloutPool(engine, InferenceEngineConfig(), batch_size=1).start()
    try:
        assert pool.rollout_batch([long_row], workflow) == {}, "rejected: no rows, no error"
        assert pool.rollout_batch([ROW], workflow)["rewards"].tolist() == [1.0, 1.0]
    finally:
        pool.destroy()
        workflow.close()
    assert len(engine.requests) == 2, "only the prompt that fits reached the engine"
    assert caplog.text.count("max_context_len=64 (context_length_exceeded); its episode is rejected") == 1


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
