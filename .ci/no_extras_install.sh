#!/usr/bin/env bash
# CI step: does `pip install megarl` (no extras, not editable) install what the code imports?
# A fresh venv in a temporary directory gets the CPU torch (the Makefile's .ci/install_torch_cpu.sh) and then
# the project as a regular package, built from a copy of the checkout's files (tracked and
# untracked-but-not-ignored, i.e. what a clone would hold), so nothing is written into the checkout.
# From a directory outside the checkout it then runs the CLI, loads the main job's config and
# imports every module of the package.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
start=$(date +%s)
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false

src="$tmp/src"
mkdir "$src"
if git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
  (cd "$repo" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
    | xargs -0 cp --parents -t "$src")
else
  tar -C "$repo" --exclude=./.venv --exclude=./build --exclude='*.egg-info' -cf - . | tar -C "$src" -xf -
fi

python3 -m venv "$tmp/venv"
py="$tmp/venv/bin/python"
# pip, quiet; without its warnings about the local indexes' missing project pages
pip_install() { "$py" -m pip install -q "$@" 2> >(grep -v 'is neither a file nor a directory' >&2); }
pip_install -U pip wheel setuptools
# torch's CPU build first, as `make install` gets it (a bare `torch>=2.6` would fetch the multi-GB CUDA build)
bash "$repo/.ci/install_torch_cpu.sh" "$py" -q -c "$repo/.ci/constraints.txt" "$src" \
  2> >(grep -v 'is neither a file nor a directory' >&2)
echo "no-extras install: venv ready after $(( $(date +%s) - start )) s"

cd "$tmp"  # outside the checkout: `import megarl` must come from the venv
MEGARL_REPO="$repo" "$py" - <<'EOF'
"""megarl comes from the venv, with its licence files, its metadata and its bundled data."""
import importlib.metadata as md
import os
import re
import sys
from pathlib import Path

import megarl

if "/site-packages/" not in megarl.__file__:
    sys.exit(f"megarl imported from {megarl.__file__}, not from the venv")
meta = md.metadata("megarl")
requires = re.search(r'python_requires="([^"]+)"', (Path(os.environ["MEGARL_REPO"]) / "setup.py").read_text()).group(1)
files = {str(f).rsplit("/", 1)[-1] for f in md.files("megarl") if ".dist-info/" in str(f)}
problems = [
    *([f"License: {meta['License']!r}"] if meta["License"] != "Apache-2.0" else []),
    *([f"Requires-Python: {meta['Requires-Python']!r}"] if meta["Requires-Python"] != requires else []),
    *(f"{name} not in the dist-info" for name in ("LICENSE", "THIRD_PARTY.md") if name not in files),
    *(f"megarl/{p} not installed" for p in ("data/gsm8k/LICENSE", "data/gsm8k/train.jsonl", "data/arithmetic/train.jsonl")
      if not (Path(megarl.__file__).parent / p).is_file()),
]
if problems:
    sys.exit("the installed package: " + "; ".join(problems))
EOF
"$tmp/venv/bin/megarl" --help >/dev/null
"$tmp/venv/bin/megarl" config --config "$repo/configs/gsm8k_grpo_cpu.yaml" >/dev/null

"$py" - <<'EOF'
"""Import every module of megarl; those needing an optional extra must succeed or name it."""
import importlib
import pkgutil
import sys

import megarl

# module -> (extra, why); its ImportError must name the extra (pip install 'megarl[extra]')
NEEDS_EXTRA = {
    # vLLM's general plugin and worker extension: loaded only inside vLLM server processes
    "megarl.bridge.receivers.vllm": ("vllm", "subclasses vLLM's WeightTransferEngine at import"),
}
# run their CLI when imported
SKIP = {"megarl.__main__"}

failures, imported = [], 0
names = [m.name for m in pkgutil.walk_packages(megarl.__path__, "megarl.", onerror=lambda n: failures.append(f"{n}: cannot walk"))]
for name in sorted(set(names) - SKIP):
    try:
        importlib.import_module(name)
        imported += 1
    except Exception as e:  # noqa: BLE001 - report every module that fails, not only the first
        extra = NEEDS_EXTRA.get(name, (None,))[0]
        if extra is not None and isinstance(e, ImportError) and f"megarl[{extra}" in str(e):
            print(f"  {name}: needs megarl[{extra}...] and says so")
            continue
        failures.append(f"{name}: {type(e).__name__}: {e}")
print(f"  imported {imported} of {len(names)} megarl modules without extras")
if failures:
    sys.exit("modules that do not import from a no-extras install:\n  " + "\n  ".join(failures))
EOF
echo "no-extras install: passed in $(( $(date +%s) - start )) s"
