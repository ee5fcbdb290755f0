"""PPO's critic: value loss and GAE against hand-computed values, the Megatron value model against
the HF ``AutoModelForTokenClassification(num_labels=1)`` with the same weights, TP2 / PP2 parity
with the single rank, and a checkpoint resume.

The reference model is a tiny Llama whose HF directory also holds a random ``score`` head (what
megarl exports for a critic), so the value head is exercised with nonzero weights.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from megarl.actor import advantages as adv_fns
from megarl.actor.critic import value_loss
from megarl.actor.ppo import MegatronPPOActor
from megarl.config.ppo import PPOActorConfig
from tests.actor.dist_utils import assert_grads_close, dp_rows, run_layout, run_ranks
from tests.actor.workers import make_critic_batch

LENGTHS = [7, 12, 5, 9, 11, 6]
VALUE_TOL = 1e-5
GRAD_RTOL = 1e-4
EPS_CLIP = 0.2


# ---------------------------------------------------------------------------- pure functions


def test_value_loss_takes_the_larger_of_clipped_and_unclipped_error():
    values = torch.tensor([1.0, 0.5, -0.3, 2.0])
    old = torch.tensor([0.5, 0.5, 0.0, 1.0])
    returns = torch.tensor([0.0, 1.0, 0.0, 3.0])
    loss, clipped = value_loss(values, old, returns, eps_clip=0.2)
    # token 0: v 1.0, v_clip 0.7 -> errors 1.0, 0.49 -> 0.5; token 1: no move -> 0.125
    # token 2: v -0.3, v_clip -0.2 -> errors 0.09, 0.04 -> 0.045; token 3: v 2.0, v_clip 1.2 -> errors 1, 3.24 -> 1.62
    assert loss.tolist() == pytest.approx([0.5, 0.125, 0.045, 1.62])
    assert clipped.tolist() == [False, False, False, True]
    plain, none_clipped = value_loss(values, old, returns, eps_clip=None)
    assert plain.tolist() == pytest.approx([0.5, 0.125, 0.045, 0.5])
    assert not none_clipped.any()


def test_gae_advantages_match_the_recursion_by_hand():
    # one sequence of 5 positions, loss tokens at 1..3, outcome reward 1 on the last (position 3)
    mask = torch.tensor([0, 1, 1, 1, 0])
    values = torch.tensor([9.0, 0.2, 0.5, 0.4, 9.0])  # outside the mask: ignored
    gamma, lam = 0.9, 0.8
    adv, returns = adv_fns.gae_advantages(
        torch.tensor([1.0]),
        values,
        mask,
        torch.tensor([0, 5]),
        1,
        gamma=gamma,
        lam=lam,
        mean_level="none",
        std_level="none",
    )
    d3 = 1.0 - 0.4
    d2 = 0.0 + gamma * 0.4 - 0.5
    d1 = 0.0 + gamma * 0.5 - 0.2
    a3, a2 = d3, d2 + gamma * lam * d3
    a1 = d1 + gamma * lam * a2
    assert adv.tolist() == pytest.approx([0.0, a1, a2, a3, 0.0])
    assert returns.tolist() == pytest.approx([0.0, a1 + 0.2, a2 + 0.5, a3 + 0.4, 0.0])


def test_token_advantages_whitened_per_batch_or_group():
    adv = torch.tensor([1.0, 2.0, 0.0, 3.0, 5.0, 7.0, 0.0, 0.0])
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 0])
    cu = torch.tensor([0, 2, 4, 6, 8])  # 4 sequences, groups of 2
    batch = adv_fns.normalize_token_advantages(adv, mask, cu, 2, "batch", "batch", eps=0.0)
    kept = torch.tensor([1.0, 2.0, 3.0, 5.0, 7.0])
    want = (kept - kept.mean()) / kept.std(unbiased=False)
    assert batch[mask.bool()].tolist() == pytest.approx(want.tolist())
    assert batch[~mask.bool()].abs().sum() == 0
    group = adv_fns.normalize_token_advantages(adv, mask, cu, 2, "group", "none")
    assert group[mask.bool()].tolist() == pytest.approx([-1.0, 0.0, 1.0, -1.0, 1.0])


def test_compute_advantages_runs_gae_when_the_config_says():
    """The actor's compute_advantages (``adv_estimator: gae``): GAE on values rolled to next-token alignment,
    returns added."""
    cfg = PPOActorConfig(path="unused", discount=1.0, gae_lambda=1.0, group_size=1, adv_estimator="gae")
    actor = MegatronPPOActor(cfg)
    actor.config.adv_norm.mean_level = actor.config.adv_norm.std_level = "none"
    data = {
        "attention_mask": torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool),
        "loss_mask": torch.tensor([[0, 0, 1, 1, 0]]),  # tokens 2, 3 sampled: positions 1, 2 after the roll
        "logprobs": torch.zeros(1, 5),
        "rewards": torch.tensor([1.0]),
        "values": torch.tensor([[0.0, 0.25, 0.5, 0.0, 0.0]]),
    }
    actor.compute_advantages(data)
    assert data["loss_mask"].tolist() == [[0, 1, 1, 0, 0]]
    # lambda = gamma = 1: advantage = return - value, return = 1 at both sampled tokens
    assert data["returns"].tolist() == [[0.0, 1.0, 1.0, 0.0, 0.0]]
    assert data["advantages"].tolist() == [[0.0, 0.75, 0.5, 0.0, 0.0]]
    with pytest.raises(ValueError, match="call it once per batch"):  # a second roll would misalign the batch
        actor.compute_advantages(data)


@pytest.mark.parametrize(("estimator", "values", "message"), [("gae", False, "needs data"), ("grpo", True, "takes no")])
def test_compute_advantages_refuses_values_its_estimator_does_not_match(estimator, values, message):
    actor = MegatronPPOActor(PPOActorConfig(path="unused", group_size=1, adv_estimator=estimator))
    data = {
        "attention_mask": torch.ones(1, 3, dtype=torch.bool),
        "loss_mask": torch.tensor([[0, 1, 1]]),
        "logprobs": torch.zeros(1, 3),
        "rewards": torch.tensor([1.0]),
    }
    if values:
        data["values"] = torch.zeros(1, 3)
    with pytest.raises(ValueError, match=message):
        actor.compute_advantages(data)


# ---------------------------------------------------------------------------- the value model


@pytest.fixture(scope="module")
def critic_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Llama plus a random ``score`` head: an HF token-classification critic."""
    from safetensors.torch import load_file, save_file

    src = tiny_model_dir("llama")
    out = tmp_path_factory.mktemp("critic")
    for path in src.iterdir():
        shutil.copy(path, out / path.name)
    tensors = load_file(str(out / "model.safetensors"))
    hidden = tensors["model.norm.weight"].shape[0]
    gen = torch.Generator().manual_seed(7)
    tensors["score.weight"] = torch.randn(1, hidden, generator=gen) * 0.5
    tensors["score.bias"] = torch.tensor([0.1])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def batch():
    return make_critic_batch(LENGTHS, seed=3)


def _hf_critic(model_dir):
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(str(model_dir), num_labels=1, dtype=torch.float32).eval()


def _hf_reference(model_dir, batch) -> dict:
    """Values, token-mean clipped value loss and gradients of the HF token-classification model."""
    model = _hf_critic(model_dir)
    attn = batch["attention_mask"]
    values = model(batch["input_ids"], attention_mask=attn).logits[..., 0].float()
    has_next = torch.zeros_like(attn)
    has_next[:, :-1] = attn[:, 1:]
    mask = batch["loss_mask"].bool() & has_next
    old, returns = batch["values"], batch["returns"]
    clipped = old + (values - old).clamp(-EPS_CLIP, EPS_CLIP)
    token_loss = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    loss = (token_loss * mask).sum() / mask.sum()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"values": (values * has_next).detach(), "loss": loss.item(), "grads": grads}


def _run(model_dir, alloc: str, batch, **cfg) -> dict:
    results = run_layout(
        alloc, "tests.actor.workers:critic_run", model_dir=str(model_dir), batch=batch, eps_clip=EPS_CLIP, **cfg
    )
    merged = {
        "loss": [r["loss"] for r in results],
        "grads": {},
        "update": [r["update"] for r in results],
        "packed_tokens": sum(r["packed_tokens"] for r in results),
    }
    for key in ("values", "values_after"):
        merged[key] = dp_rows(results, key, batch["input_ids"].shape)
    for r in results:
        merged["grads"].update(r["grads"])
    return merged


@pytest.fixture(scope="module")
def single_rank(critic_dir, batch):
    return _run(critic_dir, "d1p1t1", batch)


@pytest.mark.multiproc
def test_single_rank_critic_matches_hf_token_classification(critic_dir, batch, single_rank):
    hf = _hf_reference(critic_dir, batch)
    assert (single_rank["values"] - hf["values"]).abs().max() <= 1e-4
    assert single_rank["values"].abs().max() > 0.05  # the loaded score head, not a zero head
    assert single_rank["loss"][0] == pytest.approx(hf["loss"], rel=1e-5)
    assert "score.weight" in single_rank["grads"] and "score.bias" in single_rank["grads"]
    assert_grads_close(single_rank["grads"], hf["grads"], GRAD_RTOL)
    stats = single_rank["update"][0][0]
    assert stats["ppo_critic/loss"] == pytest.approx(hf["loss"], rel=1e-5)
    assert 0 < stats["ppo_critic/clip_ratio/avg"] < 1  # the batch's old values make the clip bite on some tokens
    mask = batch["loss_mask"].bool()
    before = (single_rank["values"] - batch["returns"])[mask].square().mean()
    after = (single_rank["values_after"] - batch["returns"])[mask].square().mean()
    assert after < before  # one Adam step toward the returns


@pytest.mark.multiproc
@pytest.mark.parametrize(  # DP alone splits rows only, as for the actor: with the slow tests
    "alloc", ["d1p1t2", "d1p2t1", "d1p1t1c2", pytest.param("d2p1t1", marks=pytest.mark.slow)]
)
def test_critic_layout_matches_single_rank(critic_dir, batch, single_rank, alloc):
    """TP2 (sequence parallel: the replicated head's gradient is split back, not summed), PP2 (the head
    on the last stage only) and DP2 give the single rank's values, loss, gradients and update."""
    got = _run(critic_dir, alloc, batch)
    assert (got["values"] - single_rank["values"]).abs().max() <= VALUE_TOL
    assert all(loss == pytest.approx(single_rank["loss"][0], rel=1e-5) for loss in got["loss"])
    assert_grads_close(got["grads"], single_rank["grads"], GRAD_RTOL)
    assert (got["values_after"] - single_rank["values_after"]).abs().max() <= 10 * VALUE_TOL


@pytest.mark.multiproc
def test_critic_on_shared_prefixes_matches_hf(critic_dir):
    """GRPO groups packed with their prompt once (``mb_spec.share_prefix``): the HF model's values,
    loss and gradients from fewer tokens, at TP2 with sequence parallelism."""
    from tests.actor.workers import make_grouped_batch

    grouped = make_critic_batch([], seed=5, batch=make_grouped_batch(n_groups=3, group=4, prompt_len=12, seed=5))
    got = _run(critic_dir, "d1p1t2", grouped, share_prefix=True, n_mbs=2)
    hf = _hf_reference(critic_dir, grouped)
    assert (
        got["packed_tokens"] / 2 < grouped["attention_mask"].sum().item()
    )  # two TP ranks report the same micro-batches
    assert (got["values"] - hf["values"]).abs().max() <= 1e-4
    assert all(loss == pytest.approx(hf["loss"], rel=1e-5) for loss in got["loss"])
    assert_grads_close(got["grads"], hf["grads"], GRAD_RTOL)


@pytest.mark.multiproc
@pytest.mark.parametrize("saved_at", ["d2p1t1", pytest.param("d1p1t2", marks=pytest.mark.slow)])
def test_critic_checkpoint_resumes_and_exports_to_hf(critic_dir, batch, tmp_path, saved_at):
    """A Megatron checkpoint of the critic (head and Adam state) resumes the same second update at
    another DP (or TP) size; the HF export loads as AutoModelForTokenClassification with the same values."""
    ckpt, export = tmp_path / "ckpt", tmp_path / "hf"
    saved = run_ranks(
        2,
        "tests.actor.workers:critic_save_then_train",
        model_dir=str(critic_dir),
        alloc=saved_at,
        batch=batch,
        ckpt_dir=str(ckpt),
        export_dir=str(export),
    )
    (resumed,) = run_ranks(
        1,
        "tests.actor.workers:critic_load_then_train",
        model_dir=str(critic_dir),
        alloc="d1p1t1",
        batch=batch,
        ckpt_dir=str(ckpt),
    )
    assert resumed["version"] == 1
    saved_values = dp_rows(saved, "values", batch["input_ids"].shape)
    saved_after = dp_rows(saved, "values_after", batch["input_ids"].shape)
    assert (resumed["values"] - saved_values).abs().max() <= VALUE_TOL
    assert resumed["second"][0]["ppo_critic/loss"] == pytest.approx(saved[0]["second"][0]["ppo_critic/loss"], rel=1e-5)
    assert (resumed["values_after"] - saved_after).abs().max() <= 10 * VALUE_TOL
    with torch.no_grad():
        hf_values = _hf_critic(export)(batch["input_ids"], attention_mask=batch["attention_mask"]).logits[..., 0]
    has_next = torch.zeros_like(batch["attention_mask"])
    has_next[:, :-1] = batch["attention_mask"][:, 1:]
    assert (hf_values * has_next - saved_values).abs().max() <= 1e-4


# ---------------------------------------------------------------------------- LoRA on the critic

CRITIC_TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def critic_adapter(critic_dir, tmp_path_factory):
    """A PEFT adapter of the base model (HF ``peft``, random nonzero), for the critic to start from."""
    pytest.importorskip("peft")
    from tests.actor.lora_workers import ALPHA, RANK, random_peft_adapter

    return random_peft_adapter(critic_dir, tmp_path_factory.mktemp("critic_adapter"), CRITIC_TARGETS, RANK, ALPHA)


def _lora_critic(critic_dir, alloc: str, batch, adapter) -> dict:
    kwargs = {"init_from": str(adapter), "targets": CRITIC_TARGETS}
    target = "tests.actor.lora_workers:critic_lora_run"
    results = run_layout(alloc, target, model_dir=str(critic_dir), batch=batch, **kwargs)
    merged = {key: dp_rows(results, key, batch["input_ids"].shape) for key in ("values", "values_after")}
    merged["grads"] = {name: g for r in results for name, g in r["grads"].items()}
    for key in ("loss", "base_frozen", "base_unchanged", "head_moved"):
        merged[key] = [r[key] for r in results]
    return merged


@pytest.fixture(scope="module")
def lora_critic(critic_dir, batch, critic_adapter):
    return _lora_critic(critic_dir, "d1p1t1", batch, critic_adapter)


def _hf_critic_with_adapter(critic_dir, adapter) -> torch.nn.Module:
    """The HF token-classification critic with the PEFT adapter merged into its weights by hand:
    ``W + (alpha / r) B A`` per module."""
    import json

    from safetensors.torch import load_file

    model = _hf_critic(critic_dir)
    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." in name:
                b = tensors[name.replace(".lora_A.", ".lora_B.")]
                module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                weight = model.get_submodule(module).weight
                weight += config["lora_alpha"] / config["r"] * (b @ a)
    return model


@pytest.mark.multiproc
def test_a_lora_critic_trains_its_adapters_and_value_head(critic_dir, batch, critic_adapter, lora_critic):
    """LoRA on the critic: its values are the HF critic's with the adapter merged, and an update trains the
    adapters and the value head (a base model's score head is new: PEFT's ``modules_to_save``) while the base
    stays frozen, bit for bit."""
    hf = _hf_critic_with_adapter(critic_dir, critic_adapter)
    attn = batch["attention_mask"]
    has_next = torch.zeros_like(attn)
    has_next[:, :-1] = attn[:, 1:]
    with torch.no_grad():
        want = hf(batch["input_ids"], attention_mask=attn).logits[..., 0].float() * has_next
    plain = _hf_critic(critic_dir)(batch["input_ids"], attention_mask=attn).logits[..., 0].detach() * has_next
    assert (lora_critic["values"] - want).abs().max() <= 1e-4
    assert (plain - want).abs().max() > 1e-2  # the adapter matters
    assert lora_critic["base_frozen"] == [True] and lora_critic["base_unchanged"] == [True]
    assert lora_critic["head_moved"] == [True]
    assert {"score.weight", "score.bias"} <= set(lora_critic["grads"])
    mask = batch["loss_mask"].bool()
    before = (lora_critic["values"] - batch["returns"])[mask].square().mean()
    after = (lora_critic["values_after"] - batch["returns"])[mask].square().mean()
    assert after < before  # one Adam step toward the returns


@pytest.mark.multiproc
def test_a_lora_critic_over_tp2_matches_one_rank(critic_dir, batch, critic_adapter, lora_critic):
    got = _lora_critic(critic_dir, "d1p1t2", batch, critic_adapter)
    assert (got["values"] - lora_critic["values"]).abs().max() <= VALUE_TOL
    assert all(loss == pytest.approx(lora_critic["loss"][0], rel=1e-5) for loss in got["loss"])
    assert_grads_close(got["grads"], lora_critic["grads"], GRAD_RTOL)
    assert (got["values_after"] - lora_critic["values_after"]).abs().max() <= 10 * VALUE_TOL
