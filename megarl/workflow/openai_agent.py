"""AReaL's agent-style workflows: your agent's own code, on the ``openai`` client, trained on.

An agent is any object with ``async def run(self, data, **extra_kwargs)`` that returns its
reward. ``extra_kwargs`` are AReaL's: ``base_url``, ``api_key`` and ``http_client``, the
agent's session on the proxy (:mod:`megarl.workflow.openai_proxy`)::

    class MyAgent:
        async def run(self, data, **extra_kwargs):
            client = AsyncOpenAI(base_url=extra_kwargs["base_url"], api_key=extra_kwargs["api_key"],
                                 http_client=extra_kwargs["http_client"])
            completion = await client.chat.completions.create(model="any", messages=data["messages"])
            return float(data["answer"] in completion.choices[0].message.content)

:class:`OpenAIAgentWorkflow` runs it ``gconfig.n_samples`` times per dataset item,
concurrently, each run in its own session (and on its own deep copy of the item), and
turns each run's recorded calls and reward into trajectories. The reward is AReaL's: a number
(an int, a float, a bool, a numpy scalar or a one-element tensor) is the last call's; a dict sets
calls by completion id (``completion.id``); each earlier call then adds the next one's reward
times ``turn_discount``. The last call is the last one started (as in AReaL); a call the agent
gave up on (its client timed out or hung up) is cancelled and not recorded.

Export styles (AReaL's names):

* ``concat`` (default): one row per run, the run's final conversation: the last call (the
  last started) and the calls it continues (token in, token out). Their prompt, tool and
  user ids have ``loss_mask`` 0, their sampled ids 1 with their own logprobs and versions.
  Its reward is the last call's (the float the run returned). One row per run keeps a GRPO
  group at ``n_samples`` rows. Calls off that conversation (a side question, an edited history) are
  counted in ``agent_off_chain_calls`` and not trained on. (AReaL's ``concat`` returns a
  row per leaf of the conversation tree, a number that varies per run.)
* ``individual``: one row per call, its own prompt and output, with its discounted reward.
  The number of rows varies from run to run, which the trainer's GRPO groups do not allow
  (:func:`trainer_export_problem`): for loops of your own. A config whose workflow would
  export it is refused when it loads, and the trainer refuses to build one.

A run that raises fails the episode, its exception chained; so does a run that made no
LLM call through the proxy, or whose call failed in the inference engine (even if the
agent caught the error). A run whose every call was refused because its prompt filled the
context (``context_length_exceeded``, which the agent caught to stop) rejects the episode
(None, with a warning once per workflow): its item is not trained on.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import uuid
from collections.abc import Coroutine
from typing import Any, Literal

from megarl.api.engine_api import GenerationEngine
from megarl.api.io_struct import GenerationHyperparameters
from megarl.api.trajectory import concat_padded_tensors, response_trajectory
from megarl.api.workflow_api import RolloutWorkflow, is_agent
from megarl.reward.failures import RewardFailure, RewardFunctionError, as_reward
from megarl.utils import stats_tracker
from megarl.utils.logging import WarnOnce
from megarl.workflow.chat import Episode
from megarl.workflow.openai_proxy import CallRecord, OpenAIProxy, ProxySession

logger = logging.getLogger(__name__)

ExportStyle = Literal["concat", "individual"]


def trainer_export_problem(export_style: str) -> str | None:
    """Why megarl's trainer cannot train the rows of ``export_style``, else None.

    Its GRPO group is ``gconfig.n_samples`` consecutive rows per prompt: advantages are
    normalised within it, batches are split over data-parallel ranks on its boundaries and
    sized from it. ``individual`` gives one row per LLM call, a number that varies per run.
    """
    if export_style != "individual":
        return None
    return (
        "export_style='individual' gives one row per LLM call, a number that varies from run to run, but "
        "the trainer's GRPO groups are gconfig.n_samples rows per prompt (advantages, the data-parallel "
        "split and the batch size rely on it): use 'concat' (the default: each run's final conversation, "
        "every sampled token trained); 'individual' is for loops of your own"
    )


class AgentRunError(RuntimeError):
    """An agent's run raised, made no LLM call, lost a call, or returned no usable reward."""


class OpenAIAgentWorkflow(RolloutWorkflow):
    """Runs an agent behind the OpenAI-compatible proxy (AReaL's ``OpenAIProxyWorkflow``, inline mode).

    Args:
        agent: An instance with ``async def run(self, data, **extra_kwargs)`` returning a number,
            or a dict of numbers by completion id.
        gconfig: Sampling of every call (what a request may change: :mod:`~megarl.workflow.openai_proxy`);
            ``n_samples`` runs per item. None: one run, the defaults.
        tokenizer: Its chat template renders the messages. None: the engine's (the tokenizer
            given to ``RemoteInferenceEngine.initialize``).
        max_context_len: The servers' context length: a call's token budget is lowered to fit.
        export_style: ``"concat"`` (a row per run) or ``"individual"`` (a row per call).
        turn_discount: Factor of a later call's reward added to an earlier one's (AReaL's).
    """

    def __init__(
        self,
        agent: Any,
        gconfig: GenerationHyperparameters | None = None,
        tokenizer: Any = None,
        max_context_len: int | None = None,
        export_style: ExportStyle = "concat",
        turn_discount: float = 1.0,
    ):
        if isinstance(agent, type) or not is_agent(agent):
            raise TypeError(
                f"OpenAIAgentWorkflow needs an agent instance with 'async def run(self, data, "
                f"**extra_kwargs)', got {agent!r}"
            )
        if export_style not in ("concat", "individual"):
            raise ValueError(
                f"OpenAIAgentWorkflow: export_style must be 'concat' or 'individual', got {export_style!r}"
            )
        if not 0 < turn_discount <= 1:
            raise ValueError(f"OpenAIAgentWorkflow: turn_discount must be in (0, 1], got {turn_discount}")
        self.gconfig = gconfig or GenerationHyperparameters()
        self.gconfig.check()
        self.agent = agent
        self.tokenizer = tokenizer
        self.max_context_len = max_context_len
        self.export_style = export_style
        self.turn_discount = turn_discount
        self.proxy = OpenAIProxy()
        self._warn_context_rejection = WarnOnce(logger)  # an episode rejected: its prompt did not fit

    @property
    def agent_name(self) -> str:
        return type(self.agent).__qualname__

    async def arun_episode(self, engine: GenerationEngine, data: dict[str, Any]) -> dict[str, Any] | None:
        tokenizer = self.tokenizer or getattr(engine, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(
                f"agent {self.agent_name}: the proxy needs a tokenizer (its chat template): pass "
                "tokenizer= to OpenAIAgentWorkflow, or initialize the engine with tokenizer="
            )
        rid = uuid.uuid4().hex  # the runs on one server: the prompt is its cached prefix
        sessions = [
            ProxySession(engine, tokenizer, self.gconfig, i, rid, self.max_context_len)
            for i in range(self.gconfig.n_samples)
        ]
        runs = await _gather_or_cancel([self._run(session, data) for session in sessions])
        if any(rows is None for rows in runs):  # a GRPO group needs every run: the item is rejected
            return None
        return concat_padded_tensors([row for rows in runs for row in rows])

    async def _run(self, session: ProxySession, data: dict[str, Any]) -> list[dict[str, Any]] | None:
        """One run of the agent in ``session``: its rows, or None when its prompt did not fit the context."""
        async with self.proxy.serve(session) as extra_kwargs:
            try:
                result = await self.agent.run(copy.deepcopy(data), **extra_kwargs)
            except Exception as e:
                self._raise_if_a_call_failed(session)  # an engine failure behind the agent's error is the cause
                raise AgentRunError(f"agent {self.agent_name}.run raised {type(e).__name__}: {e}") from e
        self._raise_if_a_call_failed(session)
        if not session.calls and session.context_refusals:
            self._warn_context_rejection(
                "agent %s: every LLM call of a run (%d) was refused, its prompt longer than max_context_len=%s "
                "(context_length_exceeded); its episode is rejected (this warning is not repeated for later ones)",
                self.agent_name,
                session.context_refusals,
                self.max_context_len,
            )
            return None
        if not session.calls:
            raise AgentRunError(
                f"agent {self.agent_name}.run made no LLM call through the proxy: build its "
                "OpenAI client on extra_kwargs['base_url'] and ['api_key']"
            )
        rewards = call_rewards(session.calls, result, self.turn_discount, self.agent_name)
        stats_tracker.scalar(reward=rewards[-1], agent_calls=len(session.calls))
        if self.export_style == "individual":
            return [_call_trajectory(call, reward) for call, reward in zip(session.calls, rewards)]
        return [final_conversation(session.calls, rewards[-1])]

    def _raise_if_a_call_failed(self, session: ProxySession) -> None:
        if session.error is not None:
            raise AgentRunError(f"agent {self.agent_name}: an LLM call failed: {session.error!r}") from session.error

    def with_gconfig(self, gconfig: GenerationHyperparameters) -> OpenAIAgentWorkflow:
        """This agent sampled with ``gconfig`` (e.g. greedy evaluation); the twin shares the proxy."""
        gconfig.check()
        twin = copy.copy(self)
        twin.gconfig = gconfig
        return twin

    def close(self) -> None:
        """Stop the proxy server if an abandoned episode left it running."""
        self.proxy.close()


def call_rewards(calls: list[CallRecord], result: Any, turn_discount: float, agent_name: str) -> list[float]:
    """Each call's reward from what the run returned (AReaL's ``set_reward`` + ``apply_reward_discount``).

    A number is the last call's reward; a dict sets calls by completion id. Walking back
    from the last call, each call adds the next one's reward times ``turn_discount``.
    """
    if isinstance(result, dict):
        own = {key: _finite(value, f"agent {agent_name}.run's reward for {key}") for key, value in result.items()}
        unknown = sorted(set(own) - {call.id for call in calls})
        if unknown:
            raise AgentRunError(f"agent {agent_name}.run returned rewards of unknown completion ids {unknown}")
    elif _is_number(result):
        own = {calls[-1].id: _finite(result, f"agent {agent_name}.run's reward")}
    else:
        raise AgentRunError(
            f"agent {agent_name}.run returned {result!r}; expected its reward (a number) or a "
            "dict of rewards by completion id"
        )
    rewards, carried = [], 0.0
    for call in reversed(calls):
        carried = carried * turn_discount + own.get(call.id, 0.0)
        rewards.append(carried)
    return rewards[::-1]


def _is_number(value: Any) -> bool:
    """Whether ``value`` is a number as a reward function may return one (an int, a float, a bool, a numpy
    scalar, a tensor): whatever ``float()`` takes, text aside."""
    return hasattr(type(value), "__float__")


def _finite(value: Any, what: str) -> float:
    """An agent's reward meets a reward function's check (megarl.reward.failures): a finite number, else
    :class:`RewardFunctionError`, which stops the run."""
    result = as_reward(value)
    if isinstance(result, RewardFailure):
        raise RewardFunctionError(
            f"{what} is {result.detail}, not a finite number; a reward must be an int, a float or a bool"
        )
    return float(result)


def final_conversation(calls: list[CallRecord], reward: float) -> dict[str, Any]:
    """The ``concat`` row: the last call's conversation, its sampled ids trained on."""
    chain = calls[-1].chain()
    stats_tracker.scalar(agent_off_chain_calls=len(calls) - len(chain))
    episode = Episode()
    for call in chain:
        episode.add_model_response(call.response)
    return episode.to_trajectory(reward)


def _call_trajectory(call: CallRecord, reward: float) -> dict[str, Any]:
    """One call's row; with ``rollout.return_routed_experts`` it keeps the call's routed experts (MoE replay)."""
    return response_trajectory(call.response, reward)


async def _gather_or_cancel(coros: list[Coroutine]) -> list[Any]:
    """The results of ``coros`` run concurrently; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
