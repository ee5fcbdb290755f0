"""docs/guides/export-hf.md's conversion script and commands, run as the page writes them on a tiny Llama.

The slow test runs the page's three commands (the model name and paths pointed at a tiny model and a
temporary directory): a checkpoint written after two Adam steps with the distributed optimizer's state
converts to HF with its trained weights; HF -> Megatron -> HF gives back every tensor bit for bit; a
LoRA checkpoint converts to a PEFT adapter directory. The quick test checks the commands against the
script's arguments.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "guides" / "export-hf.md"
SECTION = "## Converting a checkpoint"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def section() -> str:
    return PAGE.read_text(encoding="utf-8").split(SECTION, 1)[1].split("\n## ", 1)[0]


def script() -> str:
    return re.search(r"```python\n(.*?)```", section(), re.DOTALL).group(1)


def commands() -> list[list[str]]:
    block = re.search(r"```bash\n(.*?)```", section(), re.DOTALL).group(1)
    return [shlex.split(line) for line in block.strip().splitlines()]


def test_the_commands_match_the_script():
    compile(script(), "convert_checkpoint.py", "exec")
    flags = set(re.findall(r'add_argument\("(--[\w-]+)"', script()))
    directions = set(re.search(r"choices=\[(.*?)\]", script()).group(1).replace('"', "").split(", "))
    seen = set()
    for argv in commands():
        assert argv[:4] == ["torchrun", "--nproc-per-node", "1", "convert_checkpoint.py"]
        seen.add(argv[4])
        assert {a for a in argv[5:] if a.startswith("--")} <= flags
    assert seen == directions


def _run(argv: list[str], cwd: Path, swap: dict[str, str]) -> None:
    argv = [swap.get(a, a) for a in argv]
    argv[0] = TORCHRUN
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_page_converts_checkpoints(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from tests.actor.dist_utils import run_ranks
    from tests.actor.workers import make_batch

    base = str(tiny_model_dir("llama"))
    (tmp_path / "convert_checkpoint.py").write_text(script())
    to_hf, to_megatron, to_peft = commands()
    swap = {"smollm2-135m-instruct": base}

    # a checkpoint as a run writes it: two Adam steps, the distributed optimizer's state with the weights
    ckpt = tmp_path / to_hf[to_hf.index("--ckpt") + 1]
    batches = [make_batch([7, 12, 5, 9], seed=s) for s in range(3)]
    run_ranks(
        1,
        "tests.actor.workers:checkpoint_save_then_train",
        alloc="d1p1t1",
        model_dir=base,
        batches=batches,
        ckpt_dir=str(ckpt),
    )
    _run(to_hf, tmp_path, swap)
    hf = tmp_path / to_hf[to_hf.index("--out") + 1]
    trained, before = load_file(hf / "model.safetensors"), load_file(Path(base) / "model.safetensors")
    assert sorted(trained) == sorted(before)
    assert all(not trained[name].equal(before[name]) for name in before)  # every tensor trained
    assert (hf / "tokenizer.json").exists() and (hf / "config.json").exists()

    # HF -> Megatron -> HF: bit for bit
    _run(to_megatron, tmp_path, swap)
    back = tmp_path / "back-hf"
    _run(["torchrun", *to_hf[1:5], "--base", str(hf), "--ckpt", to_megatron[-1], "--out", str(back)], tmp_path, swap)
    again = load_file(back / "model.safetensors")
    assert sorted(again) == sorted(trained) and all(again[n].equal(trained[n]) for n in trained)

    # LoRA -> PEFT, from a checkpoint with adapters
    lora = to_peft[to_peft.index("--lora-rank") :]
    lora_ckpt = to_peft[to_peft.index("--ckpt") + 1]
    _run(["torchrun", *to_peft[1:4], "to-megatron", "--base", base, "--out", lora_ckpt, *lora], tmp_path, swap)
    _run(to_peft, tmp_path, swap)
    peft = tmp_path / to_peft[to_peft.index("--out") + 1]
    adapter = json.loads((peft / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (16, 32.0)
    assert (peft / "adapter_model.safetensors").exists()
