"""A reward function is the user's code: failed calls are counted, a broken function stops the run.

Real worker processes (``AsyncRewardWrapper``'s spawn pool, one for the module: spawning one costs
seconds) run :func:`user_reward`, which does what each call's row says: return a value, raise, or hang.
Each test starts the wrapper's failure count afresh. What is checked is what a user reads: the
function's name, the exception with its traceback (or the bad value) and the row of the call.
"""

from __future__ import annotations

import asyncio

import pytest

from megarl.api import context as workflow_context
from megarl.reward import AsyncRewardWrapper, ScoredReward
from megarl.reward.failures import FIRST_CALLS, RewardFailures, RewardFunctionError, reward_failures_note
from megarl.utils import stats_tracker

PROMPT = "<|im_start|>user\nWhat is 17 + 25? Reply with digits only.<|im_end|>\n<|im_start|>assistant\n"
TIMEOUT_S = 2.0
VALUES = {"none": None, "text": "1.0", "inf": float("inf"), "nan": float("nan"), "list": [1.0], "one": 1, "true": True}
VALUES["feedback"] = ScoredReward(0.0, "incorrect", "it printed 41")


def user_reward(prompt, completion, prompt_ids, completion_ids, **row):
    """A user's reward: ``row["do"]`` says what this call does."""
    if row["do"] == "raise":
        return _lookup(row)
    if row["do"] == "hang":
        import time

        time.sleep(60)
    return VALUES[row["do"]]


def _lookup(row):
    return float(row["expected"])  # a user's bug: the dataset's column is "answer"


@pytest.fixture(scope="module")
def wrapper():
    wrapper = AsyncRewardWrapper(user_reward, timeout_seconds=TIMEOUT_S, max_workers=1)
    yield wrapper
    wrapper._replace_executor(wrapper._get_executor())  # a hung call may still sleep: do not wait for it


def _run(wrapper: AsyncRewardWrapper, rows: list[dict], scope: str, **failures) -> list:
    """The calls in turn, each in its own episode (task id = its index), counted from scratch in ``scope``;
    a RewardFunctionError is returned in the place of its call's reward."""
    wrapper.failures = RewardFailures(wrapper.name, TIMEOUT_S, **failures)

    async def main():
        out = []
        with stats_tracker.scope(scope):
            for i, row in enumerate(rows):
                with workflow_context.use(workflow_context.WorkflowContext(task_id=i)):
                    try:
                        out.append(await wrapper(PROMPT, "42", [1, 2], [3], **row))
                    except RewardFunctionError as e:
                        out.append(e)
        return out

    return asyncio.run(main())


def test_an_outcome_and_feedback_come_back_from_the_worker(wrapper):
    """A ``ScoredReward`` keeps its outcome and feedback through the worker process and the wrapper."""
    (reward,) = _run(wrapper, [{"do": "feedback"}], "feedback")
    assert (float(reward), reward.outcome, reward.feedback) == (0.0, "incorrect", "it printed 41")


def test_a_function_raising_on_every_call_stops_at_its_first_calls(wrapper):
    """Each of the first 8 calls raises: they score 0 and are counted, the 8th stops the run naming the
    function, the exception with its traceback (the user's frames) and the row."""
    results = _run(wrapper, [{"do": "raise", "answer": "42", "question_id": i} for i in range(FIRST_CALLS)], "broken")
    assert [float(r) for r in results[:-1]] == [0.0] * (FIRST_CALLS - 1)
    assert isinstance(results[-1], RewardFunctionError), results
    text = str(results[-1])
    assert f"reward function {__name__}.user_reward failed on each of its first {FIRST_CALLS} calls" in text, text
    assert "Traceback (most recent call last)" in text and "in _lookup" in text and "KeyError: 'expected'" in text
    assert "in call_reward" not in text, "the worker's own frame is not the user's concern"
    assert f"task {FIRST_CALLS - 1}; row {{do='raise', answer='42', question_id={FIRST_CALLS - 1}}}" in text, text
    assert "What is 17 + 25? Reply with digits only." in text, text
    stats = stats_tracker.export(local=True)
    assert stats["broken/reward/error"] == FIRST_CALLS - 1 and stats["broken/reward/n_calls"] == FIRST_CALLS - 1


def test_a_value_that_is_not_a_finite_number_stops_at_once(wrapper):
    """None, text (even "1.0"), inf, NaN, a list: each is refused at its first call, naming it and the row;
    an int and a bool are rewards."""
    rows = [{"do": do, "answer": "42"} for do in ("one", "none", "text", "inf", "nan", "list", "true")]
    results = _run(wrapper, rows, "values")
    assert float(results[0]) == 1.0 and float(results[-1]) == 1.0
    shown = ["None (NoneType)", "'1.0' (str)", "inf (float)", "nan (float)", "[1.0] (list)"]
    for task, (error, value) in enumerate(zip(results[1:-1], shown), start=1):
        assert isinstance(error, RewardFunctionError), results
        text = str(error)
        assert f"reward function {__name__}.user_reward returned {value}, not a finite number, on task {task}" in text
        assert "answer='42'" in text and "What is 17 + 25?" in text, text


def test_occasional_failures_and_timeouts_are_counted_and_the_run_goes_on(wrapper):
    """One call in eight raises and one hangs past the timeout: they score 0 and are counted, the others keep
    their reward, and the step's console note says how many failed."""
    rows = [{"do": "raise" if i % 8 == 0 else "one"} for i in range(1, 17)]
    rows[2] = {"do": "hang"}
    results = _run(wrapper, rows, "occasional", error_window=8)
    assert not any(isinstance(r, Exception) for r in results), results
    assert [r.outcome for r in results].count("timeout") == 1 and float(results[2]) == 0.0
    assert [float(r) for r in results] == [0.0 if row["do"] != "one" else 1.0 for row in rows]
    stats = stats_tracker.export(local=True)
    assert stats["occasional/reward/error"] == 2 and stats["occasional/reward/timeout"] == 1
    assert stats["occasional/reward/n_calls"] == 16 and stats["occasional/reward/failures"] == 3
    assert reward_failures_note(stats, "occasional") == "2 errors, 1 timeout in 16 calls"


def test_too_many_failures_in_the_window_stop_the_run(wrapper):
    """One call in four raises, but reward.max_error_fraction=0.2 over a window of 10: the third failure
    within the last 10 calls stops the run, naming the fraction and the last exception."""
    rows = [{"do": "raise" if i % 4 == 0 else "one", "i": i} for i in range(1, 20)]
    results = _run(wrapper, rows, "fraction", max_error_fraction=0.2, error_window=10)
    stop = next(i for i, r in enumerate(results) if isinstance(r, Exception))
    assert stop == 11, results  # calls 4 and 8 failed, 12 is the third within the last 10
    text = str(results[stop])
    assert "failed on 3 of its last 10 calls (more than reward.max_error_fraction=0.2" in text, text
    assert "KeyError: 'expected'" in text and "i=12" in text, text


def test_the_rules_without_processes():
    """Successes reset nothing but the first-calls rule; a window of one failure in two never stops at 0.5."""
    failures = RewardFailures("m.f", 15.0, max_error_fraction=0.5, error_window=4)
    from megarl.reward.base import ScoredReward
    from megarl.reward.failures import RewardFailure

    ok, bad = ScoredReward(1.0, "ok"), RewardFailure("raised", "Traceback ...\nValueError: x")
    for result in [bad, ok, bad, ok, bad, ok, bad]:  # 2 of every 4: not more than half
        failures.record(result, "task 0")
    with pytest.raises(RewardFunctionError, match=r"failed on 3 of its last 4 calls"):
        failures.record(bad, "task 1")
    timeout = RewardFailures("m.f", 15.0, error_window=2)
    timeout.record(RewardFailure("timeout"), "task 0")
    with pytest.raises(RewardFunctionError, match=r"first 2 calls; the last, on task 1:\nit ran past reward"):
        timeout.record(RewardFailure("timeout"), "task 1")
