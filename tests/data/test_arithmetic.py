"""Arithmetic problems: seeded split, disjoint splits, correct answers, the bundled copy loads."""

from __future__ import annotations

import json
import operator
import re

import pytest

from megarl.data import load_rl_dataset
from megarl.data.arithmetic import PROMPT, ArithmeticSpec, Problem, all_problems, split_problems, write_splits
from megarl.data.rl_dataset import SHORT_NAMES

PY_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
QUESTION_RE = re.compile(r"^Calculate (\d+) ([-+*]) (\d+)\. Reply with only the final number\.$")


def key(row: dict) -> tuple:
    return row["a"], row["op"], row["b"]


def test_problem_space_of_the_default_spec():
    problems = all_problems(ArithmeticSpec())
    assert len(problems) == 100 + 55 + 100  # + and * over 0..9 squared; - with a >= b
    assert len(set(problems)) == len(problems)
    assert all(p.answer >= 0 for p in problems)


def test_allow_negative_adds_the_subtractions_below_zero():
    spec = ArithmeticSpec(ops=("-",), min_operand=1, max_operand=3, allow_negative=True)
    assert sorted(p.answer for p in all_problems(spec)) == [-2, -1, -1, 0, 0, 0, 1, 1, 2]


@pytest.mark.parametrize("kwargs", [{"ops": ("/",)}, {"ops": ()}, {"min_operand": 5, "max_operand": 4}])
def test_bad_spec_raises(kwargs):
    with pytest.raises(ValueError, match="ArithmeticSpec"):
        ArithmeticSpec(**kwargs)


def test_split_is_deterministic_per_seed():
    spec = ArithmeticSpec()
    assert split_problems(spec, seed=3, test_size=20) == split_problems(spec, seed=3, test_size=20)
    assert split_problems(spec, seed=3, test_size=20) != split_problems(spec, seed=4, test_size=20)


def test_split_is_disjoint_and_covers_every_problem():
    spec = ArithmeticSpec()
    splits = split_problems(spec, seed=0, test_size=64)
    assert len(splits["test"]) == 64
    assert not set(splits["train"]) & set(splits["test"])
    assert sorted(splits["train"] + splits["test"], key=str) == sorted(all_problems(spec), key=str)


@pytest.mark.parametrize("test_size", [0, 255, 300])
def test_split_rejects_test_size_outside_the_space(test_size):
    with pytest.raises(ValueError, match="test_size"):
        split_problems(ArithmeticSpec(), seed=0, test_size=test_size)


def test_row_states_the_problem_and_its_answer():
    row = Problem(7, "*", 8).row()
    assert row == {
        "messages": [{"role": "user", "content": PROMPT.format(a=7, op="*", b=8)}],
        "answer": "56",
        "a": 7,
        "op": "*",
        "b": 8,
    }


def test_write_splits_writes_jsonl_that_loads_as_chat(tmp_path):
    paths = write_splits(tmp_path, ArithmeticSpec(max_operand=4), seed=1, test_size=10)
    assert set(paths) == {"train", "test"}
    lines = paths["test"].read_text().splitlines()
    assert len(lines) == 10 and all(json.loads(line)["answer"] for line in lines)
    train = load_rl_dataset(str(tmp_path), "train", type="chat")
    assert len(train) == len(all_problems(ArithmeticSpec(max_operand=4))) - 10


@pytest.fixture(scope="module")
def bundled():
    return {split: [dict(r) for r in load_rl_dataset("arithmetic", split, type="chat")] for split in ("train", "test")}


def test_bundled_copy_is_the_seed_0_split(bundled):
    expected = split_problems(ArithmeticSpec(), seed=0, test_size=64)
    for split in ("train", "test"):
        assert [key(r) for r in bundled[split]] == [(p.a, p.op, p.b) for p in expected[split]]
    assert (SHORT_NAMES["arithmetic"] / "README.md").is_file()


def test_bundled_splits_are_disjoint(bundled):
    assert len(bundled["train"]) == 191 and len(bundled["test"]) == 64
    train = {key(r) for r in bundled["train"]}
    assert len(train) == 191 and not train & {key(r) for r in bundled["test"]}


def test_bundled_answers_are_correct(bundled):
    for row in bundled["train"] + bundled["test"]:
        (message,) = row["messages"]
        assert message["role"] == "user"
        a, op, b = QUESTION_RE.match(message["content"]).groups()
        assert (int(a), op, int(b)) == key(row)
        assert row["answer"] == str(PY_OPS[op](int(a), int(b)))
