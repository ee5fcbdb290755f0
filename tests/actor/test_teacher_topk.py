"""On-policy distillation on the teacher's top k (``teacher.top_k``): the actor's loss gains ``teacher_coef`` x the
forward KL ``sum_j q_j (log q_j - log p(v_j))`` over the teacher's top k per loss token, whose value and gradients
(hidden states and head) equal the full softmax's in float64 within float32's error bound, on the training path
(gradients in the head's forward) and the logprobs path, on one rank and with the vocabulary over two TP ranks."""

from __future__ import annotations

import pytest
import torch

from megarl.actor import ppo_loss
from megarl.actor.lm_head import LMHeadOutput
from megarl.config.ppo import PPOActorConfig
from megarl.utils import stats_tracker
from tests.numerics import assert_within, gamma, softmax_head_bounds, unit_roundoff

T, H, V, K = 40, 16, 50, 5
TEMPERATURE = 0.8
COEF = 0.7


def _case(seed: int = 0) -> dict:
    """Hidden states, head, labels and a packed micro-batch with the teacher's top k of a random teacher."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    labels = torch.randint(0, V, (T,), generator=g)
    teacher = (torch.randn(T, V, generator=g) * 2).log_softmax(-1)
    top_logp, top_ids = teacher.topk(K, dim=-1)
    top_ids[3, 4] = V + 2  # an id outside the policy's vocabulary: no term
    mb = {
        "labels": labels,
        "label_mask": torch.rand(T, generator=g) > 0.1,
        "loss_mask": (torch.rand(T, generator=g) > 0.2).int(),
        "logprobs": -torch.rand(T, generator=g),
        "advantages": torch.zeros(T),  # the surrogate's value and gradient are 0: the loss is the term alone
        "cu_seqlens": torch.tensor([0, 9, 20, 31, T]),
        "teacher_topk_ids": top_ids,
        "teacher_topk_logp": top_logp,
    }
    return {"hidden": hidden, "weight": weight, "mb": mb}


def _config(**overrides) -> PPOActorConfig:
    cfg = PPOActorConfig(path="unused", temperature=TEMPERATURE, teacher_coef=COEF, use_decoupled_loss=False)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    cfg.check()
    return cfg


def _reference(case: dict) -> dict:
    """float64: the loss ``COEF * sum_t KL_t / n`` over the n loss tokens from the full log-softmax, its
    gradients, and float32's error bound of each (the docstring of :func:`_bounds`)."""
    h = case["hidden"].double().requires_grad_()
    w = case["weight"].double().requires_grad_()
    mb = case["mb"]
    mask = mb["loss_mask"].bool() & mb["label_mask"]
    ids, top = mb["teacher_topk_ids"], mb["teacher_topk_logp"].double()
    valid = ids < V
    logp = (h @ w.T / TEMPERATURE).log_softmax(-1)
    q = top.exp() * valid
    kl = (q * (top - logp.gather(1, ids.clamp(max=V - 1)))).sum(-1)
    loss = COEF * (kl * mask).sum() / mask.sum()
    loss.backward()
    return {"loss": loss.detach(), "d_hidden": h.grad, "d_weight": w.grad, **_bounds(case, mask, q, logp.detach())}


def _bounds(case: dict, mask, q, logp) -> dict:
    """float32's first-order error bounds. The term is ``C_t - M_t log p(y_t) - sum_j q_j gap_j`` per token:
    its part in the label's logprob goes through the fused head with the per-token coefficient
    ``-COEF M_t / n`` (:func:`softmax_head_bounds`, M_t's own rounding as that coefficient's error); each logit gap
    is two H-term dot products (gamma(H + 1) each, the head's logit bound), and the term's per-token sums of
    K products take gamma(2K + 4) of their absolute terms. The gaps' gradients sum K + 1 rows per token
    (gamma(K + 4)) into d_hidden and at most T (K + 1) products into a row of d_weight."""
    h, w = case["hidden"].double(), case["weight"].double()
    labels, ids = case["mb"]["labels"], case["mb"]["teacher_topk_ids"].clamp(max=V - 1)
    n = mask.sum()
    mass = q.sum(-1)
    c0 = -COEF * mass * mask / n
    coefs = torch.stack([c0, torch.zeros(T, dtype=torch.float64)])
    u32 = unit_roundoff(torch.float32)
    head = softmax_head_bounds(
        h,
        w,
        labels,
        coefs,
        TEMPERATURE,
        torch.float32,
        coef_errors=(gamma(K + 4, torch.float32) * c0.abs(), torch.zeros(T)),
    )
    dots = h.abs() @ w.abs().T / TEMPERATURE  # [T, V]: sum of |products| of each logit
    e_gap = gamma(H + 1, torch.float32) * (dots.gather(1, ids) + dots.gather(1, labels[:, None]))  # [T, K]
    g = COEF * q * (mask / n)[:, None] / TEMPERATURE  # [T, K]: d loss / d (z_vj - z_y)
    label_logp = logp.gather(1, labels[:, None])
    value_terms = q * (q.clamp(min=1e-300).log().abs() + label_logp.abs() + (logp.gather(1, ids) - label_logp).abs())
    per_token = mass * head.logprob + (q * e_gap).sum(-1) + gamma(2 * K + 4, torch.float32) * value_terms.sum(-1)
    rows = w.abs()[ids] + w.abs()[labels][:, None, :]  # [T, K, H]
    d_hidden = head.d_hidden + gamma(K + 4, torch.float32) * (g[:, :, None] * rows).sum(1)
    d_weight = head.d_weight.clone()
    spread = g[:, :, None] * h.abs()[:, None, :]  # [T, K, H]
    d_weight.index_add_(0, ids.flatten(), gamma(T * (K + 1) + 4, torch.float32) * spread.flatten(0, 1))
    d_weight.index_add_(0, labels, gamma(T * (K + 1) + 4, torch.float32) * spread.sum(1))
    loss_bound = COEF * (per_token * mask).sum() / n + 4 * u32 * COEF * (q.sum(-1) * mask).sum() / n
    return {"loss_bound": loss_bound, "d_hidden_bound": d_hidden, "d_weight_bound": d_weight}


def _head(case: dict, rank: int = 0, ranks: int = 1, group=None) -> LMHeadOutput:
    shard = V // ranks
    return LMHeadOutput(
        hidden=case["hidden"].clone().requires_grad_(),
        weight=case["weight"][shard * rank : shard * (rank + 1)].clone().requires_grad_(),
        vocab_start=shard * rank,
        vocab_size=V,
        tp_group=group,
        reduce_grad_hidden=True,
        backend="torch",
    )


def _loss_and_grads(head: LMHeadOutput, mb: dict, cfg: PPOActorConfig) -> dict:
    stats_tracker.export(local=True)  # nothing left from another test
    loss = ppo_loss.ppo_loss(head, mb, cfg, norm_len=64)
    loss.backward()
    return {"loss": loss.detach(), "d_hidden": head.hidden.grad, "d_weight": head.weight.grad}


PATHS = {"training path": {}, "logprobs path": {"importance_sampling_level": "sequence"}}


@pytest.mark.parametrize("overrides", PATHS.values(), ids=PATHS.keys())
def test_the_term_is_the_full_softmax_forward_kl_on_the_teachers_top_k(overrides):
    case = _case()
    cfg = _config(**overrides)
    assert ppo_loss._grads_in_forward(cfg, _head(case)) == (not overrides)
    got = _loss_and_grads(_head(case), case["mb"], cfg)
    stats = stats_tracker.export(local=True)
    want = _reference(case)
    assert_within(got["loss"], want["loss"], want["loss_bound"], "the loss")
    assert_within(got["d_hidden"], want["d_hidden"], want["d_hidden_bound"], "d hidden")
    assert_within(got["d_weight"], want["d_weight"], want["d_weight_bound"], "d weight")
    assert stats["teacher_topk_kl/avg"] == pytest.approx(want["loss"].item() / COEF, rel=1e-4)
    assert 0 < stats["teacher_topk_mass/avg"] < 1


def test_the_term_adds_to_the_surrogate():
    """With advantages, the loss and its gradients are the surrogate's plus the term's: the difference with
    and without the teacher's top k is the term within twice its bound."""
    case = _case(seed=1)
    case["mb"]["advantages"] = torch.randn(T, generator=torch.Generator().manual_seed(5))
    cfg = _config()
    with_term = _loss_and_grads(_head(case), case["mb"], cfg)
    without = {k: v for k, v in case["mb"].items() if not k.startswith("teacher_topk")}
    surrogate = _loss_and_grads(_head(case), without, cfg)
    want = _reference(case)
    assert_within(with_term["loss"] - surrogate["loss"], want["loss"], 2 * want["loss_bound"] + 1e-6, "the loss")
    for key in ("d_hidden", "d_weight"):
        diff = with_term[key] - surrogate[key]
        assert_within(diff, want[key], 2 * want[key + "_bound"] + 1e-6 * want[key].abs().max(), key)


def test_rows_with_the_teachers_top_k_are_never_inert():
    """``skip_zero_advantage`` drops the rows whose loss is 0 without the term; with it every row pulls."""
    from megarl.actor.ppo import inert_rows

    cfg = _config(skip_zero_advantage=True)
    ones = torch.ones(2, 4, dtype=torch.int32)
    data = {"advantages": torch.zeros(2, 4), "loss_mask": ones, "attention_mask": ones}
    assert inert_rows(data, cfg).all()
    data["teacher_topk_ids"] = torch.zeros(2, 4, K, dtype=torch.long)
    assert not inert_rows(data, cfg).any()


def term_on_tp_ranks() -> dict:
    """Each of two ranks holds half of the head's rows: the loss, d hidden and this rank's rows of d weight."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    case = _case()
    head = _head(case, dist.get_rank(), 2, dist.group.WORLD)
    return _loss_and_grads(head, case["mb"], _config())


def test_the_term_over_tensor_parallel_ranks():
    """A candidate's logit comes from the rank holding its row; the hidden state's gradient sums over both."""
    from tests.actor.dist_utils import run_ranks

    case = _case()
    want = _reference(case)
    for rank, got in enumerate(run_ranks(2, f"{__name__}:term_on_tp_ranks")):
        rows = slice(V // 2 * rank, V // 2 * (rank + 1))
        assert_within(got["loss"], want["loss"], 2 * want["loss_bound"], f"the loss on rank {rank}")
        assert_within(got["d_hidden"], want["d_hidden"], 2 * want["d_hidden_bound"], f"d hidden on rank {rank}")
        assert_within(got["d_weight"], want["d_weight"][rows], 2 * want["d_weight_bound"][rows], f"d weight {rank}")


def test_a_frozen_head_takes_the_term_through_the_hidden_states_alone():
    """A LoRA actor's LM head is frozen: the term's gradient reaches the hidden states (as the full softmax's
    does), and the head gets none."""
    case = _case()
    head = _head(case)
    head.weight.requires_grad_(False)
    got = _loss_and_grads(head, case["mb"], _config())
    want = _reference(case)
    assert got["d_weight"] is None
    assert_within(got["d_hidden"], want["d_hidden"], want["d_hidden_bound"], "d hidden")


# ---------------------------------------------------------------- the actor, at other layouts

LENGTHS = [7, 12, 5, 9, 11, 6, 8, 10]


@pytest.fixture(scope="module")
def topk_batch():
    """A trajectory batch whose teacher reported its top 4 at every position (random ids, most likely first)."""
    from tests.actor.workers import make_batch

    batch = make_batch(LENGTHS, seed=1)
    batch["rewards"] = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    g = torch.Generator().manual_seed(7)
    rows, width = batch["input_ids"].shape
    batch["teacher_topk_ids"] = torch.randint(0, 49152, (rows, width, 4), generator=g)
    q = torch.randn(rows, width, 5, generator=g).softmax(-1)[..., :4]  # the fifth: the rest of the mass
    batch["teacher_topk_logp"] = q.log().sort(-1, descending=True).values
    return batch


@pytest.fixture(scope="module")
def single_rank(tiny_model_dir, topk_batch):
    from tests.actor.dist_utils import run_ranks

    model = str(tiny_model_dir("llama"))
    return run_ranks(1, "tests.actor.workers:ppo_actor_step", model_dir=model, alloc="d1p1t1", batch=topk_batch)[0]


@pytest.mark.multiproc
@pytest.mark.parametrize("alloc", ["d1p1t2", "d1p1t1c2"])
def test_the_actors_term_at_another_layout_matches_single_rank(tiny_model_dir, topk_batch, single_rank, alloc):
    """compute_advantages → ppo_update of MegatronPPOActor with the teacher's top k: over two TP ranks and over two
    context-parallel ranks, every step's loss, gradient norm and term equal one rank's (tolerances set by hand,
    as tests/actor/test_ppo.py's: other reductions' orders over a whole model), and so do the weights after."""
    from tests.actor.dist_utils import run_ranks

    model = str(tiny_model_dir("llama"))
    got = run_ranks(2, "tests.actor.workers:ppo_actor_step", model_dir=model, alloc=alloc, batch=topk_batch)[0]
    assert len(got["stats"]) == len(single_rank["stats"]) == 2
    for want, have in zip(single_rank["stats"], got["stats"]):
        assert want["ppo_actor/teacher_topk_kl/avg"] > 0.1  # random teachers: far from the policy
        for key in ("ppo_actor/loss", "ppo_actor/grad_norm", "ppo_actor/teacher_topk_kl/avg"):
            assert have[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
        assert have["ppo_actor/teacher_topk_tokens"] == want["ppo_actor/teacher_topk_tokens"]
        assert have["ppo_actor/skipped_seqs"] == 0
    assert (got["logp_after"] - single_rank["logp_after"]).abs().max() <= 1e-4
