"""Config loading and allocation-mode parsing cost (proves the benchmark harness).

Both run once per process start, so they must stay in the milliseconds; this
guards against, say, an import-heavy validation creeping in.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from benchmarks._harness import main_for
from megarl.config import AllocationMode, GRPOConfig, validate_allocation
from megarl.run.prelaunch import load_expr_config

TITLE = "Config load (YAML + overrides + validation) and allocation-mode parse"
CPU_YAML = str(Path(__file__).resolve().parent.parent / "configs" / "gsm8k_grpo_cpu.yaml")
ALLOCATIONS = [
    ("vllm:d1t1+megatron:d1p1t1", 1, 2),
    ("vllm:d48t2+megatron:d4p2t4", 16, 8),
    ("sglang:d16t8+megatron:d8p4t4e8et1", 32, 8),
]


def _time(fn, iterations: int) -> dict:
    fn()  # warm caches (imports, OmegaConf schema) outside the measurement
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    samples.sort()
    return {
        "iterations": iterations,
        "mean_us": statistics.fmean(samples),
        "p50_us": samples[len(samples) // 2],
        "p99_us": samples[min(len(samples) - 1, int(len(samples) * 0.99))],
    }


def run(quick: bool) -> list[dict]:
    n_config, n_alloc = (5, 200) if quick else (50, 5000)
    argv = ["--config", CPU_YAML, "actor.optimizer.lr=2e-6", "gconfig.n_samples=8"]
    rows = [
        {
            "case": "load_expr_config(gsm8k_grpo_cpu.yaml + 2 overrides)",
            **_time(lambda: load_expr_config(argv, GRPOConfig), n_config),
        }
    ]
    for spec, nodes, per_node in ALLOCATIONS:

        def parse_and_validate(spec=spec, nodes=nodes, per_node=per_node):
            validate_allocation(AllocationMode.from_str(spec), n_nodes=nodes, n_gpus_per_node=per_node)

        rows.append({"case": f"parse+validate {spec} on {nodes}x{per_node}", **_time(parse_and_validate, n_alloc)})
    return rows


if __name__ == "__main__":
    main_for(__name__)
