#!/usr/bin/env bash
# The GPU validation kit: one command per GPU lease, everything it measures written to OUTDIR.
#
#   bash benchmarks/gpu_kit.sh OUTDIR [--dry]
#
# On a lent machine (the device tool's `run`), with the megatron-core wheels of
# benchmarks/gpu_wheels.py carried in .whl:
#   run(command="bash benchmarks/gpu_kit.sh $OUT", carry=[".whl"], timeout_s=600)
#
# Steps, each under `timeout` with its own budget (seconds; they sum to 540, 9 minutes):
#   env        nvidia-smi, Python/torch/CUDA/triton/nvcc versions, CPU flags          (20)
#   build      JIT build of csrc/ and which mainloop runs                            (150)
#   tests_sm90 GPU kernel tests, MEGARL_CUDA_MAINLOOP=auto (wgmma on Hopper)          (60)
#   tests_sm80 GPU kernel tests, MEGARL_CUDA_MAINLOOP=sm80 (mma.sync)                 (60)
#   kernels    benchmarks/fused_logprob.py --quick: naive / chunked / CUDA sm90 / CUDA
#              sm80 / Liger (when importable) / bare cuBLAS matmul in one run         (90)
#   actor      benchmarks/actor_step.py --kit: the Megatron actor on CUDA, fused kernels
#              on vs off (runs only when megatron-core imports, after the wheels)    (160)
# What it writes, as it goes (a device call brings back at most 8 files from $OUT, so the
# steps share one log): OUTDIR/kit.log gets each step's output under a "== NAME" header while
# the step runs; OUTDIR/summary.md gets the step's line as soon as it ends: ok, failed (rc N),
# timed out after Ns, or skipped: reason; the kernels and actor steps write their tables
# (fused_logprob_gpu.{md,json}, actor_step_gpu.{md,json}) when they end. A failed or timed-out
# step does not stop the next.
#
# --dry (automatic when torch sees no CUDA GPU): the CUDA steps report "skipped: no GPU", the
# rest runs, so the kit's logic can be checked on a CPU (tests/benchmarks/test_gpu_kit.py).
# For tests: MEGARL_KIT_STEPS="a b" runs only those steps, MEGARL_KIT_CMD_<step> replaces a
# step's command (run by bash in the repository root), MEGARL_KIT_BUDGET_<step> its budget,
# MEGARL_KIT_DRY=0 or 1 decides the dry mode instead of asking torch.
set -uo pipefail
cd "$(dirname "$0")/.."
usage() { echo "usage: bash benchmarks/gpu_kit.sh OUTDIR [--dry]" >&2; exit 2; }
[ $# -ge 1 ] || usage
OUTDIR=$1
DRY=${MEGARL_KIT_DRY:-auto}
if [ $# -eq 2 ]; then [ "$2" = "--dry" ] && DRY=1 || usage; fi
[ $# -le 2 ] || usage
mkdir -p "$OUTDIR" || { echo "gpu_kit: cannot create OUTDIR $OUTDIR" >&2; exit 2; }
OUTDIR=$(cd "$OUTDIR" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SUMMARY="$OUTDIR/summary.md"
LOG="$OUTDIR/kit.log"

STEPS=(env build tests_sm90 tests_sm80 kernels actor)
declare -A BUDGET=([env]=20 [build]=150 [tests_sm90]=60 [tests_sm80]=60 [kernels]=90 [actor]=160)
declare -A NEEDS_GPU=([build]=1 [tests_sm90]=1 [tests_sm80]=1 [kernels]=1 [actor]=1)

# The step commands; each runs with OUTDIR exported, in the repository root.
step_env() {
  nvidia-smi || echo "(no nvidia-smi)"
  "$PY" - <<'PY'
import platform, shutil, subprocess, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| GPU", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for mod in ("triton", "transformers", "megatron.core", "liger_kernel"):
    try:
        m = __import__(mod, fromlist=["_"])
        print(mod, getattr(m, "__version__", "?"))
    except Exception as exc:  # noqa: BLE001
        print(mod, "not importable:", type(exc).__name__, exc)
nvcc = shutil.which("nvcc")
print(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1] if nvcc else "no nvcc")
PY
  grep -m1 "model name" /proc/cpuinfo || true
  grep -m1 -o -w -E "avx512_bf16|amx_bf16|avx512f|avx2" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
}
step_build() {
  "$PY" - <<'PY'
import time, torch
from megarl.kernels import _cuda
start = time.perf_counter()
ext = _cuda.load_extension()
assert ext is not None, _cuda.unavailable_reason()
name, cap = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
available, definite, reason = ext.sm90_mainloop_status()
print(f"built in {time.perf_counter() - start:.0f} s; {name} sm_{cap[0]}{cap[1]}: mainloop",
      "sm90 (TMA + wgmma)" if available else f"sm80 (mma.sync): {reason}")
PY
}
step_tests() {  # $1: the MEGARL_CUDA_MAINLOOP value
  MEGARL_CUDA_MAINLOOP=$1 "$PY" -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/kernels
}
step_tests_sm90() { step_tests auto; }
step_tests_sm80() { step_tests sm80; }
step_kernels() {
  "$PY" - <<'PY'
import os, pathlib
from benchmarks._harness import print_record, run_benchmark
print_record(run_benchmark("fused_logprob", quick=True, results_dir=pathlib.Path(os.environ["OUTDIR"])))
PY
}
step_actor() { "$PY" -m benchmarks.actor_step --kit "$OUTDIR" --quick; }

# Installs the carried wheels (.whl/*.whl) whose package is not importable yet, into
# /tmp/megarl_site; prints why the actor step cannot run, or nothing.
install_wheels() {
  if ! "$PY" -c "import megatron.core" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    local missing
    missing=$("$PY" - <<'PY'
import glob, importlib.metadata as md
for w in sorted(glob.glob(".whl/*.whl")):
    name = w.split("/")[-1].split("-")[0]
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(w)
PY
)
    # shellcheck disable=SC2086
    [ -n "$missing" ] && "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/megarl_site $missing
    export PYTHONPATH="$PYTHONPATH:/tmp/megarl_site"
  fi
  "$PY" -c "import megatron.core" 2>/dev/null || echo "megatron-core not installed (run the wheel script)"
}

skip_reason() {  # why step $1 does not run, or nothing
  if [ "$DRY" = 1 ] && [ -n "${NEEDS_GPU[$1]:-}" ]; then echo "no GPU"; return; fi
  if [ "$1" = actor ] && [ -z "${MEGARL_KIT_CMD_actor:-}" ]; then install_wheels; fi
}

run_step() {
  local name=$1 budget reason cmd rc status start
  budget=$(eval echo "\${MEGARL_KIT_BUDGET_$name:-${BUDGET[$name]:-60}}")
  reason=$(skip_reason "$name")
  if [ -n "$reason" ]; then
    echo "| $name | skipped: $reason | 0 |" >>"$SUMMARY"
    return
  fi
  cmd=$(eval echo "\"\${MEGARL_KIT_CMD_$name:-step_$name}\"")
  start=$(date +%s)
  echo "== $name (budget ${budget}s): $cmd" >>"$LOG"
  # bash -c gets the step functions, so a test's command runs the way a step's does
  timeout --kill-after=5 "$budget" bash -c "$(declare -f); $cmd" >>"$LOG" 2>&1
  rc=$?
  case $rc in
    0) status="ok" ;;
    124 | 137) status="timed out after ${budget}s" ;;
    *) status="failed (rc $rc)" ;;
  esac
  echo "| $name | $status | $(($(date +%s) - start)) |" >>"$SUMMARY"
  echo "gpu_kit: $name: $status"
}

if [ "$DRY" = auto ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  DRY=1
  echo "gpu_kit: torch sees no CUDA GPU: dry mode"
fi
[ "$DRY" = 1 ] || DRY=0
export OUTDIR PY DRY
{
  echo "# GPU kit: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)$([ "$DRY" = 1 ] && echo ' (dry: no GPU)')"
  echo
  echo "| step | status | seconds |"
  echo "|---|---|---|"
} >"$SUMMARY"
: >"$LOG"
read -r -a SELECTED <<<"${MEGARL_KIT_STEPS:-${STEPS[*]}}"
for name in "${SELECTED[@]}"; do
  run_step "$name"
done
cat "$SUMMARY"
