"""On-policy distillation's term of the advantages, against a plain-torch reference (float64 loops)."""

import pytest
import torch

from megarl.actor.advantages import TEACHER_LOG_RATIO_BOUND, teacher_advantages
from megarl.actor.ppo import MegatronPPOActor
from megarl.config.ppo import PPOActorConfig
from tests.numerics import gamma as gamma_n


def reference(policy, teacher, mask, lengths, coef, discount):
    """The term by its definition: per sequence, the discounted sum over the loss tokens from t on of
    ``-coef * clamp(policy - teacher)`` (float64)."""
    out, start = torch.zeros(policy.numel(), dtype=torch.float64), 0
    for n in lengths:
        positions = [t for t in range(start, start + n) if mask[t]]
        for i, t in enumerate(positions):
            out[t] = sum(
                discount ** (j - i)
                * -coef
                * (policy[s].double() - teacher[s].double()).clamp(-TEACHER_LOG_RATIO_BOUND, TEACHER_LOG_RATIO_BOUND)
                for j, s in enumerate(positions[i:], start=i)
            )
        start += n
    return out


@pytest.mark.parametrize("discount", [0.0, 0.5, 1.0])
def test_the_teacher_term_is_the_discounted_reverse_kl_to_go(discount):
    g = torch.Generator().manual_seed(0)
    lengths = [7, 5, 9]
    total = sum(lengths)
    policy = -torch.rand(total, generator=g) * 5
    teacher = -torch.rand(total, generator=g) * 5
    teacher[3] = -9999.0  # a token the teacher reports as impossible: bounded, not -coef * 9999
    mask = torch.rand(total, generator=g) > 0.3
    cu = torch.tensor([0, 7, 12, 21])
    term, reverse_kl = teacher_advantages(policy, teacher, mask, cu, coef=0.7, gamma=discount)
    expected = reference(policy, teacher, mask, lengths, 0.7, discount)
    # float32: each term sums at most 9 products of |x| <= 0.7 * 20 = 14 in the recursion's order; the bound
    # gamma(2n) * sum|x| covers the subtraction, the scaling and n additions
    bound = gamma_n(2 * max(lengths), torch.float32) * 14 * max(lengths)
    assert (term.double() - expected).abs().max() <= bound
    assert reverse_kl[~mask].eq(0).all() and term[~mask].eq(0).all()
    assert reverse_kl.abs().max() <= TEACHER_LOG_RATIO_BOUND
    if mask[3]:
        assert reverse_kl[3] == TEACHER_LOG_RATIO_BOUND


def test_compute_advantages_adds_the_term_on_next_token_alignment():
    """``teacher_logp`` comes aligned as the servers' ``logprobs`` (position i: token i); the actor rolls both
    and adds ``-coef * (behaviour - teacher)`` to GRPO's advantage of each sampled token."""
    cfg = PPOActorConfig(path="unused", group_size=2, teacher_coef=0.5)
    actor = MegatronPPOActor(cfg)
    actor.config.adv_norm.std_level = "none"
    data = {
        "attention_mask": torch.ones(2, 4, dtype=torch.bool),
        "loss_mask": torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]]),
        "logprobs": torch.tensor([[0.0, 0.0, -1.0, -2.0], [0.0, -0.5, -0.5, -0.5]]),
        "teacher_logp": torch.tensor([[0.0, -3.0, -1.5, -1.0], [0.0, -0.5, -2.5, -0.25]]),
        "rewards": torch.tensor([1.0, 0.0]),
    }
    actor.compute_advantages(data)
    grpo = torch.tensor([[0.0, 0.5, 0.5, 0.0], [-0.5, -0.5, -0.5, 0.0]])
    # sampled tokens after the roll: row 0 positions 1, 2; row 1 positions 0, 1, 2
    reverse_kl = torch.tensor([[0.0, -1.0 + 1.5, -2.0 + 1.0, 0.0], [0.0, -0.5 + 2.5, -0.5 + 0.25, 0.0]])
    reverse_kl[1, 0] = -0.5 + 0.5
    torch.testing.assert_close(data["teacher_reverse_kl"], reverse_kl)
    torch.testing.assert_close(data["advantages"], grpo - 0.5 * reverse_kl)


def test_without_teacher_logprobs_the_advantages_are_grpos():
    actor = MegatronPPOActor(PPOActorConfig(path="unused", group_size=2, teacher_coef=0.5))
    data = {
        "attention_mask": torch.ones(2, 3, dtype=torch.bool),
        "loss_mask": torch.tensor([[0, 1, 1], [0, 1, 1]]),
        "logprobs": torch.zeros(2, 3),
        "rewards": torch.tensor([1.0, 0.0]),
    }
    actor.compute_advantages(data)
    assert "teacher_reverse_kl" not in data
    assert data["advantages"][0, :2].gt(0).all() and data["advantages"][1, :2].lt(0).all()


@pytest.mark.multiproc
# pipeline and tensor parallel: the scores gathered from the last stage; context parallel: from each rank's tokens
@pytest.mark.parametrize("alloc", ["d1p2t2", "d1p1t1c2"])
def test_a_teacher_in_the_trainer_scores_as_hf_aligned_as_the_servers(tiny_model_dir, alloc):
    """``teacher.path``: the trainer's teacher gives each token's logprob at its own position (as the teacher
    servers do: 0 at position 0 and past each row's end), equal to HF's on the same model. fp32 on both sides
    (a log-sum-exp over 49,152 logits, summed in different orders): 2e-3, ten times the expected difference
    where a token shifted by one position is off by nats. With ``teacher.top_k``, each position's top k are
    HF's most likely tokens (within that 2e-3 of HF's k-th), most likely first, at HF's logprobs."""
    from tests.actor.dist_utils import run_layout
    from tests.actor.workers import make_batch
    from tests.rollout.test_teacher import hf_logprobs

    model_dir = str(tiny_model_dir("llama"))
    batch = make_batch([12, 7], seed=3)
    k = 4
    worker = "tests.actor.workers:teacher_in_trainer"
    sampled, top = run_layout(alloc, worker, model_dir=model_dir, batch=batch, top_k=k)[0]
    assert sampled.keys() == {"teacher_logp"} and top["teacher_topk_ids"].shape == (*batch["input_ids"].shape, k)
    lengths = batch["attention_mask"].sum(-1).tolist()
    for row, n in enumerate(lengths):
        ids = batch["input_ids"][row, :n].tolist()
        want = hf_logprobs(model_dir, ids, full=True)  # [n - 1, V]
        for got in (sampled["teacher_logp"], top["teacher_logp"]):
            torch.testing.assert_close(
                got[row, 1:n], want.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], atol=2e-3, rtol=0
            )
            assert got[row, 0] == 0 and got[row, n:].eq(0).all()
        top_ids, top_logp = top["teacher_topk_ids"][row], top["teacher_topk_logp"][row]
        torch.testing.assert_close(top_logp[1:n], want.gather(1, top_ids[1:n]), atol=2e-3, rtol=0)
        assert (top_logp[1:n, :-1] >= top_logp[1:n, 1:]).all(), "most likely first"
        assert (top_logp[1:n, -1] >= want.topk(k, dim=-1).values[:, -1] - 2e-3).all(), "HF's top k"
        assert top_ids[0].eq(0).all() and top_ids[n:].eq(0).all() and top_logp[n:].eq(0).all()
