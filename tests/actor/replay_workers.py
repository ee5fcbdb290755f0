"""Rank functions and the single-rank HF reference of the routing-replay tests (``test_routing_replay.py``)."""

from __future__ import annotations

import torch

from tests.actor.workers import _ppo_actor, split_groups


def scaled_copy(src, dst, factors: dict[str, float]):
    """A copy of the HF model directory ``src`` at ``dst`` whose weights named ``...suffix`` are scaled by
    ``factors[suffix]``; ``dst``."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    dst = Path(dst)
    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        weights = load_file(file)
        for name in weights:
            for suffix, factor in factors.items():
                if name.endswith(suffix):
                    weights[name] = weights[name] * factor
        save_file(weights, file, metadata={"format": "pt"})
    return dst


def random_routes(batch: dict, n_layers: int, n_experts: int, k: int, group: int, seed: int = 0) -> torch.Tensor:
    """Server-style ``routed_experts`` ``[B, S, layers * k]`` (token-aligned: row ``i`` holds position ``i - 1``'s
    experts) drawn at random: distinct top-k per (position, layer), the same for a GRPO group's shared prompt
    (the same tokens on the same server route alike), -1 where a server reports nothing (token 0, padding)."""
    gen = torch.Generator().manual_seed(seed)
    rows, seq = batch["input_ids"].shape
    scores = torch.rand((rows, seq, n_layers, n_experts), generator=gen)
    prompt = batch["loss_mask"].long().argmax(dim=1)  # first answer token of each row
    for r in range(rows):
        first = r - r % group
        scores[r, : prompt[r]] = scores[first, : prompt[r]]
    routes = scores.topk(k, dim=-1).indices.flatten(2).to(torch.int16)
    routed = torch.full_like(routes, -1)
    lengths = batch["attention_mask"].sum(1).tolist()
    for r, n in enumerate(lengths):
        routed[r, 1:n] = routes[r, : n - 1]
    return routed


def hf_logp_with_routes(model_dir, batch: dict, routed: torch.Tensor | None, dtype=torch.float32) -> dict:
    """The HF model's next-token logprobs ``[B, S]`` (position ``t``: token ``t + 1``), each MoE layer sending
    position ``p`` to the experts ``routed[:, p + 1]`` holds (its own top-k where -1 or ``routed`` is None);
    and its own top-k, server-style (``routed_experts``). One row at a time: the independent reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    k = model.config.num_experts_per_tok
    gates = [layer.mlp.gate for layer in model.model.layers]
    forced: list = [None]
    own: list = []

    def make_forward(gate, layer):
        def forward(hidden):
            hidden = hidden.reshape(-1, gate.hidden_dim)
            logits = torch.nn.functional.linear(hidden, gate.weight)
            probs = logits.float().softmax(dim=-1)
            indices = probs.topk(k, dim=-1).indices
            own.append(indices)
            if forced[0] is not None:
                target = forced[0][: indices.shape[0], layer * k : (layer + 1) * k].long()
                indices = torch.where((target >= 0).all(-1, keepdim=True), target, indices)
            values = probs.gather(1, indices)
            values = values / values.sum(-1, keepdim=True)
            return logits, values.to(logits.dtype), indices

        return forward

    for layer, gate in enumerate(gates):
        gate.forward = make_forward(gate, layer)
    rows, seq = batch["input_ids"].shape
    logp = torch.zeros((rows, seq), dtype=torch.float64)
    own_routed = torch.full((rows, seq, len(gates) * k), -1, dtype=torch.int16)
    with torch.no_grad():
        for b, n in enumerate(batch["attention_mask"].sum(-1).tolist()):
            own.clear()
            forced[0] = None if routed is None else torch.roll(routed[b, :n], shifts=-1, dims=0)
            if forced[0] is not None:
                forced[0][-1] = -1  # the last token was never forwarded by a server
            ids = batch["input_ids"][b : b + 1, :n].long()
            logits = model(ids).logits[0].double()
            logp[b, : n - 1] = logits[:-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            own_routed[b, 1:n] = torch.cat(own, dim=-1)[: n - 1].to(torch.int16)
    return {"logp": logp, "routed": own_routed}


def replay_step(model_dir: str, alloc: str, batch: dict, mode: str, **overrides) -> dict:
    """The proximal pass, the advantages and a PPO update (2 mini-batches) of a MoE actor replaying ``mode``."""
    overrides = {"routing_replay": mode, **overrides}
    actor = _ppo_actor(model_dir, alloc, overrides, ppo_n_minibatches=2)
    p = actor.parallel
    group = actor.config.group_size
    data = split_groups(batch, p.dp_rank, p.alloc.dp, group)
    n_groups = batch["attention_mask"].shape[0] // group
    rows = [g * group + i for g in range(p.dp_rank, n_groups, p.alloc.dp) for i in range(group)]
    data["prox_logp"] = actor.compute_logp(data)
    recorded = data.get("replay_routes")
    prox_logp = data["prox_logp"].clone()
    actor.compute_advantages(data)
    stats = actor.ppo_update(data)
    logp_after = actor.compute_logp(data)
    keys = ("routing", "replay")
    return {
        "stats": [{k: v for k, v in s.items() if any(w in k for w in keys)} for s in stats],
        "prox_logp": prox_logp,
        "recorded": recorded,
        "logp_after": logp_after,
        "rows": rows,
        "pp_rank": p.pp_rank,
    }


def merge_rows(results: list, key: str, shape) -> torch.Tensor:
    """The whole batch's ``key`` from ranks that each return their DP share's rows (``rows``)."""
    first = results[0][key]
    full = torch.zeros((*shape, *first.shape[2:]), dtype=first.dtype)
    for r in results:
        full[r["rows"]] = r[key]
    return full
