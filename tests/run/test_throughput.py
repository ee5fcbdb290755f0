"""megarl.run.throughput: the train phase's tokens/s, TFLOP/s and MFU in a step's stats."""

import types

import pytest
import torch
from transformers import Qwen2Config

from megarl.models.flops import MatmulShape, train_flops
from megarl.run.throughput import record_train_throughput
from megarl.utils import stats_tracker

CONFIG = Qwen2Config(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=500,
)


def _actor(tp=1, pp=1, cp=1):
    alloc = types.SimpleNamespace(tp=tp, pp=pp, cp=cp)
    return types.SimpleNamespace(
        parallel=types.SimpleNamespace(alloc=alloc), desc=types.SimpleNamespace(hf_config=CONFIG)
    )


def _batch(lengths, width=12):
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, :n] = True
    return {"attention_mask": mask}


@pytest.fixture(autouse=True)
def _fresh_tracker():
    stats_tracker.export(reset=True)
    yield
    stats_tracker.export(reset=True)


def test_tokens_per_second_per_rank_count_every_epoch_and_share_a_heads_tokens():
    stats = record_train_throughput(_actor(), _batch([10, 6]), seconds=2.0, epochs=2, device="cpu")
    assert stats["train_tokens_per_s"] == pytest.approx(16 * 2 / 2.0)
    exported = stats_tracker.export()
    assert exported["perf/train_tokens_per_s"] == pytest.approx(16.0)
    assert "perf/mfu" not in exported  # no peak on a CPU
    # a head of tp 2 x pp 2: each of its 4 ranks does a quarter of the work
    split = record_train_throughput(_actor(tp=2, pp=2), _batch([10, 6]), seconds=2.0, epochs=2, device="cpu")
    assert split["train_tokens_per_s"] == pytest.approx(4.0)
    flops = train_flops(MatmulShape.from_hf_config(CONFIG), [10, 6])
    assert split["train_tflops"] == pytest.approx(flops * 2 / 2.0 / 4 / 1e12)


def test_mfu_on_a_gpu_with_a_known_peak_in_both_conventions(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    stats = record_train_throughput(_actor(), _batch([12, 12]), seconds=1e-6, epochs=1, device="cuda")
    shape = MatmulShape.from_hf_config(CONFIG)
    assert stats["mfu"] == pytest.approx(train_flops(shape, [12, 12]) / 1e-6 / 989e12)
    assert stats["mfu_megatron"] == pytest.approx(train_flops(shape, [12, 12], "megatron") / 1e-6 / 989e12)
    assert stats["mfu_megatron"] > stats["mfu"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert "mfu" not in record_train_throughput(_actor(), _batch([12]), seconds=1.0, epochs=1, device="cuda")
