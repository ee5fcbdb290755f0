"""A row adapter: verl's RL parquet rows read as megarl rows, one file named by one config key.

verl's data preprocessing scripts (its ``examples/data_preprocess/gsm8k.py`` and siblings) write
parquet rows of this layout::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "Natalia sold clips ... after \\"####\\"."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, "answer": "...#### 72", "question": "Natalia sold ..."}}

megarl's workflows read a chat (``messages``) and the reference ``answer``; every other key of
what the adapter returns reaches the reward function as a keyword argument. Point a config at
the files and this function::

    train_dataset:
      path: examples/verl_parquet/data      # {split}.parquet: train.parquet, test.parquet
      type: examples/verl_parquet/verl_rows.py:to_row

megarl checks every row the adapter returns (a non-empty chat of known roles, a non-empty
answer) and names the file and row of one that is not; ``train_dataset.bad_rows: skip`` drops
such rows instead and counts them.
"""

from __future__ import annotations


def to_row(row: dict) -> dict:
    """One verl row -> ``{"messages", "answer", "data_source", "ability", "extra_info"}``."""
    return {
        "messages": row["prompt"],
        "answer": row["reward_model"]["ground_truth"],
        "data_source": row.get("data_source"),
        "ability": row.get("ability"),
        "extra_info": row.get("extra_info"),
    }
