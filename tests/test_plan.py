"""The allocation planner: the model's arithmetic on hand-made rates, ranking, rates files, ``megarl plan``."""

import json
import math
from pathlib import Path

import pytest

from megarl.config import AllocationError, AllocationMode, ModelShape
from megarl.launcher.cli import main
from megarl.plan import (
    Rates,
    RatesFileError,
    ServerRate,
    Workload,
    load_rates,
    predict,
    rank_splits,
    rates_to_dict,
)

REPO = Path(__file__).resolve().parents[1]
GPU_RATES = REPO / "benchmarks" / "plan_rates_h100_qwen2.5-7b.yaml"
GPU_CONFIG = REPO / "configs" / "gsm8k_grpo_qwen2.5-7b_128gpu.yaml"
# 2 prompts x 5 samples x (10 prompt + 100 generated) tokens: 1,000 generated, 1,100 trained
WORK = Workload(prompts=2, samples=5, prompt_tokens=10, gen_tokens=100, max_new_tokens=200)
MODEL = ModelShape(num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=4)


def rates(**kw) -> Rates:
    base = {
        "source": "hand-made",
        "server": {1: ServerRate(100.0), 2: ServerRate(150.0, token_latency_s=0.1)},
        "trainer": {(1, 1): 110.0, (1, 2): 200.0},
        "sync_fixed_s": 1.0,
        "sync_bytes_per_s": 1e9,
        "model_bytes": 2e9,
        "overhead_s": 0.5,
        "workload": WORK,
        "model": MODEL,
    }
    return Rates(**{**base, **kw})


def alloc(spec: str) -> AllocationMode:
    return AllocationMode.from_str(spec)


def test_synchronous_step_is_the_sum_of_its_phases():
    p = predict(rates(), WORK, alloc("vllm:d1t1+megatron:d1p1t1"), max_staleness=0)
    # rollout 1000/100 = 10, train 1100/110 = 10, sync 1 + 2e9/1e9 = 3, overhead 0.5
    assert (p.rollout_s, p.train_s, p.sync_s, p.overhead_s) == pytest.approx((10, 10, 3, 0.5))
    assert p.step_s == pytest.approx(23.5)
    assert p.overlap_s == 0 and p.overlap_pct == 0


def test_asynchronous_step_hides_the_shorter_phase():
    work = Workload(2, 5, 10, 50, 200)  # rollout 5 s, train 600/110 s
    p = predict(rates(), work, alloc("vllm:d1t1+megatron:d1p1t1"), max_staleness=1)
    assert p.step_s == pytest.approx(600 / 110 + 3 + 0.5)
    assert p.overlap_pct == pytest.approx(100) and p.bottleneck == "train"
    # a larger bound does not change the steady state
    assert predict(rates(), work, alloc("vllm:d1t1+megatron:d1p1t1"), max_staleness=4).step_s == p.step_s
    # rollout-bound: the training hides behind the rollout instead
    p = predict(rates(), WORK, alloc("vllm:d1t1+megatron:d1p1t2"), max_staleness=1)
    assert p.step_s == pytest.approx(10 + 3 + 0.5) and p.bottleneck == "rollout"
    assert p.overlap_pct == pytest.approx(100 * 5.5 / 10)


def test_colocated_parts_take_turns_whatever_the_staleness():
    p = predict(rates(), WORK, alloc("vllm:d1t1|megatron:d1p1t1"), max_staleness=2)
    assert p.step_s == pytest.approx(23.5) and p.overlap_s == 0


def test_overlap_slowdown_charges_the_overlapped_seconds():
    work = Workload(2, 5, 10, 50, 200)  # rollout 5 s overlaps a 600/110 s training
    p = predict(rates(overlap_slowdown=1.4), work, alloc("vllm:d1t1+megatron:d1p1t1"), max_staleness=1)
    assert p.step_s == pytest.approx(600 / 110 + 0.4 * 5 + 3 + 0.5)
    sync = predict(rates(overlap_slowdown=1.4), work, alloc("vllm:d1t1+megatron:d1p1t1"), max_staleness=0)
    assert sync.step_s == pytest.approx(5 + 600 / 110 + 3 + 0.5)  # nothing overlaps


def test_rollout_bound_by_servers_and_longest_sample_when_synchronous():
    two = predict(rates(), WORK, alloc("vllm:d2t1+megatron:d1p1t1"), 0)
    assert two.rollout_s == pytest.approx(5)  # 1000 / (2 x 100)
    # TP 2: 1000/150 = 6.7 s of throughput, but the longest sample takes 200 x 0.1 = 20 s
    assert predict(rates(), WORK, alloc("vllm:d1t2+megatron:d1p1t1"), 0).rollout_s == pytest.approx(20)
    # an asynchronous pool keeps generating across steps: throughput only
    assert predict(rates(), WORK, alloc("vllm:d1t2+megatron:d1p1t1"), 1).rollout_s == pytest.approx(1000 / 150)


def test_data_parallel_scales_with_efficiency():
    r = rates(dp_efficiency=0.9)
    p = predict(r, WORK, alloc("vllm:d1t1+megatron:d4p1t1"), 0)
    assert p.train_s == pytest.approx(1100 / (110 * 4 * 0.9**2))


def test_missing_rates_name_the_layout_and_what_there_is():
    with pytest.raises(AllocationError, match=r"no server rate for TP 4 .*the rates have TP 1, 2"):
        predict(rates(), WORK, alloc("vllm:d1t4+megatron:d1p1t1"), 0)
    with pytest.raises(AllocationError, match=r"no trainer rate for PP 2 x TP 1 .*p1t1, p1t2"):
        predict(rates(), WORK, alloc("vllm:d1t1+megatron:d1p2t1"), 0)
    with pytest.raises(AllocationError, match=r"no trainer rate for context parallel c2 .*d1p1t1c2"):
        predict(rates(), WORK, alloc("vllm:d1t1+megatron:d1p1t1c2"), 0)  # p1t1 has a rate: c2 does not
    with pytest.raises(ValueError, match="max_staleness must be >= 0, got -1"):
        predict(rates(), WORK, alloc("vllm:d1t1+megatron:d1p1t1"), -1)


def test_rank_splits_orders_by_step_time_and_refuses_invalid_splits():
    plan = rank_splits(rates(), WORK, 4, max_staleness=0, model=MODEL)
    steps = [p.step_s for p in plan.ranked]
    assert steps == sorted(steps) and len(plan.ranked) >= 4
    assert {p.allocation for p in plan.ranked} >= {"vllm:d2t1+megatron:d2p1t1", "vllm:d1t2+megatron:d1p1t2"}
    # 9 heads: TP 2 divides neither the server's nor the trainer's heads
    nine = ModelShape(num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=4)
    plan = rank_splits(rates(), WORK, 4, max_staleness=0, model=nine)
    assert all("t2" not in p.allocation for p in plan.ranked)
    assert any("does not divide the model's 9 attention heads" in why for _, why in plan.refused)


def test_rank_splits_whole_nodes_and_batch():
    plan = rank_splits(rates(), WORK, 16, max_staleness=1, gpus_per_node=8, model=MODEL, batch=(8, 2))
    for p in plan.ranked:
        a = alloc(p.allocation)
        assert a.inference.world_size % 8 == 0 and a.train.world_size % 8 == 0 and 8 % (a.train.dp * 2) == 0
    assert any(
        "train_dataset.batch_size 8 is not divisible by trainer DP 8 x actor.ppo_n_minibatches 2" in why
        for _, why in plan.refused
    )


def test_rank_splits_errors_name_the_numbers():
    with pytest.raises(ValueError, match="n_devices must be >= 2.*got 1"):
        rank_splits(rates(), WORK, 1, 0)
    with pytest.raises(ValueError, match="12 devices are not whole nodes of 8 GPUs"):
        rank_splits(rates(), WORK, 12, 0, gpus_per_node=8)
    only_tp2 = rates(server={2: ServerRate(1.0)}, trainer={(1, 2): 1.0})
    with pytest.raises(ValueError, match=r"no split of 3 devices fits"):
        rank_splits(only_tp2, WORK, 3, 0, model=MODEL)


def test_rates_file_round_trip(tmp_path):
    r = rates(sync_bytes_per_s=math.inf, model_bytes=0.0, overlap_slowdown=1.25)
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(rates_to_dict(r)))
    assert load_rates(path) == r


def test_gpu_rates_are_labelled_assumed():
    r = load_rates(GPU_RATES)
    assert r.source.startswith("ASSUMED") and r.workload.samples == 16
    assert r.sync_bytes_per_s == 5e9  # YAML 1.1 reads 5.0e9 as a string


@pytest.mark.parametrize(
    "text,needle",
    [
        ("server: {t1: 10}\ntrainer: {p1t1: 10}\n", "key 'source' must say where"),
        ("source: x\ntrainer: {p1t1: 10}\n", "key 'server' must be a non-empty mapping"),
        ("source: x\nserver: {tp1: 10}\ntrainer: {p1t1: 10}\n", "key 'server.tp1' is not a layout like 't2'"),
        ("source: x\nserver: {t1: 10}\ntrainer: {d1t1: 10}\n", "key 'trainer.d1t1' is not a layout like 'p2t2'"),
        (
            "source: x\nserver: {t1: {tokens_per_s: -3}}\ntrainer: {p1t1: 10}\n",
            "key 'server.t1.tokens_per_s' must be a number > 0, got -3",
        ),
        ("source: x\nserver: {t1: 10}\ntrainer: {p1t1: fast}\n", "key 'trainer.p1t1' must be a number > 0, got 'fast'"),
        ("source: x\nserver: {t1: 10}\ntrainer: {p1t1: 1}\ndp_efficiency: 1.5\n", "key 'dp_efficiency' must be <= 1"),
        (
            "source: x\nserver: {t1: 10}\ntrainer: {p1t1: 1}\noverlap_slowdown: 0.5\n",
            "key 'overlap_slowdown' must be >= 1, got 0.5",
        ),
        (
            "source: x\nserver: {t1: 10}\ntrainer: {p1t1: 1}\nworkload: {prompts: 1, samples: 1, gen_tokens: 1, x: 2}\n",
            "unknown key 'workload.x'",
        ),
        ("- a\n- b\n", "expected a mapping of keys, got list"),
        ("source: [unclosed\n", "is not YAML or JSON"),
    ],
)
def test_bad_rates_file_names_file_and_key(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(RatesFileError) as err:
        load_rates(path)
    assert str(path) in str(err.value) and needle in str(err.value)


def test_cli_ranks_the_128gpu_config(capsys):
    assert main(["plan", "--rates", str(GPU_RATES), "--config", str(GPU_CONFIG), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "rates: ASSUMED" in out and "256 prompts x 16 samples" in out and "max_staleness 2" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "allocation_mode" not in line]
    assert len(rows) == 3 and all("+megatron:" in row for row in rows)
    assert "t8" not in out.split("| rank")[1]  # TP 8 does not divide Qwen2.5-7B's 4 key/value heads


def test_cli_one_mode_and_flags(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rates_to_dict(rates())))
    argv = ["plan", "--rates", str(path), "--mode", "vllm:d1t1+megatron:d1p1t1", "--max-staleness", "0"]
    assert main(argv) == 0
    assert "| 1 | vllm:d1t1+megatron:d1p1t1 | 10.0 | 10.0 | 3.0 | 23.5 | 0% |" in capsys.readouterr().out
    assert main(["plan", "--rates", str(path), "--devices", "4", "--gen-tokens", "50"]) == 0
    assert "50 generated tokens" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra,needle",
    [
        (
            ["--mode", "vllm:d1t1+megatron:d1p1t3"],
            "megatron tensor parallel t3 does not divide the model's 8 attention heads",
        ),
        (["--mode", "vllm:d1t4+megatron:d1p1t1"], "no server rate for TP 4"),
        ([], "needs --mode ALLOCATION, --devices N or --config FILE"),
    ],
)
def test_cli_errors_exit_2(tmp_path, capsys, extra, needle):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rates_to_dict(rates())))
    assert main(["plan", "--rates", str(path), *extra]) == 2
    assert needle in capsys.readouterr().err


def test_cli_bad_rates_file_names_file_and_key(tmp_path, capsys):
    path = tmp_path / "rates.yaml"
    path.write_text("source: x\nserver: {t1: 10}\ntrainer: {p1t1: 0}\n")
    assert main(["plan", "--rates", str(path), "--devices", "2"]) == 2
    err = capsys.readouterr().err
    assert f"rates file {path}: key 'trainer.p1t1' must be a number > 0, got 0" in err
    assert main(["plan", "--rates", str(tmp_path / "none.yaml"), "--devices", "2"]) == 2
    assert "none.yaml does not exist" in capsys.readouterr().err


def test_calibration_from_metrics():
    """benchmarks/plan.py turns a synchronous run's step metrics into rates, then predicts it back."""
    from benchmarks.plan import _row, calibrate

    step = {
        "batch/n_seqs": 8.0,
        "batch/seq_len/avg": 200.0,
        "ppo_actor/n_tokens": 1024.0,
        "timeperf/rollout": 4.0,
        "timeperf/train_step": 10.0,
        "timeperf/update_weights": 0.5,
        "timeperf/step": 15.0,
    }
    r = calibrate([step, step], "static", "now")
    assert r.server[1].tokens_per_s == pytest.approx(256) and r.trainer[(1, 1)] == pytest.approx(160)
    assert r.sync_fixed_s == pytest.approx(0.5) and r.overhead_s == pytest.approx(0.5)
    assert r.workload == Workload(2, 4, 72.0, 128.0, 128)
    row = _row("static", 0, 2, r, [[step, step], [step]])
    assert row["pred step s"] == pytest.approx(15.0) and row["error %"] == pytest.approx(0)
    assert _row("static", 1, 2, r, [[step]])["pred step s"] == pytest.approx(11.0)


def test_overlap_slowdown_from_an_async_run():
    from benchmarks.plan import overlap_slowdown

    r = rates(server={1: ServerRate(256.0)}, trainer={(1, 1): 160.0})
    # isolated: 1600 tokens train in 10 s, 1024 generate in 4 s; training took 12 s while overlapped
    step = {"batch/n_seqs": 8.0, "batch/seq_len/avg": 200.0, "ppo_actor/n_tokens": 1024.0, "timeperf/train_step": 12.0}
    assert overlap_slowdown(r, [step, step]) == pytest.approx(1.5)
    assert overlap_slowdown(r, [{**step, "timeperf/train_step": 9.0}]) == 1.0  # faster than isolated: no contention


# the bundled GPU configs: (experiment, preset or None) the planner ranks with the H100 rates
RANKED_CONFIGS = [
    ("configs/gsm8k_grpo_qwen2.5-7b_128gpu.yaml", None),
    ("configs/gsm8k_grpo_qwen2.5-7b_128gpu.yaml", "configs/parallel/dense_7b_128gpu.yaml"),
]


@pytest.mark.parametrize("experiment, preset", RANKED_CONFIGS)
def test_bundled_large_scale_config_is_the_planners_first_choice(experiment, preset, capsys):
    import yaml

    files = ["--config", experiment] + (["--config", preset] if preset else [])
    assert main(["plan", "--rates", str(GPU_RATES), *files, "--top", "1"]) == 0
    first = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |"))
    bundled = yaml.safe_load((REPO / (preset or experiment)).read_text())["allocation_mode"]
    assert first.split("|")[2].strip() == bundled, f"{preset or experiment}: {bundled} is not the first choice: {first}"


def test_plan_page_says_why_the_other_gpu_configs_are_not_ranked():
    """Every other bundled GPU config is named on the plan page's 'Not ranked' paragraph."""
    ranked = {path for pair in RANKED_CONFIGS for path in pair if path}
    gpu_configs = sorted(REPO.glob("configs/*gpu.yaml")) + sorted(REPO.glob("configs/parallel/*gpu.yaml"))
    page = (REPO / "docs" / "guides" / "plan.md").read_text()
    not_ranked = page[page.index("Not ranked:") :]
    for path in gpu_configs:
        name = str(path.relative_to(REPO))
        assert name in ranked or f"`{name}`" in not_ranked, f"{name}: neither ranked first nor explained"


def test_adapter_sync_plans_with_the_adapters_bytes(capsys):
    """With ``weight_update.lora=adapter`` an update sends the adapters: the plan sizes the sync from the
    model's config (SmolLM2-135M, rank 16 on the four dense targets: 4,884,480 numbers, bf16)."""
    cpu_rates = REPO / "benchmarks" / "results" / "plan_rates_cpu_static.yaml"
    argv = ["plan", "--rates", str(cpu_rates), "--config", str(REPO / "configs" / "arithmetic_grpo_cpu.yaml")]
    lora = ["actor.lora.rank=16", "actor.dtype=bfloat16", "vllm.dtype=bfloat16"]
    assert main([*argv, *lora, "weight_update.lora=adapter"]) == 0
    assert "weight sync (LoRA adapters of rank 16, 9.8 MB)" in capsys.readouterr().out
    assert main([*argv, *lora]) == 0  # merged: the model, as the rates measured it
    assert "weight sync (the model)" in capsys.readouterr().out


def test_lora_numel_counts_what_the_peft_export_writes(tmp_path):
    from safetensors import safe_open

    from megarl.models.provision import resolve_model_path
    from megarl.plan import lora_numel
    from megarl.run.prelaunch import read_model_config
    from tests.train.test_lora_e2e import MODEL, RANK, nonzero_peft_dir

    peft_dir = nonzero_peft_dir(tmp_path)
    with safe_open(str(peft_dir / "adapter_model.safetensors"), "pt") as f:
        written = sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] for k in f.keys())  # noqa: SIM118
    hf = read_model_config(resolve_model_path(MODEL), "actor.path")
    targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert lora_numel(hf, RANK, targets) == written == 4_884_480
    assert lora_numel(hf, RANK, ["linear_qkv"]) == 30 * RANK * (3 * 576 + 576 + 2 * 192)
    # an adapter per HF module (PEFT's form) writes as many numbers as one adapter per fused linear
    assert (
        lora_numel(hf, RANK, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]) == written
    )
    assert lora_numel(hf, RANK, ["q_proj", "v_proj"]) == 30 * RANK * (2 * 576 + 576 + 192)


def test_routed_experts_bytes_are_in_the_plan(tiny_model_dir):
    """With ``rollout.return_routed_experts`` every token of a rollout batch carries layers x top-k int16 ids:
    the tiny Qwen3-MoE's 4 layers x top-2, over 8 x 8 samples of 100 + 50 tokens, are 153,600 bytes."""
    from types import SimpleNamespace

    from megarl.plan import assumptions, workload_of

    config = SimpleNamespace(
        train_dataset=SimpleNamespace(batch_size=8),
        gconfig=SimpleNamespace(n_samples=8, max_new_tokens=64),
        rollout=SimpleNamespace(return_routed_experts=True),
        actor=SimpleNamespace(path=str(tiny_model_dir("qwen3_moe"))),
    )
    rates = load_rates(REPO / "benchmarks" / "results" / "plan_rates_cpu_static.yaml")
    work = workload_of(rates, config, prompt_tokens=100, gen_tokens=50)
    assert work.route_ids == 8 and work.route_bytes == 153_600
    assert "routed experts: 8 int16 ids per token, 0.2 MB per rollout batch" in assumptions(rates, work, 0)
    config.rollout.return_routed_experts = False
    assert workload_of(rates, config, prompt_tokens=100, gen_tokens=50).route_bytes == 0
