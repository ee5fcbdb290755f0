"""megarl against TRL's ``GRPOTrainer`` on one CPU machine: same task, model, batch and optimizer.

Both systems train SmolLM2-135M-Instruct (``resolve_model_path("smollm2-135m-instruct")``)
with GRPO on the bundled arithmetic set (``megarl/data/arithmetic/train.jsonl``, chat
prompts, ``megarl.reward.arithmetic.arithmetic_reward_fn``), back to back on the same
machine: 8 prompts x 8 samples per optimizer step, 16 new tokens, temperature 1.0 (top-p 1,
no top-k), Adam lr 1e-5 (no weight decay, constant LR, gradient clipping 1.0), no KL term
(beta 0), group-normalised advantages, token-mean (DAPO) loss, PPO clip 0.2.
Both train and generate in the same dtype, the one megarl's ``dtype: auto`` picks on this CPU
(:func:`peer_dtype`): bf16 where the CPU computes it natively (AVX-512 BF16 / AMX), else fp32
(emulated bf16 is tens of times slower than fp32 there, for both).
Both are on-policy here (megarl's CPU config is synchronous; its decoupled PPO loss then takes
the proximal logprobs from the update's own forward, TRL's ratio is 1 at its single iteration).

* **megarl**: ``megarl run configs/arithmetic_grpo_cpu.yaml`` (one vLLM-CPU server and a
  one-rank gloo Megatron trainer; its CPU defaults: synchronous, server and trainer taking
  turns on both cores (``max_staleness: 0``, ``cluster.cpu_threads: shared``), with
  ``actor.dtype`` and ``vllm.dtype`` set to :func:`peer_dtype`'s choice (what ``auto`` gives).
  **Generation: the vLLM-CPU server.** In bf16 its trainer keeps fp32 main weights for Adam.
  Per-step times and rewards come from its ``metrics.jsonl`` (``timeperf/step``,
  ``batch/reward/avg``); the dtype it chose from the saved ``config.yaml``.
* **TRL** (``trl==1.16.0``, the ``peers`` extra): ``GRPOTrainer`` on CPU in a subprocess
  (``python -m benchmarks.peer_trl --trl-worker ...``) with its best CPU settings found:
  ``torch.set_num_threads`` = every core of the machine (it has the machine to itself), in bf16
  mixed precision like megarl's trainer: the model loaded in fp32 with ``bf16=True`` (bf16
  autocast, Adam on the fp32 weights), else fp32. Not bf16 weights (TRL's default on
  accelerators when the checkpoint is bf16): Adam's lr-1e-5 steps round away on them and TRL's
  reward did not move in 9 steps (0.19-0.22, where fp32 reached 0.9 by step 10), for steps only
  7% shorter (86.7 against 93.2 s in emulated bf16 on an AVX-512 Xeon).
  **Generation: plain** ``transformers`` ``generate`` (``use_vllm=False``: TRL's vLLM modes are
  written for CUDA devices and were not tried with vLLM-CPU),
  one optimizer step = one generation batch of 64 completions in one micro-batch
  (``per_device_train_batch_size=64``, ``gradient_accumulation_steps=1``; megarl packs
  up to ``actor.mb_spec.max_tokens_per_mb`` tokens per micro-batch, one optimizer step per batch), gradient
  checkpointing off (megarl's default; TRL's is on). A callback times optimizer steps and
  reads the logged ``reward``. The reward is megarl's function behind TRL's signature
  (:func:`trl_reward`).

Measured per system: median step time (the first step is warm-up and left out), mean reward
of every step, "reward @10min" (the mean reward of the last 5 steps among those that finished
within the first 600 s of training; training time is the running sum of step times, so
start-up is not counted), peak RSS of the whole process tree (megarl: launcher + vLLM server +
trainer + reward workers; TRL: its worker process), sampled with psutil every 0.5 s from a
thread here (a sum of RSS counts shared pages once per process), the trainer's own peak RSS
(megarl's ``memory/*_peak_gb`` stats; TRL: the same as the tree), steps done, the dtype, and
the wall time of the whole run including start-up.

The full run trains each system for 12 minutes (megarl is stopped with SIGTERM, which its
launcher turns into a clean teardown, once its step times add up to that); ``--quick`` runs 3
steps each, a smoke test of the script. ``--dtype bfloat16`` (or ``float32``) runs both in that dtype
whatever ``auto`` picks (e.g. bf16 on a CPU that emulates it), into a table of its own.

    python -m benchmarks.peer_trl [--quick] [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Self

import psutil

from benchmarks._harness import cpu_kind, main_for
from megarl.utils.hardware import auto_dtype, cpu_info

TITLE = "GRPO on CPU: megarl vs TRL GRPOTrainer (SmolLM2-135M-Instruct, arithmetic, 8 prompts x 8 samples, 16 tokens)"
ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "arithmetic_grpo_cpu.yaml"
EXPERIMENT = "arithmetic-grpo-cpu"
MODEL = "smollm2-135m-instruct"

PROMPTS, SAMPLES, MAX_NEW_TOKENS, TEMPERATURE, LR, SEED = 8, 8, 16, 1.0, 1e-5, 1
WARMUP_STEPS = 1
WINDOW_S = 600.0
"""Training seconds behind "reward @10min"."""
LAST_N = 5
"""Steps averaged for "reward @10min"."""
FULL_TRAIN_S = 720.0
QUICK_STEPS = 3
MAX_STEPS = 100_000
"""Step cap of a time-bounded run (the time budget stops it first)."""
SAMPLE_S = 0.5
ROW_KEYS = ("answer", "a", "op", "b")
"""The dataset columns the reward sees besides the completion (as megarl passes them)."""
GENERATION = {"megarl": "vLLM-CPU server", "trl": "transformers generate (use_vllm=False)"}
"""Which generation engine each side uses (a column of the results)."""
NOTES = {
    "megarl": "vLLM-CPU server + 1-rank gloo Megatron trainer, sync (max_staleness 0), threads per "
    "cluster.cpu_threads; configs/arithmetic_grpo_cpu.yaml",
    "trl": "GRPOTrainer, generation with transformers generate (use_vllm=False), torch.set_num_threads(all "
    "cores), in bf16 fp32 weights + bf16=True (autocast), 1 micro-batch of 64, gradient "
    "checkpointing off",
}
DEFINITIONS = (
    "median step excludes the first (warm-up) step; training time = running sum of step times; "
    f"reward @10min = mean reward of the last {LAST_N} steps that ended within the first {WINDOW_S:.0f} s "
    "of training (window s says how much training the run had, if less); peak RSS = sum over the process "
    "tree, sampled every 0.5 s"
)


class TreeRSS:
    """Peak summed RSS of a process and its descendants, sampled from a thread while in ``with``."""

    def __init__(self, pid: int, every_s: float = SAMPLE_S):
        self.pid, self.every_s = pid, every_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tree-rss", daemon=True)

    @property
    def peak_gb(self) -> float:
        return self.peak_bytes / 2**30

    def sample(self) -> int:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue  # exited between the listing and the read
        return total

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self.sample())
            self._stop.wait(self.every_s)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def summarize(system: str, steps: list[dict], window_s: float = WINDOW_S, last_n: int = LAST_N) -> dict:
    """Timing and reward columns of one system from its ``[{"step_s", "reward"}, ...]`` in step order."""
    times = [s["step_s"] for s in steps]
    rewards = [s["reward"] for s in steps]
    ends, total = [], 0.0
    for t in times:  # training clock: start-up and time between steps are not counted
        total += t
        ends.append(total)
    in_window = [r for r, end in zip(rewards, ends) if end <= window_s]
    measured = times[WARMUP_STEPS:]
    return {
        "system": system,
        "steps": len(steps),
        "median step s": statistics.median(measured) if measured else None,
        "train s": total,
        "reward @10min": statistics.fmean(in_window[-last_n:]) if in_window else None,
        "window s": min(window_s, total),
        "mean reward": statistics.fmean(rewards) if rewards else None,
        "reward per step": [round(r, 3) for r in rewards],
    }


DTYPE_ENV = "MEGARL_PEER_DTYPE"
"""Set by ``--dtype``: both systems in this dtype instead of what ``auto`` picks on this CPU."""
CLI_OPTIONS = {"--dtype": (DTYPE_ENV, {"bfloat16": "bfloat16", "float32": "float32"})}


def peer_dtype() -> tuple[str, str]:
    """The dtype both systems run in, and why: what megarl's ``dtype: auto`` gives on this CPU,
    unless ``--dtype`` asked for another."""
    auto, why = auto_dtype("cpu")
    asked = os.environ.get(DTYPE_ENV)
    if asked and asked != auto:
        return asked, f"asked for with --dtype; auto would pick {auto}: {why}"
    return auto, why


# ---------------------------------------------------------------- TRL side


def trl_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """megarl's ``arithmetic_reward_fn`` behind TRL's reward signature.

    TRL passes conversational completions as ``[{"role": "assistant", "content": text}]`` and
    every dataset column as a list with one entry per completion (plus its own extras such as
    ``trainer_state``, ignored here); megarl passes one completion with its row's columns.
    """
    from megarl.reward.arithmetic import arithmetic_reward_fn

    rewards = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        prompt_text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
        row = {key: kwargs[key][i] for key in ROW_KEYS if key in kwargs}
        rewards.append(float(arithmetic_reward_fn(prompt_text, text, [], [], **row)))
    return rewards


trl_reward.__name__ = "arithmetic"  # TRL logs rewards/<name>/mean


def trl_config(output_dir: str, max_steps: int, dtype: str):
    """The ``GRPOConfig`` of the shared setting (see the module docstring) in ``dtype``
    (``bfloat16`` or ``float32``, :func:`peer_dtype`)."""
    from trl import GRPOConfig

    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"peer_trl: dtype must be bfloat16 or float32, got {dtype!r}")
    return GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=dtype == "bfloat16",  # autocast; emulated (3-100x slower) on a CPU without native bf16
        fp16=False,
        model_init_kwargs={"dtype": "float32"},  # mixed precision: Adam on fp32 weights (module docstring)
        gradient_checkpointing=False,
        num_generations=SAMPLES,
        per_device_train_batch_size=PROMPTS * SAMPLES,
        gradient_accumulation_steps=1,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        scale_rewards="group",
        max_steps=max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
        seed=SEED,
    )


def _trl_dataset():
    """megarl's train split with its chat messages as TRL's conversational ``prompt`` column."""
    from megarl.data import load_rl_dataset

    return load_rl_dataset("arithmetic", "train", type="chat").rename_column("messages", "prompt")


def _step_clock(budget_s: float | None):
    """A ``TrainerCallback`` that times optimizer steps, keeps their logged reward and stops at ``budget_s``."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.steps: list[dict] = []
            self.last = 0.0
            self.trained = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.steps.append({"step_s": now - self.last, "reward": None})
            self.trained += now - self.last
            self.last = now
            if budget_s is not None and self.trained >= budget_s:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            # logged right after on_step_end of the same step (logging_steps=1)
            if logs and "reward" in logs and self.steps:
                self.steps[-1]["reward"] = logs["reward"]
            # the logging itself belongs to no step
            self.last = time.perf_counter()

    return StepClock()


def trl_worker(out: str, max_steps: int, budget_s: float | None, dtype: str) -> None:
    """Train with TRL in this process; write the per-step records and the settings it used to ``out``."""
    import torch
    from trl import GRPOTrainer

    from megarl.models import resolve_model_path

    torch.set_num_threads(cpu_info().cores)  # the whole machine: TRL runs alone
    torch.manual_seed(SEED)
    clock = _step_clock(budget_s)
    with tempfile.TemporaryDirectory(prefix="peer_trl_") as tmp:
        trainer = GRPOTrainer(
            model=str(resolve_model_path(MODEL)),
            reward_funcs=trl_reward,
            args=trl_config(tmp, max_steps, dtype),
            train_dataset=_trl_dataset(),
            callbacks=[clock],
        )
        trainer.train()
    result = {
        "steps": clock.steps,
        "dtype": "bfloat16" if trainer.args.bf16 else str(trainer.model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
    }
    Path(out).write_text(json.dumps(result))


def _run_trl(steps: int, budget_s: float | None, tmp: Path, dtype: str) -> dict:
    out, log = tmp / "trl.json", tmp / "trl.log"
    cmd = [sys.executable, "-m", "benchmarks.peer_trl", "--trl-worker", "--out", str(out), "--max-steps", str(steps)]
    cmd += ["--dtype", dtype]
    cmd += ["--budget-s", str(budget_s)] if budget_s is not None else []
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled")
    start = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        with TreeRSS(proc.pid) as rss:
            code = proc.wait()
    if code != 0:
        raise RuntimeError(f"TRL worker failed ({code}):\n{log.read_text()[-4000:]}")
    result = json.loads(out.read_text())
    return {**result, "wall_s": time.perf_counter() - start, "peak_gb": rss.peak_gb}


# ---------------------------------------------------------------- megarl side


def _megarl_metrics(run_dir: Path) -> list[dict]:
    """The lines of ``metrics.jsonl`` so far; a line being written (or cut by the SIGTERM) is left out."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _megarl_steps(run_dir: Path) -> list[dict]:
    return [{"step_s": m["timeperf/step"], "reward": m["batch/reward/avg"]} for m in _megarl_metrics(run_dir)]


def _megarl_trainer_peak_gb(run_dir: Path) -> float | None:
    """The trainer rank's own peak RSS (its ``memory/<phase>_peak_gb`` stats), to split the tree's total."""
    metrics = _megarl_metrics(run_dir)
    peaks = [v for m in metrics for k, v in m.items() if k.startswith("memory/") and k.endswith("_peak_gb")]
    return max(peaks, default=None)


def _megarl_settings(run_dir: Path) -> dict:
    """The dtype ``dtype: auto`` resolved to (trainer and server) and the thread policy, from the saved config."""
    import yaml

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    trainer, server = config["actor"]["dtype"], config["vllm"]["dtype"]
    dtype = trainer if trainer == server else f"trainer {trainer}, server {server}"
    return {"dtype": dtype, "threads": f"cpu_threads={config['cluster']['cpu_threads']}"}


def _stop(proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """SIGTERM the launcher (it tears its servers and trainer down), then force what is left."""
    from megarl.utils.process import terminate_process_tree

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            terminate_process_tree(proc)


def _run_megarl(steps: int, budget_s: float | None, tmp: Path, dtype: str) -> dict:
    run_dir, log = tmp / EXPERIMENT / "peer", tmp / "megarl.log"
    # an epoch holds at least one step, so `steps` epochs never cap the run below `steps` steps
    overrides = [
        f"cluster.fileroot={tmp}",
        "trial_name=peer",
        f"total_train_steps={steps}",
        f"total_train_epochs={steps}",
        "valid_dataset=null",
        "saver.freq_steps=null",
        "stats_logger.wandb.mode=disabled",
        "stats_logger.tensorboard.enabled=false",
        f"actor.dtype={dtype}",
        f"vllm.dtype={dtype}",
    ]
    cmd = [sys.executable, "-m", "megarl.launcher.cli", "run", str(CONFIG), *overrides]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
    start, stopped = time.perf_counter(), False
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            with TreeRSS(proc.pid) as rss:
                while proc.poll() is None:
                    time.sleep(2.0)
                    if budget_s is not None and sum(s["step_s"] for s in _megarl_steps(run_dir)) >= budget_s:
                        stopped = True
                        _stop(proc)
        finally:
            _stop(proc)
    if proc.returncode != 0 and not stopped:
        raise RuntimeError(f"megarl run failed ({proc.returncode}):\n{log.read_text()[-4000:]}")
    return {
        "steps": _megarl_steps(run_dir),
        **_megarl_settings(run_dir),
        "wall_s": time.perf_counter() - start,
        "peak_gb": rss.peak_gb,
        "trainer_peak_gb": _megarl_trainer_peak_gb(run_dir),
    }


# ---------------------------------------------------------------- table


def row(system: str, result: dict) -> dict:
    """One table row from a system's run (per-step records, dtype, wall time, peak RSS)."""
    return {
        **summarize(system, result["steps"]),
        "version": importlib.metadata.version(system),  # the harness records megarl's, not TRL's
        "peak RSS GB": result["peak_gb"],
        # TRL's trainer is its whole process tree
        "trainer peak RSS GB": result.get("trainer_peak_gb", result["peak_gb"]),
        "dtype": result["dtype"],
        "generation": GENERATION[system],
        "threads": result["threads"],
        "wall s": result["wall_s"],
        "cpu": cpu_info().summary(),
        "cpu kind": cpu_kind(),
        "notes": f"{NOTES[system]}; {DEFINITIONS}",
    }


def results_name() -> str:
    """One table per CPU kind (``peer_trl_avx2``, ``peer_trl_avx512``, ``peer_trl_avx512_bf16``,
    ``peer_trl_amx``): the dtype both run in, and how much each side gains from the CPU, differ
    by kind. A dtype other than ``auto``'s (``--dtype``) gets its own table: ``peer_trl_avx512_bfloat16``."""
    dtype, auto = peer_dtype()[0], auto_dtype("cpu")[0]
    return f"peer_trl_{cpu_kind()}" + ("" if dtype == auto else f"_{dtype}")


def run(quick: bool) -> list[dict]:
    try:  # fail before megarl's run, not after it
        importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("peer_trl needs TRL: pip install -c .ci/constraints.txt -e '.[peers]'") from None
    steps, budget = (QUICK_STEPS, None) if quick else (MAX_STEPS, FULL_TRAIN_S)
    dtype, why = peer_dtype()
    print(f"peer_trl: both systems in {dtype} ({why})", flush=True)
    with tempfile.TemporaryDirectory(prefix="peer_trl_") as tmp:
        megarl = _run_megarl(steps, budget, Path(tmp), dtype)
        trl = _run_trl(steps, budget, Path(tmp), dtype)
    return [row("megarl", megarl), row("trl", trl)]


def _worker_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="TRL side of the peer_trl benchmark (internal)")
    parser.add_argument("--trl-worker", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--budget-s", type=float, default=None)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), required=True)
    args = parser.parse_args(argv)
    trl_worker(args.out, args.max_steps, args.budget_s, args.dtype)


if __name__ == "__main__":
    if "--trl-worker" in sys.argv:
        _worker_main(sys.argv[1:])
    else:
        main_for(__name__)
