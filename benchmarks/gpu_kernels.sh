#!/usr/bin/env bash
# The GPU half of the fused kernels in one command, for a machine with a CUDA GPU and a CUDA
# build of torch (no megarl install needed: megarl.kernels imports torch alone):
#   1. JIT-build csrc/ (sm_90a on Hopper, the device's own SASS elsewhere) and report which
#      mainloop runs;
#   2. the kernel correctness tests against the torch reference (tests/kernels, marker gpu;
#      needs pytest);
#   3. the benchmark grid of benchmarks/fused_logprob.py (--quick: one shape), which writes
#      benchmarks/results/fused_logprob_gpu.{md,json} (the CPU table stays in fused_logprob.*).
# Usage: bash benchmarks/gpu_kernels.sh [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
"$PY" - <<'PYEOF'
import torch
from megarl.kernels import _cuda
assert torch.cuda.is_available(), "no CUDA GPU visible to torch"
ext = _cuda.load_extension()
assert ext is not None, _cuda.unavailable_reason()
name, cap = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
print(f"{name} sm_{cap[0]}{cap[1]}: mainloop {'sm90 (TMA + wgmma)' if _cuda.use_wgmma(torch.device('cuda')) else 'sm80 (mma.sync)'}")
PYEOF
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests/kernels
"$PY" -m benchmarks.fused_logprob "$@"
