"""Small-number arithmetic prompts: a verifiable task a 135M model starts at ~25-30% reward on.

Every problem is ``a op b`` with ``op`` in ``+ - *`` and single-digit operands;
subtraction keeps ``a >= b`` (SmolLM2-135M-Instruct scores ~0 on negative results). The
whole problem space (255 problems for operands 0..9) is enumerated, shuffled with a seed
and split: the first ``test_size`` problems are the test split, the rest the train
split, so the two are disjoint and each holds every problem at most once.

The prompt asks for the bare number (:data:`PROMPT`). Zero-shot, the model mostly
rambles; when it does state ``a op b = c`` it is usually right, so the reward
(:func:`megarl.reward.arithmetic.arithmetic_reward_fn`, the last number of the
completion) has room to grow by learning the answer format. The measured starting
reward is in ``benchmarks/results/arithmetic_baseline.json``.

Regenerate the bundled copy (``megarl/data/arithmetic/``)::

    python -m megarl.data.arithmetic --out megarl/data/arithmetic --seed 0 --test-size 64
"""

from __future__ import annotations

import argparse
import json
import logging
import operator
import random
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

OPS: Mapping[str, Callable[[int, int], int]] = types.MappingProxyType(
    {"+": operator.add, "-": operator.sub, "*": operator.mul}
)
PROMPT = "Calculate {a} {op} {b}. Reply with only the final number."
"""The user message; the chat template (system prompt included) is applied by the workflow."""


@dataclass(frozen=True)
class ArithmeticSpec:
    """Which problems exist: the operators and the operand range."""

    ops: tuple[str, ...] = ("+", "-", "*")
    """Operators, a subset of :data:`OPS`."""
    min_operand: int = 0
    """Smallest operand (inclusive)."""
    max_operand: int = 9
    """Largest operand (inclusive)."""
    allow_negative: bool = False
    """Keep subtractions with ``a < b`` (negative answers); off, only ``a >= b``."""

    def __post_init__(self):
        unknown = [op for op in self.ops if op not in OPS]
        if unknown or not self.ops:
            raise ValueError(f"ArithmeticSpec.ops={self.ops!r}: each must be one of {sorted(OPS)}")
        if self.min_operand > self.max_operand:
            raise ValueError(f"ArithmeticSpec.min_operand={self.min_operand} > max_operand={self.max_operand}")


@dataclass(frozen=True)
class Problem:
    """One problem ``a op b``; :attr:`answer` is its exact integer result."""

    a: int
    op: str
    b: int

    @property
    def answer(self) -> int:
        return OPS[self.op](self.a, self.b)

    def row(self) -> dict:
        """The dataset row (type ``chat``): the user message, the answer as a string, the operands."""
        content = PROMPT.format(a=self.a, op=self.op, b=self.b)
        return {
            "messages": [{"role": "user", "content": content}],
            "answer": str(self.answer),
            "a": self.a,
            "op": self.op,
            "b": self.b,
        }


def all_problems(spec: ArithmeticSpec) -> list[Problem]:
    """Every problem of ``spec``, in a fixed order (op, then a, then b)."""
    operands = range(spec.min_operand, spec.max_operand + 1)
    return [
        Problem(a, op, b)
        for op in spec.ops
        for a in operands
        for b in operands
        if op != "-" or spec.allow_negative or a >= b
    ]


def split_problems(spec: ArithmeticSpec, seed: int, test_size: int) -> dict[str, list[Problem]]:
    """``{"train", "test"}``: the problems of ``spec`` shuffled by ``seed``, the first
    ``test_size`` for test and the rest for train (disjoint, no repeats)."""
    problems = all_problems(spec)
    if not 0 < test_size < len(problems):
        raise ValueError(f"test_size={test_size} must be in (0, {len(problems)}) for {spec}")
    random.Random(seed).shuffle(problems)
    return {"train": problems[test_size:], "test": problems[:test_size]}


def write_splits(out_dir: str | Path, spec: ArithmeticSpec, seed: int, test_size: int) -> dict[str, Path]:
    """Write ``{split}.jsonl`` (one row per line) to ``out_dir``; returns the paths by split."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, problems in split_problems(spec, seed, test_size).items():
        paths[split] = out / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(p.row()) + "\n" for p in problems))
        logger.info("%s: %d problems", paths[split], len(problems))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write train.jsonl / test.jsonl of arithmetic problems")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test-size", type=int, default=64)
    parser.add_argument("--ops", default="+-*", help="operators, e.g. '+-*'")
    parser.add_argument("--min-operand", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=9)
    parser.add_argument("--allow-negative", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = ArithmeticSpec(tuple(args.ops), args.min_operand, args.max_operand, args.allow_negative)
    write_splits(args.out, spec, args.seed, args.test_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
