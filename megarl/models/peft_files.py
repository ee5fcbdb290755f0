"""PEFT adapter directories (what ``MegatronEngine.export_adapters`` writes and ``actor.lora.init_from``
reads) without Megatron-Core: their file names, the HF module names LoRA can target, and the checks a
directory must pass before a run starts from it (the config checks run these before launch), and an
adapter's output scale."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from megarl.utils.errors import ConfigError

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"

HF_LORA_TARGETS = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}
"""HF module names ``actor.lora.target_modules`` can name instead of Megatron's (PEFT's names), each with the
Megatron linear that holds it: each named module gets an adapter of its own, as in PEFT, also inside a fused
linear. The dense layers' only: a MoE model's experts are named as Megatron's (``experts.linear_fc1``)."""


_MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


def lora_scale(rank: int, alpha: float, use_rslora: bool = False) -> float:
    """What an adapter's ``B A x`` is multiplied by: ``alpha / rank``, or ``alpha / sqrt(rank)`` with
    rank-stabilised LoRA (PEFT's ``use_rslora``)."""
    return alpha / (math.sqrt(rank) if use_rslora else rank)


def hf_module(hf_name: str) -> str:
    """The module's own name in an HF tensor or module name: ``q_proj`` of
    ``model.layers.0.self_attn.q_proj.weight`` or of ``...q_proj.lora_A.weight``."""
    parts = hf_name.removesuffix(".weight").split(".")
    return parts[-2] if parts[-1] in ("lora_A", "lora_B") else parts[-1]


def covered_modules(target_modules) -> set[str]:
    """The HF module names whose weights ``target_modules`` (Megatron or HF names) adapt, among the dense
    layers' (:data:`HF_LORA_TARGETS`)."""
    return {hf for hf, holder in HF_LORA_TARGETS.items() if hf in target_modules or holder in target_modules}


def adapter_problems(
    path: str | os.PathLike, lora, moe: bool | None = None, key: str = "actor.lora"
) -> list[tuple[str, str]]:
    """What keeps the PEFT adapter directory ``path`` from starting a run with the adapters ``lora``
    describes (its ``rank``, ``alpha``, ``use_rslora`` and ``target_modules``; a ``LoRAConfig``): ``(config
    key, why)`` pairs, empty when it can. Reads its
    ``adapter_config.json`` and the names (not the values) in its weights file. ``moe``: whether the
    model's MLPs are experts (they have no dense ``gate_proj`` / ``up_proj`` / ``down_proj`` to adapt);
    None: not known, and the modules the targets name but the file lacks are not looked for. ``key``: the
    config block the keys are named under (``actor.lora``, ``critic.lora``)."""
    from safetensors import safe_open

    path = Path(path)
    config = json.loads((path / PEFT_CONFIG).read_text())
    found: list[tuple[str, str]] = []

    def refuse(key: str, why: str) -> None:
        found.append((key, f"{path}: {why}"))

    if config.get("peft_type", "LORA") != "LORA":
        refuse(f"{key}.init_from", f"peft_type {config.get('peft_type')!r} in {PEFT_CONFIG}: only LORA adapters load")
    if config.get("r") != lora.rank:
        refuse(f"{key}.rank", f"r={config.get('r')} in {PEFT_CONFIG}, but {key}.rank={lora.rank}")
    if float(config.get("lora_alpha", 0)) != float(lora.alpha):
        refuse(f"{key}.alpha", f"lora_alpha={config.get('lora_alpha')} in {PEFT_CONFIG}, but {key}.alpha={lora.alpha}")
    if bool(config.get("use_rslora", False)) != bool(lora.use_rslora):
        refuse(
            f"{key}.use_rslora",
            f"use_rslora={config.get('use_rslora', False)} in {PEFT_CONFIG}, but {key}.use_rslora={lora.use_rslora} "
            "(the adapter's output scale, alpha / sqrt(r) or alpha / r, must be the one it was trained with)",
        )
    unsupported = {
        "rank_pattern": "ranks per module",
        "alpha_pattern": "alphas per module",
        "use_dora": "DoRA's magnitude vectors",
        "modules_to_save": "fully trained modules beside the adapters",
        "fan_in_fan_out": "transposed (Conv1D) weights",
        "lora_bias": "biases on lora_B",
    }
    for setting, what in unsupported.items():
        if config.get(setting):
            refuse(
                f"{key}.init_from",
                f"{setting}={config[setting]!r} in {PEFT_CONFIG}: {what}, which megarl's adapters do not hold",
            )
    if config.get("bias", "none") != "none":
        refuse(
            f"{key}.init_from",
            f"bias={config['bias']!r} in {PEFT_CONFIG}: trained biases, which megarl's adapters do not hold",
        )
    with safe_open(str(path / PEFT_WEIGHTS), framework="pt") as f:
        names = [name for name in f.keys() if name.endswith(".lora_A.weight")]
    in_file = {hf_module(name) for name in names}
    target_modules = lora.target_modules
    wanted = covered_modules(target_modules) - (set(_MLP_MODULES) if moe else set())
    if in_file - wanted:
        refuse(
            f"{key}.target_modules",
            f"the adapter has modules {sorted(in_file - wanted)} that target_modules {list(target_modules)} leave out "
            f"(its modules: {sorted(in_file)}; name them to start from it)",
        )
    if moe is not None and wanted - in_file:
        refuse(
            f"{key}.target_modules",
            f"target_modules {list(target_modules)} adapt {sorted(wanted - in_file)}, which the adapter has no "
            f"weights for (its modules: {sorted(in_file)}; name those, by their HF names, to start from it)",
        )
    return found


def check_adapter_start(lora, multi_node: bool, moe: bool | None = None, key: str = "actor.lora") -> None:
    """``{key}.init_from`` (``actor.lora``'s, ``critic.lora``'s) is a PEFT adapter directory (an absolute path missing here is accepted on
    a multi-node cluster: the nodes may mount storage this machine does not) that adapters of ``lora``'s
    rank, alpha and targets can start from (:func:`adapter_problems`)."""
    if lora.init_from is None:
        return
    local = Path(lora.init_from).expanduser()
    if multi_node and local.is_absolute() and not local.exists():
        return
    if not (local / PEFT_CONFIG).is_file():
        found = "is a directory without it" if local.is_dir() else "is a file" if local.exists() else "does not exist"
        raise ConfigError(
            f"{key}.init_from",
            f"{lora.init_from!r} is invalid: expected a PEFT adapter directory with {PEFT_CONFIG} (as "
            f"PEFT's save_pretrained or MegatronEngine.export_adapters writes it); this path {found}",
        )
    problems = adapter_problems(local, lora, moe, key)
    if problems:
        problem_key, why = problems[0]
        more = "".join(f"; {k}: {w}" for k, w in problems[1:])
        raise ConfigError(problem_key, f"{why}{more}", related=(f"{key}.init_from",))
