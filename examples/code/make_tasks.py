"""Write small programming tasks with standard-input tests: the rows ``megarl.reward.coding`` scores.

    python examples/code/make_tasks.py examples/code/data

Each row is a chat asking for a Python program, the ``tests`` its program must pass
(``{"inputs": [...], "outputs": [...]}``: APPS's layout) and, as ``answer``, a reference program that passes
them (the config check's stand-in completion; tests/reward/test_code_reward.py checks every row's).
Tasks are one-liners over one line of input (two integers, one integer, a word), each with its own
constant, so a small model can learn them on a CPU; real training sets (APPS, TACO, DeepCoder,
LiveCodeBench) have the same columns after a row adapter.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

INSTRUCTION = "Write a Python program that {task}. Reply with only the program in a ```python code block."

# (what to do, reference program with {k}, the same as a function of the input line, input maker)
TASKS: list[tuple[str, str, Callable[[str, int], str], str]] = [
    (
        "reads two integers a and b from one line of standard input and prints a + b + {k}",
        "a, b = map(int, input().split())\nprint(a + b + {k})",
        lambda line, k: str(sum(map(int, line.split())) + k),
        "pair",
    ),
    (
        "reads two integers a and b from one line of standard input and prints a * b - {k}",
        "a, b = map(int, input().split())\nprint(a * b - {k})",
        lambda line, k: str(int(line.split()[0]) * int(line.split()[1]) - k),
        "pair",
    ),
    (
        "reads an integer n from standard input and prints n * {k}",
        "n = int(input())\nprint(n * {k})",
        lambda line, k: str(int(line) * k),
        "one",
    ),
    (
        "reads an integer n from standard input and prints the numbers from {k} to n + {k}, separated by spaces",
        "n = int(input())\nprint(*range({k}, n + {k} + 1))",
        lambda line, k: " ".join(map(str, range(k, int(line) + k + 1))),
        "one",
    ),
    (
        "reads a word from standard input and prints it {k} times, separated by spaces",
        "w = input().strip()\nprint(' '.join([w] * {k}))",
        lambda line, k: " ".join([line.strip()] * k),
        "word",
    ),
    (
        "reads a word from standard input and prints its first {k} letters reversed",
        "w = input().strip()\nprint(w[:{k}][::-1])",
        lambda line, k: line.strip()[:k][::-1],
        "word",
    ),
]

WORDS = ["apple", "river", "megatron", "orange", "kernel", "python", "tensor", "rollout", "gradient", "sky"]


def make_input(kind: str, rng: random.Random) -> str:
    if kind == "pair":
        return f"{rng.randint(-50, 50)} {rng.randint(-50, 50)}"
    if kind == "one":
        return str(rng.randint(1, 12))
    return rng.choice(WORDS)


def make_row(task: int, k: int, rng: random.Random, n_tests: int = 4) -> dict:
    what, program, expect, kind = TASKS[task]
    inputs = [make_input(kind, rng) for _ in range(n_tests)]
    return {
        "messages": [{"role": "user", "content": INSTRUCTION.format(task=what.format(k=k))}],
        "answer": f"```python\n{program.format(k=k)}\n```",
        "tests": {"inputs": [line + "\n" for line in inputs], "outputs": [expect(line, k) + "\n" for line in inputs]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = [make_row(task, k, rng) for task in range(len(TASKS)) for k in range(2, 12)]
    rng.shuffle(rows)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    splits = {"train": rows[:48], "test": rows[48:]}
    for split, part in splits.items():
        with open(args.out_dir / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in part)
    print(f"wrote {', '.join(f'{len(p)} {s}' for s, p in splits.items())} rows to {args.out_dir}")


if __name__ == "__main__":
    main()
