"""The parts of a GRPO run that the trainer script builds from its config, beside the actor.

The rollout workflows (training and evaluation), the frozen reference of the KL term, PPO's
critic, on-policy distillation's teacher (its servers' scorer, or a model in the trainer), the tokenizer
and the evaluation prompts: each from its config section, so that :func:`megarl.train.build` reads as a
list of what a trainer rank holds.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megarl.actor.critic import MegatronCritic
from megarl.actor.engine import MegatronEngine
from megarl.actor.reference import AdapterReference
from megarl.api.workflow_api import RolloutWorkflow
from megarl.config import GRPOConfig
from megarl.config.train import TrainEngineConfig
from megarl.data import load_rl_dataset
from megarl.models import resolve_model_path
from megarl.rollout.teacher import TeacherScorer, check_same_tokenizer
from megarl.run.evaluator import evaluation_gconfig
from megarl.utils.plugins import import_plugin
from megarl.workflow.build import build_eval_workflow, build_workflow


def build_workflows(config: GRPOConfig, tokenizer) -> tuple[RolloutWorkflow, RolloutWorkflow]:
    """``config.workflow`` and ``config.eval_workflow`` (or the first's twin sampling as ``evaluator`` says), warmed up."""
    run = {
        "reward_fn": import_plugin(config.reward_fn, "reward_fn"),
        "gconfig": config.gconfig,
        "tokenizer": tokenizer,
        "max_context_len": config.context_length,
        "reward_config": config.reward,
    }
    workflow = build_workflow(config.workflow, run)
    if hasattr(workflow, "warm_up"):
        workflow.warm_up()  # its reward workers start while the model loads and the servers come up
    eval_run = {**run, "gconfig": evaluation_gconfig(config.evaluator, config.gconfig)}
    return workflow, build_eval_workflow(config.eval_workflow, config.workflow, workflow, eval_run)


def build_ref(config: GRPOConfig, parallel, actor: MegatronEngine) -> MegatronEngine | AdapterReference | None:
    """The frozen reference of the KL term: a model of ``config.ref``, else the actor's initial weights (a LoRA
    actor's own model with its initial adapters, :class:`~megarl.actor.reference.AdapterReference`: no second
    copy of the weights)."""
    if config.actor.kl_ctl <= 0:
        return None
    a = config.actor
    if config.ref is None and a.lora.enabled:
        return AdapterReference(actor)
    ref = MegatronEngine(
        config.ref or TrainEngineConfig(path=a.path, dtype=a.dtype, mb_spec=a.mb_spec, megatron=a.megatron)
    )
    ref.initialize(parallel=parallel)
    return ref


def build_teacher_scorer(config: GRPOConfig, tokenizer) -> TeacherScorer | None:
    """On-policy distillation's scorer of ``config.teacher``'s servers, once each showed it tokenizes as
    ``tokenizer`` does (a DP head's; None without teacher servers)."""
    if config.teacher is None or not config.teacher.addresses:
        return None
    scorer = TeacherScorer(config.teacher)
    scorer.check_tokenizer(tokenizer, timeout=config.rollout.setup_timeout)
    return scorer


def build_teacher_model(config: GRPOConfig, parallel, tokenizer) -> MegatronEngine | None:
    """On-policy distillation's teacher in the trainer (``teacher.path``): a frozen model in the actor's layout
    and dtype, whose tokenizer must split text as ``tokenizer`` does (None without one)."""
    if config.teacher is None or not config.teacher.path:
        return None
    from transformers import AutoTokenizer

    path = resolve_model_path(config.teacher.path)
    check_same_tokenizer(AutoTokenizer.from_pretrained(path), tokenizer, f"teacher.path={config.teacher.path!r}")
    a = config.actor
    teacher = MegatronEngine(TrainEngineConfig(path=path, dtype=a.dtype, mb_spec=a.mb_spec, megatron=a.megatron))
    teacher.initialize(parallel=parallel)
    return teacher


def teacher_scores(teacher: MegatronEngine, batch: dict, top_k: int = 0) -> dict[str, torch.Tensor]:
    """The trainer's teacher's logprob of each token of ``batch`` under its own distribution (temperature 1,
    untruncated) as ``teacher_logp``, and with ``top_k`` its top k at each position (``teacher_topk_ids``,
    ``teacher_topk_logp``), all aligned as the teacher servers' are: position ``i`` holds token ``i``'s (0 at
    position 0)."""
    if top_k == 0:
        return {"teacher_logp": torch.roll(teacher.compute_logp(batch), shifts=1, dims=-1)}

    def hook(head, mb: dict) -> torch.Tensor:  # one tensor per token: the label's logprob, the ids, their logprobs
        label, ids, logp = head.label_and_top_k_logprobs(mb["labels"], top_k)
        return torch.cat([label[:, None].double(), ids.double(), logp.double()], dim=1) * mb["label_mask"][:, None]

    teacher.eval()
    with torch.no_grad():
        out = torch.roll(teacher.forward(batch, hook), shifts=1, dims=1)  # ids exact in float64
    return {
        "teacher_logp": out[..., 0].float(),
        "teacher_topk_ids": out[..., 1 : 1 + top_k].long(),
        "teacher_topk_logp": out[..., 1 + top_k :].float(),
    }


def build_critic(config: GRPOConfig, parallel, total_steps: int) -> MegatronCritic | None:
    """PPO's value model (``algorithm.adv_estimator: gae``) in the actor's layout; ``critic.path`` defaults to the actor's."""
    if config.critic is None:
        return None
    critic = MegatronCritic(replace(config.critic, path=config.critic.path or config.actor.path))
    critic.initialize(parallel=parallel, ft_spec=total_steps)
    return critic


def load_tokenizer(config: GRPOConfig):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(config.tokenizer_path or config.actor.path))


def load_valid_items(config: GRPOConfig, tokenizer, skipped: list[str] | None = None) -> list[dict]:
    """The evaluation prompts (rank 0), at most ``evaluator.max_samples``; rows skipped as bad added to ``skipped``."""
    valid = config.valid_dataset
    if valid is None:
        return []
    dataset = load_rl_dataset(
        valid.path,
        valid.split,
        type=valid.type,
        max_prompt_tokens=valid.max_prompt_tokens,
        tokenizer=tokenizer,
        bad_rows=valid.bad_rows,
        skipped=skipped,
    )
    n = len(dataset) if config.evaluator.max_samples is None else min(len(dataset), config.evaluator.max_samples)
    return [dataset[i] for i in range(n)]
