#!/usr/bin/env bash
# The GPU validation kit: one command that checks megarl's fused CUDA kernels and the Megatron
# actor on a GPU node, everything it measures written to OUTDIR (docs/guides/gpu-kit.md).
#
#   bash benchmarks/gpu_kit.sh OUTDIR [--dry] [--call]
#
# Setup, in this shell, so that every step inherits it (the summary records each):
#   wheels     the wheels in .whl/ (benchmarks/gpu_wheels.py makes them on a machine with
#              internet; copy the folder to the node as .whl/) whose distribution is not
#              installed go to /tmp/megarl_site, which goes on PYTHONPATH
#   CUDA_HOME  the toolkit with include/cuda_runtime_api.h: $CUDA_HOME or $CUDA_PATH when valid,
#              else the TOP that `nvcc --dryrun` prints (nvcc on PATH may be a wrapper script, so
#              torch's guess, the directory above nvcc's, can miss the headers), else that guess
#   locks      stale `lock` files of megarl's torch-extension build dir (a killed JIT build
#              leaves one, and the next build waits on it forever) are removed
#   versions   the node's torch, vLLM, megatron-core and TransformerEngine against the GPU version
#              set (.ci/constraints-gpu.txt): ok, differs, or not installed
#   commit     $MEGARL_COMMIT when set (a copied tree's .git may name another HEAD), else git
#              rev-parse HEAD ("-dirty" when tracked files differ): what the result files record
#
# Steps, each its own process under `timeout` with its own budget (seconds):
#   env        nvidia-smi, Python/torch/CUDA/triton/nvcc versions, CUDA_HOME, CPU flags
#   build      JIT build of csrc/ and which mainloop runs
#   tests_sm80 each GPU test file (GPU_TEST_FILES) in its own pytest process, with
#              MEGARL_CUDA_MAINLOOP=sm80: mma.sync forced, also on Hopper
#   tests_sm90 the same with MEGARL_CUDA_MAINLOOP=auto (wgmma on Hopper)
#   kernels    benchmarks/fused_logprob.py --quick: naive / chunked / CUDA sm90 / CUDA sm80 /
#              Liger (when importable) / bare cuBLAS matmul, each variant in its own try
#   actor      benchmarks/actor_step.py --kit: the Megatron actor on CUDA, fused kernels off
#              then on, each in its own process (runs only when megatron-core imports)
# The setup and the steps' budgets sum to at most KIT_LIMIT (540 s; the kit refuses to start
# otherwise), and no step runs past the kit's deadline. OUTDIR/kit.log gets each step's output
# under a "== NAME" header while the step runs; OUTDIR/summary.md gets the setup lines first and
# each step's line as soon as it ends: ok, failed (rc N), timed out after Ns, or skipped: reason.
# The kernels and actor steps write fused_logprob_gpu.{md,json} and actor_step_gpu.{md,json}.
# A failed or timed-out step does not stop the next.
#
# --call: the prepared GPU call, the steps that measure rather than check (CALL_STEPS), in the order
# of what matters most: env, build, the wgmma tests (the self-check), the forward's CTA-order sweep
# (profile_forward --sweep: kernel and op time against cuBLAS at the TP-1 shapes), Nsight Compute's
# DRAM and L2 bytes of the profiled shape in the old order and the default one (ncu_forward.txt), the
# training path's grid (fused_logprob --grid train), the 28-layer Qwen2.5-1.5B actor step with the
# kernels on and with stock Megatron-LM's head, each followed by its top kernels, and the weight
# bridge's smoke test (benchmarks/bridge_smoke.py: a bridge group on NCCL, the sender's own rate). OUTDIR then holds at most MAX_FILES files: the summary and the JSON records
# stay, the rest (the tables' Markdown, ncu_forward.txt, kit.log) go into rest.tar.gz.
#
# --dry (automatic when torch sees no CUDA GPU): the CUDA steps report "skipped: no GPU", the
# rest runs, so the kit's logic can be checked on a CPU (tests/benchmarks/test_gpu_kit.py).
# For tests: MEGARL_KIT_STEPS="a b" runs only those steps, MEGARL_KIT_CMD_<step> replaces a
# step's command (run by bash in the repository root; a test file step gets the file as $1),
# MEGARL_KIT_BUDGET_<step> its budget (per file for the test steps), MEGARL_KIT_DRY=0 or 1
# decides the dry mode instead of asking torch, MEGARL_KIT_WHEELS_DIR and MEGARL_KIT_SITE
# replace .whl and /tmp/megarl_site. Each step sees its name as MEGARL_KIT_STEP.
set -uo pipefail
cd "$(dirname "$0")/.."
usage() {
  echo "usage: bash benchmarks/gpu_kit.sh OUTDIR [--dry] [--call]" >&2
  exit 2
}
[ $# -ge 1 ] && [ $# -le 3 ] || usage
OUTDIR=$1
DRY=${MEGARL_KIT_DRY:-auto}
CALL=0
for flag in "${@:2}"; do
  case $flag in
    --dry) DRY=1 ;;
    --call) CALL=1 ;;
    *) usage ;;
  esac
done
mkdir -p "$OUTDIR" || {
  echo "gpu_kit: cannot create OUTDIR $OUTDIR" >&2
  exit 2
}
OUTDIR=$(cd "$OUTDIR" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SUMMARY="$OUTDIR/summary.md"
LOG="$OUTDIR/kit.log"
WHEELS_DIR=${MEGARL_KIT_WHEELS_DIR:-.whl}
SITE=${MEGARL_KIT_SITE:-/tmp/megarl_site}
EXTENSION=megarl_C # the name megarl/kernels/_cuda.py gives torch's JIT build of csrc/
KIT_LIMIT=540      # seconds for the whole kit, setup included
KILL_AFTER=5       # what `timeout` waits after TERM before KILL

STEPS=(env build tests_sm80 tests_sm90 kernels actor)
declare -A BUDGET=([setup]=30 [env]=30 [build]=140 [kernels]=75 [actor]=135)
CALL_STEPS=(env build tests_sm90 forward_sweep ncu_forward train_grid actor_28l bridge_smoke)
declare -A CALL_BUDGET=([setup]=30 [env]=20 [build]=50 [forward_sweep]=70 [ncu_forward]=40 [train_grid]=95
  [actor_28l]=135 [bridge_smoke]=35)
MAX_FILES=8 # what one call may bring back
declare -A NEEDS_GPU=([build]=1 [tests_sm80]=1 [tests_sm90]=1 [kernels]=1 [actor]=1 [train_grid]=1 [actor_28l]=1
  [actor_7b4l]=1 [forward_sweep]=1 [ncu_forward]=1 [bridge_smoke]=1)
declare -A NEEDS_MEGATRON=([actor]=1 [actor_28l]=1 [actor_7b4l]=1)
# The test files that use the gpu marker, FILE:BUDGET. Each runs in its own pytest process
# under each mainloop, named explicitly: a collection error in one cannot stop the others.
# tests/benchmarks/test_gpu_kit.py checks that these are the files with `pytest.mark.gpu`.
GPU_TEST_FILES=(tests/kernels/test_kernels_cuda.py:45 tests/actor/test_fused_flag.py:20)
declare -A MAINLOOP=([tests_sm80]=sm80 [tests_sm90]=auto)

# The step commands; each runs with OUTDIR exported, in the repository root.
step_env() {
  nvidia-smi || echo "(no nvidia-smi)"
  echo "CUDA_HOME=${CUDA_HOME:-unset} PYTHONPATH=$PYTHONPATH"
  "$PY" - <<'PY'
import importlib.metadata as md, platform, shutil, subprocess, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| GPU", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
# versions from the metadata (no import: seconds saved on a busy node); the optional kernels'
# packages are imported where installed, since installed is not the same as importable
for dist, mod in (("triton", None), ("transformers", None), ("megatron-core", None),
                  ("transformer-engine", "transformer_engine"), ("apex", "apex"), ("liger-kernel", "liger_kernel")):
    try:
        version = md.version(dist)
    except md.PackageNotFoundError:
        print(dist, "not installed")
        continue
    try:
        where = __import__(mod).__file__ if mod else ""
        print(dist, version, where)
    except Exception as exc:  # noqa: BLE001
        print(dist, version, "installed but not importable:", type(exc).__name__, exc)
nvcc = shutil.which("nvcc")
print(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1] if nvcc else "no nvcc")
PY
  grep -m1 "model name" /proc/cpuinfo || true
  grep -m1 -o -w -E "avx512_bf16|amx_bf16|avx512f|avx2" /proc/cpuinfo | sort -u | tr '\n' ' '
  echo
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
step_test_file() { # $1: a test file; MEGARL_CUDA_MAINLOOP comes from the step
  "$PY" -m pytest -q -rfEs -p no:cacheprovider -m gpu "$1"
}
benchmark_into_outdir() { # $1: a benchmark; KIT_QUICK=1: its quick sizes; the table goes to OUTDIR
  KIT_BENCHMARK=$1 "$PY" - <<'PY'
import os, pathlib
from benchmarks._harness import print_record, run_benchmark
quick = os.environ.get("KIT_QUICK") == "1"
out = pathlib.Path(os.environ["OUTDIR"])
print_record(run_benchmark(os.environ["KIT_BENCHMARK"], quick=quick, results_dir=out))
PY
}
fused_logprob_into_outdir() { benchmark_into_outdir fused_logprob; }
step_kernels() { KIT_QUICK=1 fused_logprob_into_outdir; }
step_bridge_smoke() { benchmark_into_outdir bridge_smoke; }
step_actor() { "$PY" -m benchmarks.actor_step --kit "$OUTDIR" --quick; }
step_train_grid() { MEGARL_FUSED_GRID=train fused_logprob_into_outdir; }
step_actor_shape() { # $1: a GPU shape of benchmarks/actor_step.py, both rows, into OUTDIR
  MEGARL_ACTOR_STEP_SHAPE=$1 "$PY" -m benchmarks.actor_step --kit "$OUTDIR"
}
# megarl's head on the fused kernels, then stock Megatron-LM's head; each row's top kernels after it
step_actor_28l() { MEGARL_ACTOR_STEP_FUSED=on,stock MEGARL_ACTOR_STEP_PROFILE=1 step_actor_shape qwen2.5-1.5b; }
step_forward_sweep() { "$PY" -m benchmarks.profile_forward --sweep --out "$OUTDIR"; }
step_ncu_forward() { # the profiled shape (results/profile_forward_gpu_ncu.txt) in the old CTA order, then the default
  local rc=0 shape=(--tokens 16384 --hidden 4096 --vocab 32768 --repeats 1)
  local ncu=(ncu --clock-control none --profile-from-start off -k "regex:logprob_forward|nvjet|gemm|cutlass"
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed)
  {
    echo "== MEGARL_CUDA_CTA_GROUP=1: the order before the knob"
    MEGARL_CUDA_CTA_GROUP=1 "${ncu[@]}" "$PY" -m benchmarks.profile_forward "${shape[@]}" || rc=$?
    echo "== MEGARL_CUDA_CTA_GROUP unset: the default order"
    env -u MEGARL_CUDA_CTA_GROUP "${ncu[@]}" "$PY" -m benchmarks.profile_forward "${shape[@]}" || rc=$?
  } >"$OUTDIR/ncu_forward.txt" 2>&1
  return $rc
}
step_actor_7b4l() { step_actor_shape qwen2.5-7b-4L; }

# ---------------------------------------------------------------- setup
note() { echo "- $*" >>"$SUMMARY"; }

install_wheels() { # the wheels of WHEELS_DIR whose distribution is not installed, into SITE
  export PYTHONPATH="$PYTHONPATH:$SITE"
  if ! compgen -G "$WHEELS_DIR/*.whl" >/dev/null; then
    note "wheels: none in $WHEELS_DIR"
    return
  fi
  local missing rc
  missing=$(WHEELS_DIR=$WHEELS_DIR "$PY" - <<'PY'
import glob, importlib.metadata as md, os
for wheel in sorted(glob.glob(os.path.join(os.environ["WHEELS_DIR"], "*.whl"))):
    try:
        md.version(os.path.basename(wheel).split("-")[0])
    except md.PackageNotFoundError:
        print(wheel)
PY
)
  if [ -z "$missing" ]; then
    note "wheels: every wheel of $WHEELS_DIR is installed already"
    return
  fi
  echo "== wheels: installing into $SITE: $missing" >>"$LOG"
  # shellcheck disable=SC2086
  timeout --kill-after=$KILL_AFTER 25 "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade \
    --target "$SITE" $missing >>"$LOG" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    note "wheels: installed into $SITE: $(basename -a $missing | tr '\n' ' ')"
  else
    note "wheels: pip install into $SITE failed (rc $rc, see kit.log): $(basename -a $missing | tr '\n' ' ')"
  fi
}

has_cuda_headers() { [ -n "$1" ] && [ -f "$1/include/cuda_runtime_api.h" ]; }

nvcc_top() { # the toolkit directory nvcc itself reports, wrapper scripts seen through
  timeout 5 nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1
}

find_cuda_home() {
  local candidate source nvcc
  for source in CUDA_HOME CUDA_PATH; do
    candidate=${!source:-}
    if has_cuda_headers "$candidate"; then
      export CUDA_HOME=$candidate
      note "CUDA_HOME: $CUDA_HOME (from \$$source)"
      return
    fi
  done
  nvcc=$(command -v nvcc) || {
    note "CUDA_HOME: not found (CUDA_HOME and CUDA_PATH unset or without include/cuda_runtime_api.h, no nvcc on PATH)"
    return
  }
  candidate=$(nvcc_top)
  [ -n "$candidate" ] && candidate=$(realpath -m "$candidate") # TOP is .../bin/..
  source="nvcc --dryrun"
  if ! has_cuda_headers "$candidate"; then
    candidate=$(dirname "$(dirname "$nvcc")")
    source="the directory above $nvcc"
  fi
  if has_cuda_headers "$candidate"; then
    export CUDA_HOME=$candidate
    note "CUDA_HOME: $CUDA_HOME (from $source)"
  else
    note "CUDA_HOME: not found (no include/cuda_runtime_api.h under \$CUDA_HOME, \$CUDA_PATH, nvcc's TOP or $candidate)"
  fi
}

check_build_tools() { # what torch's JIT build runs: ninja on PATH and nvcc under CUDA_HOME
  local ninja
  if ninja=$(command -v ninja) && version=$(timeout 5 ninja --version 2>/dev/null); then
    note "ninja: $ninja $version"
  else
    note "ninja: not found on PATH (torch's JIT build needs it: pip install ninja, or put it on PATH)"
  fi
  if [ -z "${CUDA_HOME:-}" ]; then
    note "nvcc: no CUDA_HOME, so no \$CUDA_HOME/bin/nvcc for the JIT build"
  elif [ -x "$CUDA_HOME/bin/nvcc" ]; then
    note "nvcc: $CUDA_HOME/bin/nvcc $(timeout 10 "$CUDA_HOME/bin/nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/release \1/p')"
  else
    note "nvcc: $CUDA_HOME/bin/nvcc is missing or not executable (torch's JIT build runs that one, not PATH's)"
  fi
}

extensions_root() { # where torch's JIT builds go
  echo "${TORCH_EXTENSIONS_DIR:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/torch_extensions}"
}

remove_locks() { # removes megarl's JIT build locks and prints each removed path
  local lock
  # TORCH_EXTENSIONS_DIR/megarl_C/lock, or ~/.cache/torch_extensions/py312_cu130/megarl_C/lock
  find "$(extensions_root)" -maxdepth 3 -path "*/$EXTENSION/lock" 2>/dev/null | while IFS= read -r lock; do
    rm -f "$lock" && echo "$lock"
  done
}

remove_stale_locks() { # at start: this kit is the node's only user of the build dir while it runs
  local removed
  if [ "$DRY" = 1 ]; then
    note "stale build locks: left alone (dry: nothing is built)"
    return
  fi
  removed=$(remove_locks | tr '\n' ' ')
  if [ -n "$removed" ]; then
    note "stale build locks removed: $removed"
  else
    note "stale build locks: none under $(extensions_root)"
  fi
}

check_version_set() { # the node's versions against the GPU version set (.ci/constraints-gpu.txt)
  local report
  if report=$(timeout 20 "$PY" -c 'from benchmarks.gpu_wheels import version_set_report as r; print("; ".join(r()))' 2>&1); then
    note "version set (.ci/constraints-gpu.txt): $report"
  else
    note "version set: could not be read: $(tail -1 <<<"$report")"
  fi
}

find_commit() { # what the result files will record (benchmarks/_harness.py source_commit)
  local commit
  if [ -n "${MEGARL_COMMIT:-}" ]; then # said in so many words: a copied tree's .git may name another HEAD
    note "commit: $MEGARL_COMMIT (from \$MEGARL_COMMIT)"
  elif commit=$(git rev-parse HEAD 2>/dev/null); then
    [ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || commit+="-dirty"
    note "commit: $commit (from git)"
  else
    note "commit: unknown (no .git here: export MEGARL_COMMIT=<hash of the tree you copied> before the kit)"
  fi
}

# ---------------------------------------------------------------- budgets and steps
budget_of() { # $1: step; MEGARL_KIT_BUDGET_<step> or the default
  local override="MEGARL_KIT_BUDGET_$1"
  echo "${!override:-${BUDGET[$1]:-60}}"
}

test_budget() { # $1: test step, $2: FILE:BUDGET
  local override="MEGARL_KIT_BUDGET_$1"
  echo "${!override:-${2##*:}}"
}

plan_budgets() { # the budgets of setup and the selected steps: "name=seconds" lines
  local name entry
  echo "setup=${BUDGET[setup]}"
  for name in "${SELECTED[@]}"; do
    if [ -n "${MAINLOOP[$name]:-}" ]; then
      for entry in "${GPU_TEST_FILES[@]}"; do echo "$name:${entry%%:*}=$(test_budget "$name" "$entry")"; done
    else
      echo "$name=$(budget_of "$name")"
    fi
  done
}

skip_reason() { # why step $1 does not run, or nothing
  if [ "$DRY" = 1 ] && [ -n "${NEEDS_GPU[$1]:-}" ]; then
    echo "no GPU"
    return
  fi
  local hook="MEGARL_KIT_CMD_$1"
  if [ "$1" = ncu_forward ] && [ -z "${!hook:-}" ] && ! command -v ncu >/dev/null; then
    echo "ncu (Nsight Compute) not on PATH"
    return
  fi
  if [ -n "${NEEDS_MEGATRON[$1]:-}" ] && [ -z "${!hook:-}" ] && ! "$PY" -c "import megatron.core" 2>/dev/null; then
    echo "megatron-core not installed (run the wheel script)"
  fi
}

run_step() { # LABEL STEP BUDGET COMMAND [ARG]: COMMAND, or MEGARL_KIT_CMD_<STEP>, with ARG as $1
  local label=$1 step=$2 budget=$3 hook="MEGARL_KIT_CMD_$2" arg=${5:-} cmd rc status start left locks=
  cmd=${!hook:-$4}
  start=$(date +%s)
  left=$((DEADLINE - start - KILL_AFTER))
  if [ "$left" -lt 1 ]; then
    echo "| $label | skipped: the kit's ${KIT_LIMIT}s are spent | 0 |" >>"$SUMMARY"
    return
  fi
  [ "$budget" -le "$left" ] || budget=$left
  echo "== $label (budget ${budget}s): $cmd" >>"$LOG"
  # bash -c gets the step functions, so a test's command runs the way a step's does
  MEGARL_KIT_STEP=$label timeout --kill-after=$KILL_AFTER "$budget" bash -c "$(declare -f); $cmd" "$step" "$arg" \
    >>"$LOG" 2>&1
  rc=$?
  case $rc in
    0) status="ok" ;;
    124 | 137)
      status="timed out after ${budget}s"
      # a step killed inside a JIT build leaves its lock, and the next build would wait on it forever
      [ "$DRY" = 1 ] || locks=$(remove_locks | tr '\n' ' ')
      [ -z "${locks:-}" ] || status+="; build lock removed: $locks"
      ;;
    *) status="failed (rc $rc)" ;;
  esac
  echo "| $label | $status | $(($(date +%s) - start)) |" >>"$SUMMARY"
  echo "gpu_kit: $label: $status"
}

run_test_step() { # $1: tests_sm80 or tests_sm90: each GPU test file in its own process
  local entry file
  local -x MEGARL_CUDA_MAINLOOP=${MAINLOOP[$1]}
  for entry in "${GPU_TEST_FILES[@]}"; do
    file=${entry%%:*}
    run_step "$1 $file" "$1" "$(test_budget "$1" "$entry")" 'step_test_file "$1"' "$file"
  done
}

run_selected_step() {
  local reason
  reason=$(skip_reason "$1")
  if [ -n "$reason" ]; then
    echo "| $1 | skipped: $reason | 0 |" >>"$SUMMARY"
  elif [ -n "${MAINLOOP[$1]:-}" ]; then
    run_test_step "$1"
  else
    run_step "$1" "$1" "$(budget_of "$1")" "step_$1"
  fi
}

bundle_extra_files() { # at most MAX_FILES files in OUTDIR: the summary and the JSON records stay
  local count rest
  count=$(find "$OUTDIR" -maxdepth 1 -type f | wc -l)
  [ "$count" -gt "$MAX_FILES" ] || return 0
  rest=$(cd "$OUTDIR" && find . -maxdepth 1 -type f ! -name summary.md ! -name '*.json' ! -name rest.tar.gz -printf '%P\n' | sort)
  [ -n "$rest" ] || return 0
  # shellcheck disable=SC2086
  (cd "$OUTDIR" && tar czf rest.tar.gz $rest && rm -f $rest)
  echo "- bundled into rest.tar.gz (at most $MAX_FILES files come back): $(tr '\n' ' ' <<<"$rest")" >>"$SUMMARY"
}

# ---------------------------------------------------------------- main
KIT_START=$(date +%s)
DEADLINE=$((KIT_START + KIT_LIMIT))
if [ "$CALL" = 1 ]; then
  STEPS=("${CALL_STEPS[@]}")
  for name in "${!CALL_BUDGET[@]}"; do BUDGET[$name]=${CALL_BUDGET[$name]}; done
fi
read -r -a SELECTED <<<"${MEGARL_KIT_STEPS:-${STEPS[*]}}"
PLAN=$(plan_budgets)
PLANNED=$(awk -F= '{ s += $2 } END { print s }' <<<"$PLAN")
if [ "$PLANNED" -gt "$KIT_LIMIT" ]; then
  echo "gpu_kit: the budgets sum to ${PLANNED}s, over the kit's ${KIT_LIMIT}s:" $PLAN >&2
  exit 2
fi
if [ "$DRY" = auto ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  DRY=1
  echo "gpu_kit: torch sees no CUDA GPU: dry mode"
fi
[ "$DRY" = 1 ] || DRY=0
export OUTDIR PY DRY
{
  echo "# GPU kit$([ "$CALL" = 1 ] && echo ' (the prepared call)'): $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)$([ "$DRY" = 1 ] && echo ' (dry: no GPU)')"
  echo
} >"$SUMMARY"
: >"$LOG"
note "budgets (s): $(tr '\n' ' ' <<<"$PLAN")(sum ${PLANNED} of ${KIT_LIMIT})"
find_commit
install_wheels
check_version_set
find_cuda_home
check_build_tools
remove_stale_locks
{
  echo
  echo "| step | status | seconds |"
  echo "|---|---|---|"
} >>"$SUMMARY"
for name in "${SELECTED[@]}"; do
  run_selected_step "$name"
done
[ "$CALL" = 0 ] || bundle_extra_files
cat "$SUMMARY"
