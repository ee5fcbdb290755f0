"""Write GSM8K in verl's RL parquet layout: ``python examples/verl_parquet/make_parquet.py OUT_DIR``.

The rows are those verl's ``examples/data_preprocess/gsm8k.py`` writes (the same prompt suffix,
``reward_model.ground_truth`` the number after ``####``, the raw row in ``extra_info``), made
from the GSM8K copy bundled with megarl (MIT, ``megarl/data/gsm8k/LICENSE``) with pyarrow
alone. ``data/`` beside this file holds the first rows of each split, written by this script.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

GSM8K = Path(__file__).resolve().parents[2] / "megarl" / "data" / "gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's


def verl_row(raw: dict, split: str, index: int) -> dict:
    """A GSM8K ``{question, answer}`` row as verl's preprocessing writes it."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": raw["question"] + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": raw["answer"].rsplit("####", 1)[1].strip().replace(",", "")},
        "extra_info": {"split": split, "index": index, "answer": raw["answer"], "question": raw["question"]},
    }


def write_split(out_dir: Path, split: str, n_rows: int) -> Path:
    """``out_dir/{split}.parquet`` holding the first ``n_rows`` rows of the bundled GSM8K ``split``."""
    with open(GSM8K / f"{split}.jsonl", encoding="utf-8") as f:
        raws = [json.loads(line) for _, line in zip(range(n_rows), f)]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{split}.parquet"
    pq.write_table(pa.Table.from_pylist([verl_row(raw, split, i) for i, raw in enumerate(raws)]), path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--train-rows", type=int, default=64)
    parser.add_argument("--test-rows", type=int, default=16)
    args = parser.parse_args()
    for split, n in (("train", args.train_rows), ("test", args.test_rows)):
        print(write_split(args.out_dir, split, n))


if __name__ == "__main__":
    main()
