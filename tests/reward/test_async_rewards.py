"""``async def`` rewards: awaited on the caller's event loop, side by side, under the same timeout and failure
rules as the worker-process ones, each call logging into its own record; ``reward.kwargs`` reach every call;
the config check awaits one on the dataset's first row."""

from __future__ import annotations

import asyncio
import os

import pytest

from megarl.api import context as workflow_context
from megarl.config import GRPOConfig
from megarl.config.base import ConfigError
from megarl.config.rollout import RewardConfig
from megarl.reward import AsyncRewardWrapper
from megarl.reward.call import TrainerState, current_trainer_state, log_metric
from megarl.reward.executor import call_reward_async, is_async_reward
from megarl.reward.failures import FIRST_CALLS, RewardFunctionError
from megarl.reward.trl import AsyncTRLReward, from_trl
from megarl.utils import stats_tracker

CALLS = 8
_arrived: list[int] = []
_all_arrived: asyncio.Event | None = None
_cancelled: list[str] = []


async def rendezvous_reward(prompt, completions, prompt_ids, completion_ids, **row) -> float:
    """Returns only once every one of :data:`CALLS` calls has started: calls made one after another would
    each wait for the others until the timeout."""
    _arrived.append(os.getpid())
    if len(_arrived) == CALLS:
        _all_arrived.set()
    await _all_arrived.wait()
    return float(completions == row["answer"])


async def hanging_reward(prompt, completions, prompt_ids, completion_ids, **row) -> float:
    try:
        await asyncio.sleep(60)
    finally:
        _cancelled.append(completions)
    return 1.0


async def own_timeout_reward(prompt, completions, prompt_ids, completion_ids, **row) -> float:
    return await asyncio.wait_for(asyncio.sleep(60), 0.01)  # the reward's own client timing out, say


async def logging_reward(prompt, completions, prompt_ids, completion_ids, **row) -> float:
    log_metric("length", len(completions))
    await asyncio.sleep(0.01)  # the other call logs meanwhile
    log_metric("length", 10 * len(completions))
    return float(current_trainer_state().global_step)


async def settings_reward(prompt, completions, prompt_ids, completion_ids, *, scale, **row) -> float:
    return scale * float(completions == row["answer"])


async def check_row_reward(prompt, completions, prompt_ids, completion_ids, *, url, **row) -> float:
    if not url.startswith("http://"):
        raise ValueError(f"not a reward service: {url!r}")
    return 1.0


async def raising_reward(prompt, completions, prompt_ids, completion_ids, **row) -> float:
    raise KeyError("expected")


async def trl_judge(completions, trainer_state, **kwargs) -> list[float]:
    await asyncio.sleep(0)
    return [float(trainer_state.global_step + len(completions[0]))]


def _in_episodes(wrapper: AsyncRewardWrapper, completions: list[str], **row) -> list:
    """The calls side by side, each in its own episode; a RewardFunctionError in the place of its reward."""

    async def one(i: int, completion: str):
        with workflow_context.use(workflow_context.WorkflowContext(task_id=i, version=3)):
            try:
                return await wrapper("<prompt>", completion, [1], [2], **row)
            except RewardFunctionError as e:
                return e

    async def main():
        with stats_tracker.scope("async_test"):
            return await asyncio.gather(*(one(i, c) for i, c in enumerate(completions)))

    return asyncio.run(main())


def test_async_rewards_are_awaited_side_by_side_in_the_callers_process():
    """All 8 calls must be running at once for any to return (with worker processes, or one call at a time,
    each would wait out its timeout); they ran in this process, and their rewards are the function's."""
    global _all_arrived
    _arrived.clear()
    _all_arrived = asyncio.Event()
    wrapper = AsyncRewardWrapper(rendezvous_reward, timeout_seconds=30, max_workers=1)
    assert wrapper.is_async and wrapper.warm_up() == []
    rewards = _in_episodes(wrapper, ["42"] * 4 + ["41"] * 4, answer="42")
    assert [float(r) for r in rewards] == [1.0] * 4 + [0.0] * 4
    assert [r.outcome for r in rewards] == ["ok"] * CALLS
    assert _arrived == [os.getpid()] * CALLS
    assert wrapper._executor is None, "no worker pool for an async reward"


def test_an_async_reward_past_its_timeout_is_cancelled_and_counted():
    _cancelled.clear()
    wrapper = AsyncRewardWrapper(hanging_reward, timeout_seconds=0.2)
    rewards = _in_episodes(wrapper, ["a", "b"], answer="42")
    assert [(float(r), r.outcome) for r in rewards] == [(0.0, "timeout")] * 2
    assert sorted(_cancelled) == ["a", "b"], "the calls were cancelled, not left running"
    stats = stats_tracker.export(local=True)
    assert stats["async_test/reward/timeout"] == 2 and stats["async_test/reward/failures"] == 2


def test_a_timeout_error_of_the_rewards_own_is_an_error_with_its_traceback():
    """Only the bound's expiry is a timeout; the reward's own TimeoutError is its exception, shown with
    its frames when the first calls all fail."""
    wrapper = AsyncRewardWrapper(own_timeout_reward, timeout_seconds=30)
    results = _in_episodes(wrapper, ["x"] * FIRST_CALLS, answer="42")
    assert [r.outcome for r in results[:-1]] == ["error"] * (FIRST_CALLS - 1)
    error = next(r for r in results if isinstance(r, RewardFunctionError))
    text = str(error)
    assert f"{__name__}.own_timeout_reward failed on each of its first {FIRST_CALLS} calls" in text, text
    assert "in own_timeout_reward" in text and "TimeoutError" in text, text


def test_a_raising_async_reward_stops_the_run_naming_it_and_the_row():
    results = _in_episodes(AsyncRewardWrapper(raising_reward, timeout_seconds=30), ["x"] * FIRST_CALLS, answer="42")
    error = next(r for r in results if isinstance(r, RewardFunctionError))
    assert "KeyError: 'expected'" in str(error) and "row {answer='42'}" in str(error), str(error)


def test_calls_awaited_side_by_side_each_log_into_their_own_record():
    """Two calls interleave their log_metric calls; each returns only its own values and the step of the
    state it was called with."""

    async def main():
        return await asyncio.gather(
            call_reward_async(logging_reward, ("p", "ab", [], []), {}, 5, TrainerState(global_step=1)),
            call_reward_async(logging_reward, ("p", "abcd", [], []), {}, 5, TrainerState(global_step=2)),
        )

    (first, first_logged), (second, second_logged) = asyncio.run(main())
    assert (float(first), float(second)) == (1.0, 2.0)
    assert first_logged == {"length": [2.0, 20.0]} and second_logged == {"length": [4.0, 40.0]}


def test_reward_kwargs_reach_every_call_over_a_row_field_of_the_same_name():
    wrapper = AsyncRewardWrapper.from_config(settings_reward, RewardConfig(kwargs={"scale": 0.5}))
    assert wrapper.kwargs == {"scale": 0.5}
    assert [float(r) for r in _in_episodes(wrapper, ["42", "7"], answer="42", scale=9)] == [0.5, 0.0]


def test_an_async_trl_reward_is_awaited_with_the_runs_state():
    reward = from_trl(trl_judge)
    assert isinstance(reward, AsyncTRLReward) and is_async_reward(reward)
    assert not is_async_reward(from_trl(lambda completions, **kw: [1.0]))
    rewards = _in_episodes(AsyncRewardWrapper(reward, timeout_seconds=30), ["abc"], answer="1")
    assert float(rewards[0]) == 3 + 3, "global_step 3 (the episode's version) + len('abc')"


def _config(*overrides: str):
    from megarl.run.prelaunch import build_config

    return build_config(GRPOConfig, ["configs/arithmetic_grpo_cpu.yaml"], list(overrides))


def test_the_config_check_awaits_an_async_reward_with_its_kwargs_on_the_first_row():
    config = _config(f"reward_fn={__name__}.check_row_reward", "reward.kwargs.url=http://rm:8000/score")
    assert config.reward.kwargs == {"url": "http://rm:8000/score"}
    with pytest.raises(ConfigError) as info:
        _config(f"reward_fn={__name__}.check_row_reward", "reward.kwargs.url=rm:8000")
    message = info.value.message
    assert info.value.key == "reward_fn" and "the dataset's first row with the stand-in completion" in message
    assert "ValueError: not a reward service: 'rm:8000'" in message, message


def test_reward_kwargs_on_a_row_column_or_a_positional_argument_are_refused_naming_them():
    with pytest.raises(ConfigError) as info:
        _config(f"reward_fn={__name__}.check_row_reward", "reward.kwargs.url=http://x", "reward.kwargs.answer=1")
    assert info.value.key == "reward.kwargs" and "['answer'] is also the dataset's row column" in info.value.message
    with pytest.raises(ConfigError) as info:
        _config(f"reward_fn={__name__}.check_row_reward", "reward.kwargs.url=http://x", "reward.kwargs.prompt=1")
    assert info.value.key == "reward.kwargs" and "['prompt']: the reward's four positional" in info.value.message
