#!/bin/bash
# Renders every launch/*.sbatch from an experiment config and a parallel-strategy preset
# (configs/parallel/), with this site's Slurm partition and setup line. Edit a config or a
# preset, then run it again rather than editing the scripts by hand:
#   bash launch/render.sh          # rewrite launch/*.sbatch
#   bash launch/render.sh DIR      # write them to DIR instead (tests/config/test_presets.py compares)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-launch}
site=(launcher.slurm.partition=gpu "launcher.slurm.setup=['source /shared/megarl/.venv/bin/activate']")

render() {  # render SCRIPT EXPERIMENT PRESET [key=value ...]
  local script=$1 experiment=$2 preset=$3
  shift 3
  megarl slurm --dry-run --config "configs/$experiment.yaml" --config "configs/parallel/$preset.yaml" \
    "${site[@]}" "$@" > "$out/$script.sbatch.tmp"
  mv "$out/$script.sbatch.tmp" "$out/$script.sbatch"  # a failed render leaves the old script
}

# a trial name per layout keeps their run directories (and recover points) apart
render gsm8k_grpo_qwen2.5-7b_32gpu     gsm8k_grpo_qwen2.5-7b_128gpu     dense_7b_32gpu   trial_name=run0-32gpu
render gsm8k_grpo_qwen2.5-7b_128gpu    gsm8k_grpo_qwen2.5-7b_128gpu     dense_7b_128gpu
render gsm8k_grpo_qwen3-30b-a3b_32gpu  gsm8k_grpo_qwen3-30b-a3b_256gpu  moe_30b_32gpu    trial_name=run0-32gpu
render gsm8k_grpo_qwen3-30b-a3b_256gpu gsm8k_grpo_qwen3-30b-a3b_256gpu  moe_30b_256gpu
