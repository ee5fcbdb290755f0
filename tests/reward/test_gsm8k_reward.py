"""GSM8K / math answer extraction and equivalence on tricky answer strings."""

from __future__ import annotations

import asyncio
import concurrent.futures
import pickle
import threading
import time

import pytest

from megarl.reward import AsyncRewardWrapper, ScoredReward, extract_answer, gsm8k_reward_fn, math_equal, math_reward
from megarl.utils import stats_tracker

GSM8K_REF = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)

# (completion, reference, expected reward)
CASES = [
    ("The answer is \\boxed{72}.", GSM8K_REF, 1.0),
    ("\\boxed{72}", GSM8K_REF, 1.0),
    ("She sold 72 clips in total.", GSM8K_REF, 1.0),
    ("#### 72", GSM8K_REF, 1.0),
    ("So 48 + 24 = 72. The answer is 72 clips.", GSM8K_REF, 1.0),
    ("The answer is 71.", GSM8K_REF, 0.0),
    ("\\boxed{72} wait, no: \\boxed{73}", GSM8K_REF, 0.0),  # the last box counts
    ("First \\boxed{70}, then corrected: \\boxed{72}", GSM8K_REF, 1.0),
    ("The total is $1,000.", "#### 1000", 1.0),
    ("The total is 1,000 dollars", "#### 1,000", 1.0),
    ("\\boxed{\\$1,000.00}", "#### 1000", 1.0),
    ("It costs $18.00", "#### 18", 1.0),
    ("It costs \\$18", "#### 18", 1.0),
    ("\\boxed{\\text{18 dollars}}", "#### 18", 1.0),
    ("The answer is **18**.", "#### 18", 1.0),
    ("The answer: 3.50", "#### 3.5", 1.0),
    ("\\boxed{3.5}", "#### 7/2", 1.0),
    ("\\boxed{\\frac{3}{4}}", "#### 0.75", 1.0),
    ("\\boxed{\\dfrac{7}{2}}", "#### 3.5", 1.0),
    ("The fraction is 3/4", "#### 0.75", 1.0),
    ("\\boxed{-\\frac{1}{2}}", "#### -0.5", 1.0),
    ("The temperature dropped to -5 degrees.", "#### -5", 1.0),
    ("The balance is \u22127.", "#### -7", 1.0),  # unicode minus
    ("\\boxed{-5}", "#### 5", 0.0),  # sign matters
    ("5 - 3 = 2", "#### 2", 1.0),  # binary minus is not a sign
    ("The discount is 25%.", "#### 25", 1.0),
    ("\\boxed{25\\%}", "#### 25", 1.0),
    ("The angle is \\boxed{90^\\circ}", "#### 90", 1.0),
    ("The population grew to 2,000,000 people.", "#### 2000000", 1.0),
    ("That is .5 of the cake", "#### 0.5", 1.0),
    ("Result: 18.0", "#### 18", 1.0),
    ("0 apples are left, so the answer is 0", "#### 0", 1.0),
    ("The answer is -0", "#### 0", 1.0),
    ("\\boxed{0.333}", "#### 1/3", 0.0),  # an approximation is not equal
    ("I do not know the answer.", GSM8K_REF, 0.0),  # no number at all
    ("", GSM8K_REF, 0.0),
    ("\\boxed{", GSM8K_REF, 0.0),  # unbalanced box: the model stopped mid-answer
    ("The answer is twelve.", "#### 12", 0.0),  # words are not parsed
    ("\\boxed{x = 5}", "#### 5", 1.0),
    ("\\boxed{\\sqrt{4}}", "#### 2", 1.0),
    ("She earns 12 per hour for 5 hours, 12*5 = 60.\n#### 60", "#### 60", 1.0),
    ("The values are 1, 2, 3", "#### 3", 1.0),  # a list is not a thousands group
    ("Total: 1,234.5 km", "#### 1234.5", 1.0),
    ("The answer is 42. I double-checked with 7 steps.", "#### 42", 1.0),  # "answer is" beats last number
    ("\\boxed{72}", "no reference answer here", 0.0),
]


def test_at_least_forty_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize(("completion", "reference", "expected"), CASES)
def test_gsm8k_reward(completion, reference, expected):
    reward = gsm8k_reward_fn("prompt", completion, [1], [2], answer=reference)
    assert float(reward) == expected, (completion, reference, reward)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        (GSM8K_REF, "72"),
        ("#### 1,234", "1234"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("the answer is $5.", "5"),
        ("no digits", None),
        ("\\boxed{-3}", "-3"),
        ("5-3", "3"),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_outcomes_name_parse_failures():
    assert math_reward("no number", "#### 3").outcome == "no_answer"
    assert math_reward("3", "nothing").outcome == "bad_reference"
    assert math_reward("3", "#### 3").outcome == "correct"
    assert math_reward("4", "#### 3").outcome == "incorrect"
    assert math_reward(None, "#### 3").outcome in ("no_answer", "error")  # type: ignore[arg-type]


def test_scored_reward_is_a_float_and_pickles():
    r = ScoredReward(1.0, "correct")
    assert r == 1.0 and isinstance(r, float)
    back = pickle.loads(pickle.dumps(r))
    assert back == 1.0 and back.outcome == "correct"


def test_math_equal_off_main_thread():
    """math-verify's signal timeouts fail off the main thread; ours must not."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(ok=math_equal("\\frac{1}{2}", "0.5")))
    thread.start()
    thread.join(60)
    assert out == {"ok": True}


def _slow_reward(*args, **kwargs):
    import time

    time.sleep(30)
    return 1.0


def _raising_reward(*args, **kwargs):
    raise RuntimeError("boom")


def test_async_reward_wrapper_counts_and_never_raises():
    async def main():
        good = AsyncRewardWrapper(gsm8k_reward_fn, timeout_seconds=60, max_workers=1)
        slow = AsyncRewardWrapper(_slow_reward, timeout_seconds=0.5, max_workers=1)
        bad = AsyncRewardWrapper(_raising_reward, timeout_seconds=60, max_workers=1)
        try:
            with stats_tracker.scope("test_reward"):
                results = await asyncio.gather(
                    good("p", "\\boxed{72}", [], [], answer=GSM8K_REF),
                    good("p", "no idea", [], [], answer=GSM8K_REF),
                    slow("p", "c", [], []),
                    bad("p", "c", [], []),
                )
        finally:
            for w in (good, bad):
                w.close()
            slow._replace_executor(slow._get_executor())
        return results

    results = asyncio.run(main())
    assert [float(r) for r in results] == [1.0, 0.0, 0.0, 0.0]
    assert [r.outcome for r in results] == ["correct", "no_answer", "timeout", "error"]
    stats = stats_tracker.export(local=True)
    assert stats["test_reward/reward/n_calls"] == 4
    assert stats["test_reward/reward/failures"] == 3
    assert stats["test_reward/reward/timeout"] == 1


def _quick_reward(*args, **kwargs):
    return 1.0


def test_cold_worker_start_does_not_count_against_the_timeout():
    """Spawned workers import torch and megarl (seconds); the 0.5 s bound applies to the call alone."""

    async def main():
        wrapper = AsyncRewardWrapper(_quick_reward, timeout_seconds=0.5, max_workers=1)
        try:
            return await wrapper("p", "c", [], [])
        finally:
            wrapper.close()

    result = asyncio.run(main())
    assert result.outcome == "ok" and float(result) == 1.0


def test_warm_up_starts_every_worker_before_the_first_call():
    import psutil

    def spawned_children() -> set[int]:
        return {p.pid for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())}

    before = spawned_children()  # another test's spawned process may still be ending
    wrapper = AsyncRewardWrapper(gsm8k_reward_fn, timeout_seconds=60, max_workers=2)
    try:
        imports = wrapper.warm_up()
        # spawned now, not at the first call; a child shows spawn_main once it has exec'd
        deadline = time.monotonic() + 30
        while len(workers := spawned_children() - before) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(workers) == 2
        concurrent.futures.wait(imports, timeout=120)  # both import torch and megarl before any reward
        assert all(f.done() and f.exception() is None for f in imports), imports
        result = asyncio.run(wrapper("p", "\\boxed{72}", [], [], answer=GSM8K_REF))
        assert result.outcome == "correct"
        spawned = spawned_children() - before
        assert spawned == workers, "the first call ran in the warmed workers, none started for it"
    finally:
        wrapper.close()


def test_the_areal_notebooks_reward_cell_runs_unchanged():
    """The multi-turn notebook's reward (its cell, with areal -> megarl): AReaL's arguments are accepted, so its
    bare ``except`` does not turn every answer into 0.0."""
    from megarl.reward.math_parser import extract_answer, math_equal

    def reward_fn(generated, answer):
        try:
            x = extract_answer(generated, "math", use_last_number=True)
            y = extract_answer(answer, "math", use_last_number=True)

            if x is None or x.strip() in ["None", "none", ""]:
                return 0.0
            elif y is None or y.strip() in ["None", "none", ""]:
                return 0.0
            return float(math_equal(x, y, timeout=False))
        except:  # noqa: E722 (the notebook's)
            return 0.0

    gsm8k = (
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips in all.\n#### 72"
    )
    assert reward_fn("\\boxed{72}", gsm8k) == 1.0 and reward_fn("\\boxed{71}", gsm8k) == 0.0
    assert reward_fn("so it is 72", gsm8k) == 1.0
    assert extract_answer("so it is 72", use_last_number=False) is None
    assert math_equal("\\frac{1}{2}", "0.5", timeout=False)
