"""A dataset row adapter (issue 36 item 3): one user file, named by ``train_dataset.type``.

verl's RL parquet layout, written as verl's GSM8K preprocessing writes it
(``examples/verl_parquet/make_parquet.py``), loads through the bundled example adapter into megarl
rows, the dataloader and the reward; an adapter's output is checked row by row (file and row
named); the config check finds the adapter beside its config file and refuses one that is
missing, takes no row, or maps the first rows to nothing megarl can read.
"""

from __future__ import annotations

import logging
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from examples.verl_parquet.make_parquet import INSTRUCTION, write_split
from megarl.config import GRPOConfig
from megarl.config.base import ConfigError
from megarl.config.run import DATASET_TYPES
from megarl.data import DatasetRowError, create_dataloader, load_rl_dataset
from megarl.data.rows import ROW_MAPPERS
from megarl.reward.gsm8k import gsm8k_reward_fn
from megarl.run.prelaunch import build_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "verl_parquet"
VERL_ADAPTER = f"{EXAMPLE / 'verl_rows.py'}:to_row"
BASE = str(ROOT / "configs" / "arithmetic_grpo_cpu.yaml")


@pytest.fixture
def user_modules(monkeypatch):
    """Forget the user modules a test imports (adapters written under the same name)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def write_adapter(folder: Path, body: str, name: str = "my_rows") -> str:
    (folder / f"{name}.py").write_text(textwrap.dedent(body))
    return f"{folder / name}.py:to_row"


def test_verl_parquet_rows_reach_the_dataloader_and_the_reward(tmp_path):
    write_split(tmp_path, "train", 8)
    dataset = load_rl_dataset(str(tmp_path), "train", type=VERL_ADAPTER)
    assert len(dataset) == 8
    row = dataset[0]
    assert set(row) == {"messages", "answer", "data_source", "ability", "extra_info"}
    (message,) = row["messages"]
    assert message["role"] == "user" and message["content"].startswith("Natalia sold clips")
    assert message["content"].endswith(INSTRUCTION)
    assert row["answer"] == "72" and row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["extra_info"]["index"] == 0 and row["extra_info"]["answer"].endswith("#### 72")
    batch = next(iter(create_dataloader(dataset, batch_size=4, shuffle=False)))
    assert [r["answer"] for r in batch] == list(dataset["answer"][:4])
    # the workflow calls the reward with the row as keywords: the reference answer arrives
    assert gsm8k_reward_fn("p", "so she sold 72 clips. #### 72", [], [], **batch[0]) == 1.0
    assert gsm8k_reward_fn("p", "#### 71", [], [], **batch[0]) == 0.0


def test_the_bundled_example_files_load_and_split_by_rank():
    train = load_rl_dataset(str(EXAMPLE / "data"), "train", type=VERL_ADAPTER)
    test = load_rl_dataset(str(EXAMPLE / "data"), "test", type=VERL_ADAPTER)
    assert (len(train), len(test)) == (64, 16)
    halves = [load_rl_dataset(str(EXAMPLE / "data"), "test", type=VERL_ADAPTER, rank=r, world_size=2) for r in (0, 1)]
    assert list(halves[0]["answer"]) + list(halves[1]["answer"]) == list(test["answer"])


# adapter body -> what the error says about row 1 (row 0 is good in every case)
BAD_ADAPTERS = {
    "no-answer": (
        "def to_row(row):\n    return {'messages': row['m']} if row['i'] == 1 else {'messages': row['m'], 'answer': '1'}\n",
        "row 1 has no 'answer' field",
    ),
    "messages-a-string": (
        "def to_row(row):\n    return {'messages': 'hi' if row['i'] == 1 else row['m'], 'answer': '1'}\n",
        "row 1: 'messages' must be a non-empty list",
    ),
    "unknown-role": (
        "def to_row(row):\n    return {'messages': [{'role': 'bot' if row['i'] == 1 else 'user', 'content': 'q'}], 'answer': 1}\n",
        "row 1: message 0 has role 'bot'",
    ),
    "raises": (
        "def to_row(row):\n    return {'messages': row['m'], 'answer': {0: 'a', 2: 'c'}[row['i']]}\n",
        "row 1: row adapter {adapter} raised KeyError: 1",
    ),
    "returns-none": (
        "def to_row(row):\n    return None if row['i'] == 1 else {'messages': row['m'], 'answer': '1'}\n",
        "row 1: row adapter {adapter} returned NoneType None, expected a dict",
    ),
}


def write_rows(tmp_path: Path) -> str:
    chat = [{"role": "user", "content": "1+1?"}]
    pq.write_table(pa.Table.from_pylist([{"i": i, "m": chat} for i in range(3)]), tmp_path / "rows.parquet")
    return str(tmp_path / "rows.parquet")


@pytest.mark.parametrize("kind", list(BAD_ADAPTERS))
def test_an_adapters_bad_output_is_named_by_file_row_and_adapter(tmp_path, user_modules, kind, caplog):
    body, says = BAD_ADAPTERS[kind]
    adapter, path = write_adapter(tmp_path, body, f"rows_{kind.replace('-', '_')}"), write_rows(tmp_path)
    says = says.format(adapter=adapter)
    with pytest.raises(DatasetRowError) as err:
        load_rl_dataset(path, "train", type=adapter)
    assert str(err.value).startswith(f"{path}: ") and says in str(err.value), str(err.value)
    skipped: list[str] = []
    with caplog.at_level(logging.WARNING, logger="megarl.data.rl_dataset"):
        kept = load_rl_dataset(path, "train", type=adapter, bad_rows="skip", skipped=skipped)
    assert len(kept) == 2 and len(skipped) == 1 and says in skipped[0], skipped
    assert f"{path}: skipped 1 bad rows of 3 (bad_rows=skip)" in caplog.text


def test_the_config_check_finds_the_adapter_beside_its_config_and_reads_the_first_rows(
    tmp_path, user_modules, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # a relative adapter path is looked for beside the config file first
    mine = tmp_path / "mine"
    mine.mkdir()
    write_split(mine, "train", 4)
    (mine / "my_verl_rows.py").write_text((EXAMPLE / "verl_rows.py").read_text())
    (mine / "data.yaml").write_text(
        f"train_dataset:\n  path: {mine}\n  type: my_verl_rows.py:to_row\n  batch_size: 2\n"
    )
    config = build_config(GRPOConfig, [BASE, str(mine / "data.yaml")], [])
    assert config.train_dataset.type == f"{mine.resolve() / 'my_verl_rows.py'}:to_row"

    def refused(*overrides: str) -> str:
        with pytest.raises(ConfigError) as err:
            build_config(GRPOConfig, [BASE, str(mine / "data.yaml")], list(overrides))
        return str(err.value)

    assert "'train_dataset.type'" in refused("train_dataset.type=nowhere.py:to_row")
    assert "no such file" in refused("train_dataset.type=nowhere.py:to_row")
    assert "one of ['gsm8k', 'chat'] or a row adapter" in refused("train_dataset.type=verl")
    two_args = write_adapter(mine, "def to_row(row, tokenizer):\n    return row\n", "two_args")
    assert "a row adapter is fn(row: dict) -> dict" in refused(f"train_dataset.type={two_args}")
    as_is = write_adapter(mine, "def to_row(row):\n    return row\n", "as_is")
    message = refused(f"train_dataset.type={as_is}")
    assert "'train_dataset.type'" in message and f"{mine / 'train.parquet'}: row 0 has no 'answer' field" in message


def test_the_configs_built_in_types_are_the_row_mappers():
    assert set(DATASET_TYPES) == set(ROW_MAPPERS)
