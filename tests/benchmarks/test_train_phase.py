"""benchmarks/train_phase.py: its HF baselines compute the same loss on the same tokens, packed or padded."""

import torch

from benchmarks import train_phase


def _loss(model, ids, mask, **inputs) -> torch.Tensor:
    logits = model(input_ids=ids, use_cache=False, **inputs).logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -(logp * mask).sum() / mask.sum()


def test_packed_rows_give_the_padded_rows_loss(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    train_phase._write_config(tmp_path, train_phase.QUICK)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path), dtype=torch.float32).eval()
    batch = train_phase.grpo_batch(train_phase.QUICK["vocab_size"])
    ids, positions, mask = train_phase._packed_rows(batch)
    assert ids.shape[0] == train_phase.GROUPS and int(mask.sum()) == int(batch["loss_mask"][:, 1:].sum())
    with torch.no_grad():
        padded = _loss(
            model, batch["input_ids"], batch["loss_mask"][:, 1:].bool(), attention_mask=batch["attention_mask"]
        )
        packed = _loss(model, ids, mask, position_ids=positions)
    # fp32, the same sums in another order: a few ulps of a loss of ~log(vocab)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)


def test_real_run_time_per_token_is_the_median_over_its_steps():
    """Steps of 900 tokens in 6 s, 1,200 in 9.6 s and 1,000 in 7.5 s: 6.67, 8.0 and 7.5 s per 1,000 tokens."""
    steps = [
        {"timeperf/train_step": 6.0, "ppo_actor/packed_tokens": 900.0},
        {"timeperf/train_step": 9.6, "ppo_actor/packed_tokens": 1200.0},
        {"timeperf/train_step": 7.5, "ppo_actor/packed_tokens": 1000.0},
    ]
    assert train_phase.seconds_per_1k_tokens(steps) == 7.5


def test_matmul_share_is_the_phase_matmul_work_per_second_over_the_machine_rate():
    row = {"s_per_1k_tokens": 4.0}  # 1,000 packed tokens in 4 s
    share = train_phase.matmul_share(row, gflop_per_token=0.8, machine_gflops=1000.0)
    assert share == {"matmul_gflops": 200.0, "of_machine_matmul": 0.2}
