"""Write trajectories to JSONL for debugging (``rollout.dump_trajectories``).

Layout: ``{run_dir}/{rollout|eval-rollout}/{version}/{task_id}.jsonl`` where ``run_dir``
is ``{fileroot}/{experiment_name}/{trial_name}`` (those an earlier start of the run left at the versions a
restart trains again are under ``{rollout|eval-rollout}/superseded-{time}/``; with several data-parallel
heads, each with its rollout engine, the task ids of one never repeat another's, so a file holds one
episode); one line per trajectory row::

    {"task_id": 42, "sample_idx": 0, "seqlen": 256, "prompt_len": 128,
     "head_version": 5, "tail_version": 5, "reward": 1.0,
     "prompt": "<|im_start|>user ...", "completion": "The answer is 4.<|im_end|>",
     "tokens": ["The", " answer", ...], "logprobs": [-0.12, ...], "trained": [1, ...], "versions": [5, ...]}

``prompt_len`` counts the tokens before the first generated one; for a multi-turn
episode ``completion`` is everything after that (later prompts included). ``tokens``,
``logprobs`` (the server's), ``trained`` (loss mask) and ``versions`` describe the completion
token by token (``megarl report`` shades them).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _row_record(traj: dict[str, Any], row: int, tokenizer) -> dict[str, Any]:
    seqlen = int(traj["attention_mask"][row].sum())
    ids = traj["input_ids"][row, :seqlen].tolist()
    loss_mask = traj["loss_mask"][row, :seqlen] if "loss_mask" in traj else torch.zeros(seqlen)
    generated = torch.nonzero(loss_mask).flatten()
    prompt_len = int(generated[0]) if generated.numel() else seqlen
    versions = traj["versions"][row, :seqlen] if "versions" in traj else torch.full((seqlen,), -1)
    gen_versions = versions[versions >= 0]
    reward = traj["rewards"][row] if "rewards" in traj else None
    return {
        "sample_idx": row,
        "seqlen": seqlen,
        "prompt_len": prompt_len,
        "head_version": int(gen_versions.min()) if gen_versions.numel() else None,
        "tail_version": int(gen_versions.max()) if gen_versions.numel() else None,
        "reward": None if reward is None else float(reward),
        "prompt": tokenizer.decode(ids[:prompt_len]),
        "completion": tokenizer.decode(ids[prompt_len:]),
        "tokens": [tokenizer.decode([token]) for token in ids[prompt_len:]],
        "logprobs": [round(float(x), 4) for x in traj["logprobs"][row, prompt_len:seqlen]]
        if "logprobs" in traj
        else [],
        "trained": [int(x) for x in loss_mask[prompt_len:]],
        "versions": [int(x) for x in versions[prompt_len:]],
    }


class TrajectoryDumper:
    """Appends each trajectory's rows to its JSONL file under ``run_dir``."""

    def __init__(self, run_dir: str | os.PathLike, tokenizer):
        if tokenizer is None:
            raise ValueError("TrajectoryDumper needs a tokenizer to decode prompts and completions")
        self.run_dir = Path(run_dir)
        self.tokenizer = tokenizer

    def path_for(self, task_id: int, version: int, is_eval: bool) -> Path:
        """Where the trajectory of ``task_id`` finished at ``version`` goes."""
        kind = "eval-rollout" if is_eval else "rollout"
        return self.run_dir / kind / str(version) / f"{task_id}.jsonl"

    def set_aside_from(self, version: int) -> list[Path]:
        """Move the version directories ``version`` and later, left by an earlier start of the run (a trainer
        restarted fresh, or resumed at ``version``: episodes it never trained on), into
        ``{kind}/superseded-{time}/``, so that ``{kind}/{v}/`` holds this start's trajectories only. Returns
        where they went."""
        moved = []
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for kind in ("rollout", "eval-rollout"):
            root = self.run_dir / kind
            later = [d for d in root.iterdir() if d.name.isdigit() and int(d.name) >= version] if root.is_dir() else []
            for directory in later:
                target = root / f"superseded-{stamp}" / directory.name
                target.parent.mkdir(exist_ok=True)
                try:
                    directory.rename(target)
                except FileNotFoundError:  # another data-parallel head's engine moved it first
                    continue
                moved.append(target)
        if moved:
            logger.info("trajectories of an earlier start (versions >= %d) moved to %s", version, moved[0].parent)
        return moved

    def dump(self, traj: dict[str, Any], task_id: int, version: int, is_eval: bool = False) -> Path:
        """Write every row of ``traj``; returns the file."""
        path = self.path_for(task_id, version, is_eval)
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = int(traj["attention_mask"].shape[0])
        lines = [json.dumps({"task_id": task_id, **_row_record(traj, r, self.tokenizer)}) for r in range(rows)]
        with open(path, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        return path
