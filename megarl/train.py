"""Asynchronous GRPO / PPO on Megatron-Core: the trainer every launcher starts.

    megarl run configs/gsm8k_grpo_cpu.yaml                      # servers + this script, one machine
    torchrun --nproc-per-node=N -m megarl.train --config X.yaml  # servers already up ($MEGARL_LLM_SERVER_ADDRS)

The walkthrough's "Putting It All Together", SPMD over the trainer ranks. One step
(:func:`rl_step`) reads top to bottom:

1. ``prepare_batch``: DP heads take ``batch_size`` accepted groups from their rollout
   pools (episodes keep running in the background, at most ``rollout.max_staleness``
   versions behind; 0 is synchronous RL), re-split across DP ranks, broadcast to TP/PP peers;
   colocated (``vllm:d1t1|megatron:d1p1t1``): then the servers sleep, freeing the devices;
2. ``compute_logp``: the proximal policy's logprobs (decoupled PPO; with one mini-batch and
   one epoch the update's own forward gives them) and the reference's (KL); with a critic
   (``algorithm.adv_estimator: gae``) its ``compute_values``;
3. ``compute_advantages`` and ``ppo_update`` (the critic's too), then the LR steps;
4. ``update_weights``: (colocated: wake the servers) pause rollout, stream weights to the servers,
   bump versions, resume;
5. saver, recover point, evaluator, stats → StatsLogger (console, wandb, tensorboard, curves.png).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from megarl.actor.advantages import shape_rewards
from megarl.actor.critic import MegatronCritic
from megarl.actor.engine import MegatronEngine
from megarl.actor.ppo import MegatronPPOActor, replayed_truncation
from megarl.actor.reference import AdapterReference
from megarl.api import context as workflow_context
from megarl.api.workflow_api import RolloutWorkflow
from megarl.config import GRPOConfig, save_config
from megarl.config.ppo import PPOActorConfig
from megarl.data import create_dataloader, load_rl_dataset
from megarl.reward.executor import describe_in_flight as describe_rewards_in_flight
from megarl.reward.failures import find_reward_error
from megarl.rollout import RemoteInferenceEngine
from megarl.rollout.coordinator import DataParallelLayout, DistRolloutCoordinator
from megarl.run.components import (
    build_critic,
    build_ref,
    build_teacher_model,
    build_teacher_scorer,
    build_workflows,
    load_tokenizer,
    load_valid_items,
    teacher_scores,
)
from megarl.run.console_text import (
    baseline_line,
    print_summary,
    rollout_bar,
    start_lines,
    step_line,
    stop_line,
    warn_on_gap,
)
from megarl.run.evaluator import Evaluator, pass_at_1, pass_at_k
from megarl.run.open_files import check_open_files
from megarl.run.prelaunch import load_expr_config
from megarl.run.recover import RecoverHandler, RecoverInfo
from megarl.run.saver import Saver
from megarl.run.stats_logger import StatsLogger
from megarl.run.throughput import record_train_parts, record_train_throughput
from megarl.run.weight_sync import WeightSync, WeightUpdateMeta, connect_engine
from megarl.utils import heartbeat, stats_tracker
from megarl.utils.auth import load_run_key
from megarl.utils.console import Console, Progress, open_console, record_stop
from megarl.utils.gc_pauses import freeze_startup_objects
from megarl.utils.memory import HeapBound, PeakRSS, keep_freed_memory
from megarl.utils.mpi import discover_ranks
from megarl.utils.threads import TrainerThreads, set_compute_threads

logger = logging.getLogger("megarl.train")


@dataclass
class Trainer:
    """Everything one trainer rank holds (built by :func:`build`)."""

    config: GRPOConfig
    actor: MegatronPPOActor
    ref: MegatronEngine | AdapterReference | None
    teacher: MegatronEngine | None
    """On-policy distillation's teacher in the trainer (``teacher.path``); served teachers score in the pool."""
    critic: MegatronCritic | None
    rollout: RemoteInferenceEngine | None
    coordinator: DistRolloutCoordinator
    dataloader: Any
    valid_items: list[dict]
    workflow: RolloutWorkflow | None
    eval_workflow: RolloutWorkflow | None
    weight_meta: WeightUpdateMeta
    weight_sync: WeightSync
    steps_per_epoch: int
    total_steps: int
    saver: Saver
    evaluator: Evaluator
    recover: RecoverHandler
    threads: TrainerThreads
    console: Console = field(default_factory=lambda: Console(None))
    memory: PeakRSS = field(default_factory=PeakRSS)
    heap: HeapBound = field(default_factory=lambda: HeapBound(None))
    skipped_rows: list[str] = field(default_factory=list)
    """Why each dataset row skipped at load was (``bad_rows: skip``), shown on the console at start."""
    stats_logger: StatsLogger | None = None
    progress: Progress | None = None

    def position(self, global_step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of ``global_step``."""
        return divmod(global_step, self.steps_per_epoch)

    @property
    def checkpointed(self) -> dict:
        """The engines a checkpoint or recover point holds: the actor (``model``) and the critic."""
        return {"model": self.actor} | ({"critic": self.critic} if self.critic is not None else {})


def rl_step(t: Trainer, global_step: int) -> dict[str, float]:
    """One asynchronous RL step; returns its stats (exact over all ranks)."""
    cfg = t.config
    with (
        stats_tracker.record_timing("rollout"),
        t.memory.peak("rollout"),
        heartbeat.phase("rollout"),
        nvtx_range(t, "rollout"),
        rollout_bar(t.progress if t.rollout is not None else None, batch_per_head(t)) as progress,
    ):
        accept = should_accept_fn(cfg.dynamic_filter, cfg.group_size, cfg.workflow.group_size, cfg.actor)
        batch = t.coordinator.prepare_batch(t.dataloader, t.workflow, accept, progress, lambda: readmit_servers(t))
    if t.rollout is not None:
        with stats_tracker.scope("rollout"):
            stats_tracker.scalar(
                server_restarts=float(t.rollout.restarts_seen),  # the run's, so far
                servers_joined=float(t.rollout.servers_joined),
            )
    if t.config.allocation.colocated:
        with phase(t, "sleep_servers"):
            sleep_servers(t)
    if t.actor.needs_prox_pass():  # else ppo_update's own forward gives them
        with phase(t, "recompute_logp"):
            batch["prox_logp"] = t.actor.compute_logp(batch)
    if t.ref is not None:
        with phase(t, "ref_logp"):
            # the KL compares the policy and the reference on the same (truncated) distribution
            batch["ref_logp"] = t.ref.compute_logp(batch, cfg.actor.temperature, replayed_truncation(cfg.actor))
    if t.teacher is not None:
        with phase(t, "teacher_logp"):
            batch.update(teacher_scores(t.teacher, batch, cfg.teacher.top_k))
    if t.critic is not None:
        with phase(t, "critic_values"):
            batch["values"] = t.critic.compute_values(batch)
    t.actor.compute_advantages(batch)  # GAE with the critic's values, else GRPO
    with phase(t, "train_step"):
        started = time.perf_counter()
        t.actor.train_clock.reset()
        ppo_stats = t.actor.ppo_update(batch)
        t.actor.step_lr_scheduler()
        train_s = time.perf_counter() - started
    record_train_throughput(t.actor, batch, train_s, cfg.actor.ppo_n_epochs, cfg.device)
    record_train_parts(t.actor.train_clock.seconds, train_s)
    if t.critic is not None:
        with phase(t, "critic_train"):
            ppo_stats += t.critic.ppo_update(batch)
            t.critic.step_lr_scheduler()
    with phase(t, "update_weights", servers_paused=True):
        if t.config.allocation.colocated and t.rollout is not None:
            t.rollout.wake()  # memory back first; the update pushes the new weights, then resumes them
        sync_stats = t.weight_sync.update_weights(replace(t.weight_meta, version=global_step + 1))
    record_batch_stats(batch, sync_stats)
    epoch, epoch_step = t.position(global_step)
    # the servers evaluate the new weights while the trainer writes them out (the recover point follows
    # the step's metrics line: see train())
    with t.evaluator.evaluating(lambda: evaluate(t), epoch, epoch_step, global_step) as eval_stats:
        with stats_tracker.record_timing("save"), heartbeat.phase("save"):
            t.saver.maybe_save(t.checkpointed, epoch, epoch_step, global_step)
    t.heap.end_step()  # a CPU trainer's kept heap back to the OS if it grew past cluster.cpu_heap_growth
    stats = {k: v for step in ppo_stats for k, v in step.items()}
    stats.update(stats_tracker.export())
    stats.update(eval_stats() or {})
    warn_on_gap(t.console, cfg.weight_update, stats)
    return stats


def sleep_servers(t: Trainer) -> None:
    """Colocated placement: the servers stop (in-flight generations continue after the weight update)
    and free their devices' memory; every rank waits until all have, then computes on every core."""
    if t.rollout is not None:
        t.rollout.sleep()
    dist.barrier()


def readmit_servers(t: Trainer) -> None:
    """No server left to generate, restarted ones waiting: push them the current weights (collective)."""
    heartbeat.step("pushing the weights to restarted servers")
    stats = t.weight_sync.readmit()
    with stats_tracker.scope("weight_sync"):
        stats_tracker.scalar(servers_readmitted_in_rollout=stats.get("servers_readmitted", 0.0))


def batch_per_head(t: Trainer) -> int:
    """Accepted groups a step takes from this DP head's rollout pool."""
    return t.config.train_dataset.batch_size // t.coordinator.layout.dp_size


@contextlib.contextmanager
def phase(t: Trainer, name: str, servers_paused: bool = False):
    """A trainer phase of the step: its wall time and peak RSS in the stats, on every core if the servers idle."""
    with (
        stats_tracker.record_timing(name),
        t.memory.peak(name),
        t.threads.phase(servers_paused),
        heartbeat.phase(name),
        nvtx_range(t, name),
    ):
        stats_tracker.scalar(**{f"threads/{name}": torch.get_num_threads()})
        yield


def nvtx_range(t: Trainer, name: str):
    """On a GPU, an NVTX range named after the phase (the step's phases on an Nsight Systems timeline)."""
    return torch.cuda.nvtx.range(name) if t.config.device == "cuda" else contextlib.nullcontext()


def should_accept_fn(dynamic_filter: str, granularity: int, runs: int = 1, actor: PPOActorConfig | None = None):
    """The rollout filter: one GRPO group of ``granularity`` rows per prompt, then ``config.dynamic_filter``.

    A workflow that returns another number of rows than ``granularity`` fails the step with
    a message saying so (the advantages would otherwise mix prompts), unless the group is a grouped
    rollout (``runs`` = ``workflow.group_size`` > 1) some of whose runs were rejected: that prompt is
    rejected (GRPO needs whole groups), with a warning the first time in a step. ``uniform_reward`` judges the
    rewards as the advantages see them: shaped by ``actor``'s ``reward_bias``, ``reward_scaling`` and
    ``reward_clip``.
    """
    per_run, warned = granularity // runs, []

    def accept(traj: dict) -> bool:
        rows = traj["attention_mask"].shape[0]
        if rows < granularity and runs > 1 and rows % per_run == 0:
            if not warned:
                warned.append(True)
                logger.warning(
                    "a grouped rollout returned %d of %d trajectories for a prompt (%d of its workflow.group_size=%d "
                    "runs rejected): the prompt is not trained on, as GRPO needs whole groups",
                    rows,
                    granularity,
                    runs - rows // per_run,
                    runs,
                )
            return False
        if rows != granularity:
            raise ValueError(
                f"the workflow returned {rows} trajectories for one prompt, but a GRPO group here is {granularity} "
                "(gconfig.n_samples x workflow.group_size = actor.group_size)"
            )
        if dynamic_filter == "uniform_reward":
            rewards = traj["rewards"].float()
            if actor is not None:
                rewards = shape_rewards(rewards, actor.reward_bias, actor.reward_scaling, actor.reward_clip)
            return bool(rewards.numel() > 1 and rewards.std() > 0)
        return True

    return accept


def record_batch_stats(batch: dict, sync_stats: dict[str, float]) -> None:
    """Rewards and lengths of the batch trained on, and the weight-sync timings."""
    with stats_tracker.scope("batch"):
        stats_tracker.denominator(n_seqs=torch.ones_like(batch["rewards"], dtype=torch.bool))
        stats_tracker.stat(
            reward=batch["rewards"].float(),
            seq_len=batch["attention_mask"].sum(-1).float(),
            denominator="n_seqs",
        )
    if "teacher_reverse_kl" in batch:  # on-policy distillation: how far the policy is from its teacher
        with stats_tracker.scope("teacher"):
            stats_tracker.denominator(n_tokens=batch["loss_mask"].bool())
            stats_tracker.stat(reverse_kl=batch["teacher_reverse_kl"], denominator="n_tokens")
    if sync_stats:
        with stats_tracker.scope("weight_sync"):
            stats_tracker.scalar(**sync_stats)


def evaluate(t: Trainer) -> dict[str, float]:
    """pass@1 (greedy or sampled) and pass@k on the validation prompts (rank 0 runs it; others return nothing)."""
    if t.rollout is None or dist.get_rank() != 0 or not t.valid_items:
        return {}
    if t.config.evaluator.greedy:
        return pass_at_1(t.rollout, t.valid_items, t.eval_workflow)
    return pass_at_k(t.rollout, t.valid_items, t.eval_workflow, t.config.evaluator.n_samples)


def recover_info(t: Trainer, global_step: int) -> RecoverInfo:
    epoch, epoch_step = t.position(global_step)
    return RecoverInfo(
        epoch=epoch,
        epoch_step=epoch_step,
        global_step=global_step,
        rollout_version=t.actor.get_version(),
        dataloader_state=t.dataloader.state_dict() if t.dataloader is not None else {},
        saver_state=t.saver.state_dict(),
        evaluator_state=t.evaluator.state_dict(),
        # prompts fed to the pool but not trained on yet: resubmitted first on recovery
        extra={"pending_items": t.rollout.pending_items() if t.rollout is not None else []},
    )


# ---------------------------------------------------------------------------- build


def build(config: GRPOConfig) -> Trainer:
    """Process groups, data, actor (and reference), rollout, weight bridge, run utilities."""
    actor = MegatronPPOActor(config.actor)
    parallel = actor.create_process_group(config.allocation_mode, seed=config.seed)
    layout = DataParallelLayout.from_parallel(parallel)
    tokenizer = load_tokenizer(config)
    workflow = eval_workflow = None
    if layout.is_head:
        workflow, eval_workflow = build_workflows(config, tokenizer)
    dataloader, n_batches, skipped_rows = None, None, []
    if layout.is_head:
        dataset = load_rl_dataset(  # the whole dataset: each head takes its share of every global batch
            config.train_dataset.path,
            config.train_dataset.split,
            type=config.train_dataset.type,
            max_prompt_tokens=config.train_dataset.max_prompt_tokens,
            tokenizer=tokenizer,
            bad_rows=config.train_dataset.bad_rows,
            skipped=skipped_rows,
        )
        dataloader = create_dataloader(
            dataset,
            batch_size=config.train_dataset.batch_size // layout.dp_size,
            shuffle=config.train_dataset.shuffle,
            seed=config.seed,
            drop_last=True,
            num_workers=config.train_dataset.num_workers,
            rank=layout.dp_rank,
            world_size=layout.dp_size,
        )
        n_batches = len(dataloader)
    valid_items = load_valid_items(config, tokenizer, skipped_rows) if dist.get_rank() == 0 else []
    steps_per_epoch = min(b for b in all_gather(n_batches) if b is not None)
    total_steps = steps_per_epoch * config.total_train_epochs
    if config.total_train_steps is not None:
        total_steps = min(total_steps, config.total_train_steps)
    workflow_context.set_run_length(total_steps, steps_per_epoch)  # a reward's trainer_state.max_steps, epoch
    actor.initialize(ft_spec=total_steps)
    ref = build_ref(config, parallel, actor)
    teacher = build_teacher_model(config, parallel, tokenizer)
    critic = build_critic(config, parallel, total_steps)

    rollout = None
    if layout.is_head:
        rollout = RemoteInferenceEngine(config.rollout, config.allocation.inference.backend)
        rollout.initialize(
            batch_size=config.train_dataset.batch_size // layout.dp_size,
            dump_dir=str(config.run_dir),
            tokenizer=tokenizer,
            vocab_size=actor.desc.dims.vocab_size,  # a server's token id beyond it is refused
            head=(layout.dp_rank, layout.dp_size),  # task ids unique across the heads (dumped trajectories' files)
            teacher=build_teacher_scorer(config, tokenizer),
        )
    meta = WeightUpdateMeta.from_allocation(config.weight_update, config.allocation)
    weight_sync = connect_engine(actor, rollout, meta)
    return Trainer(
        config=config,
        actor=actor,
        ref=ref,
        teacher=teacher,
        critic=critic,
        rollout=rollout,
        coordinator=DistRolloutCoordinator(rollout, layout, config.group_size),
        dataloader=dataloader,
        valid_items=valid_items,
        workflow=workflow,
        eval_workflow=eval_workflow,
        weight_meta=meta,
        weight_sync=weight_sync,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        saver=Saver(config.saver, config.run_dir, steps_per_epoch),
        evaluator=Evaluator(config.evaluator, steps_per_epoch),
        recover=RecoverHandler(config.recover, config.run_dir),
        skipped_rows=skipped_rows,
        heap=HeapBound(config.cluster.cpu_heap_growth),
        threads=TrainerThreads.for_this_rank(
            config.cluster.cpu_threads, config.device == "cpu", rollout.pool_idle if rollout is not None else None
        ),
    )


def to_container(config: GRPOConfig) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(config))


def all_gather(value) -> list:
    """Every rank's ``value`` (a picklable object)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# ---------------------------------------------------------------------------- main


def restore(t: Trainer) -> RecoverInfo | None:
    """Resume from the recover point (``recover.mode``): model, optimizer, data position, run utilities."""
    layout = t.coordinator.layout
    info = t.recover.load(t.checkpointed, share=(layout.dp_rank, layout.dp_size) if layout.is_head else None)
    if t.rollout is not None:
        t.rollout.set_version(t.actor.get_version())
        t.rollout.set_aside_earlier_dumps()  # an earlier start's trajectories of the steps trained again
    if info is None:
        return None
    if t.dataloader is not None:
        t.dataloader.load_state_dict(info.dataloader_state)
    t.saver.load_state_dict(info.saver_state)
    t.evaluator.load_state_dict(info.evaluator_state)
    logger.info("recovered after step %d (version %d)", info.global_step, info.rollout_version)
    return info


def train(t: Trainer) -> dict[str, float]:
    """Run the steps left; returns the StatsLogger's summary (rank 0) or {}."""
    info = restore(t)
    start = 0 if info is None else info.global_step + 1
    if start > t.total_steps:
        raise ValueError(
            f"the recover point is after step {start - 1}, but this run has {t.total_steps} steps "
            f"(total_train_steps / total_train_epochs): resuming would overwrite its checkpoints with later "
            f"weights. Raise total_train_steps to {start} or more, or start fresh (another trial_name)"
        )
    # The servers may hold other weights (a restarted trainer, servers kept up): push ours first.
    t.weight_sync.update_weights(replace(t.weight_meta, version=t.actor.get_version()))
    if info is not None and t.rollout is not None:  # prompts in flight at the recover point go first
        t.rollout.resubmit(
            t.actor.get_version(),
            info.extra.get("pending_items", []),
            t.workflow,
            should_accept_fn(
                t.config.dynamic_filter, t.config.group_size, t.config.workflow.group_size, t.config.actor
            ),
        )
    rank0 = dist.get_rank() == 0
    t.stats_logger = StatsLogger(
        t.config.stats_logger,
        t.config.run_dir,
        exp_config=to_container(t.config),
        rank=dist.get_rank(),
        start_step=start,
    )
    for line in start_lines(t.actor.kernel_backend, t.skipped_rows) if rank0 else []:
        t.console.line(line)
    baseline = evaluate(t) if start == 0 and t.config.evaluator.before_training else {}
    if baseline:
        t.console.line(baseline_line(baseline))
        t.stats_logger.before_training(baseline)
    t.progress = t.console.progress(t.total_steps, initial=start) if rank0 else None
    for global_step in range(start, t.total_steps):
        step_start = time.perf_counter()
        stats = rl_step(t, global_step)
        stats["timeperf/step"] = time.perf_counter() - step_start
        epoch, epoch_step = t.position(global_step)
        t.stats_logger.commit(epoch, epoch_step, global_step, stats)
        # after the step's line, and at the last step too: a trainer stopped between the two retrains the step,
        # and a finished run can be resumed for more steps from where it ended
        with heartbeat.phase("save"):
            last = global_step == t.total_steps - 1
            t.recover.maybe_dump(t.checkpointed, recover_info(t, global_step), force=last)
        if t.progress is not None:
            t.progress.write(step_line(global_step, t.total_steps, stats))
            t.progress.advance()
    if t.progress is not None:
        t.progress.close()
    epoch, epoch_step = t.position(t.total_steps - 1)
    if start < t.total_steps:  # a finished run resumed with nothing left to train keeps its checkpoints
        t.saver.maybe_save(t.checkpointed, epoch, epoch_step, t.total_steps - 1, force=True)
    summary = t.stats_logger.summary() if rank0 else {}
    before = t.stats_logger.before_training_stats  # this start's, or the resumed run's first start's
    if "eval/pass@1" in before and rank0:
        summary.setdefault("eval/pass@1", {})["before_training"] = before["eval/pass@1"]
    return summary


def close(t: Trainer) -> None:
    if t.stats_logger is not None:
        t.stats_logger.close()
    for wf in (t.workflow, t.eval_workflow):
        if hasattr(wf, "close"):  # a workflow need only have arun_episode
            wf.close()
    if t.rollout is not None:
        t.rollout.destroy()
    t.actor.destroy()
    if t.critic is not None:
        t.critic.destroy()


@record  # a failed rank's exception in torchrun's report and in {run_dir}/logs/torchrun/.../error.json
def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    config, rest = load_expr_config(sys.argv[1:] if argv is None else argv, GRPOConfig)
    if rest:
        raise SystemExit(f"megarl.train: unexpected arguments {rest}; overrides are key.path=value")
    check_open_files(config)  # on this node, before the build: RLIMIT_NOFILE raised for the pool's connections
    discover_ranks()  # under mpirun: RANK, WORLD_SIZE, MASTER_ADDR, ... from MPI (torchrun sets them itself)
    if config.device == "cpu":  # before gloo's and the rollout's threads run torch work: one OpenMP team
        set_compute_threads(torch.get_num_threads())
        if not keep_freed_memory():  # a heap that keeps a phase's pages for the next
            logger.info("not glibc: the CPU heap's free pages go back to the OS as the C library decides")
    load_run_key(config.run_dir)  # started by hand without $MEGARL_API_KEY: the key megarl serve made there
    rank = int(os.environ.get("RANK", "0"))
    log_name = "trainer.log" if rank == 0 else f"trainer-rank{rank}.log"  # one writer per file, on any filesystem
    console = open_console(config.run_dir / "logs" / log_name, rank, config.launcher.verbose)
    start = time.time()
    if config.watchdog.enabled:  # the launcher's watchdog reads it (megarl.launcher.watchdog)
        heartbeat.start(config.run_dir, f"trainer-{rank}", config.watchdog.interval_s, trace_collectives=True)
    with heartbeat.phase("build"):
        trainer = build(config)
        freeze_startup_objects()  # full collections no longer walk the model and the imports
    if trainer.rollout is not None and config.watchdog.enabled:  # a blocked event loop goes silent
        trainer.rollout.start_heartbeat(config.run_dir, f"rollout-{rank}", config.watchdog.interval_s)
    if trainer.rollout is not None:  # what this rank waits for in the rollout: requests and rewards
        heartbeat.set_detail_fn(
            lambda: "; ".join(d for d in (trainer.rollout.describe_outstanding(), describe_rewards_in_flight()) if d)
        )
    trainer.console = console
    logger.info("trainer rank %d: %s", rank, trainer.threads.describe())
    if dist.get_rank() == 0:
        save_config(config)
    try:
        summary = train(trainer)
    except Exception as error:
        if (broken := find_reward_error(error)) is None:
            raise
        logger.error("the run stopped: %s", broken)  # the user's code is broken: no stack of megarl's to show
        console.line(stop_line(broken))
        record_stop(config.run_dir, str(broken))  # the launcher neither restarts the trainer nor shows a stack
        return 1
    finally:
        close(trainer)
        heartbeat.stop()
    if dist.get_rank() == 0:
        print_summary(console, config, summary, time.time() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
