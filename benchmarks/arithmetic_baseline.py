"""Starting reward of SmolLM2-135M-Instruct on the bundled arithmetic task, as training sees it.

A real vLLM-CPU server serves SmolLM2-135M-Instruct; every problem of both splits of
``megarl/data/arithmetic`` goes through ``RemoteInferenceEngine`` + ``RLVRWorkflow``
(chat template, ``arithmetic_reward_fn`` in a worker process), ``n_samples`` answers each,
at the sampling settings of training (temperature 1, top_p 1). One row per
(split, operator) and one per split: mean reward, its standard error over prompts, the
share of prompts whose group has mixed rewards (a GRPO group with a learning signal),
mean completion tokens and the share cut off at ``max_new_tokens``.

A last row rolls out the test split again with one worked example turn before the
question (``2 + 3`` answered ``2 + 3 = 5``): it shows what the model scores once it
writes the equation, i.e. the room RL has by learning the answer format alone.

``--quick`` rolls out 16 test problems with 2 samples each (a smoke test).
"""

from __future__ import annotations

import statistics

from benchmarks._harness import main_for
from megarl.data.arithmetic import OPS, PROMPT

TITLE = "Arithmetic task: SmolLM2-135M-Instruct starting reward (vLLM-CPU, RLVRWorkflow)"
MAX_NEW_TOKENS = 32
N_SAMPLES = 4
TEMPERATURE = 1.0
TOP_P = 1.0
DEMO = [
    {"role": "user", "content": PROMPT.format(a=2, op="+", b=3)},
    {"role": "assistant", "content": "2 + 3 = 5"},
]


def _rollout(engine, workflow, rows: list[dict], n_samples: int) -> dict[str, list]:
    """Per prompt: its samples' rewards and completion lengths (row order kept)."""
    batch = engine.rollout_batch(rows, workflow)
    rewards = batch["rewards"].view(len(rows), n_samples)
    lengths = batch["loss_mask"].sum(dim=1).view(len(rows), n_samples)
    return {"rewards": rewards.tolist(), "lengths": lengths.tolist()}


def _summary(rewards: list[list[float]], lengths: list[list[int]], max_new_tokens: int) -> dict:
    per_prompt = [statistics.fmean(r) for r in rewards]
    flat_len = [n for group in lengths for n in group]
    return {
        "prompts": len(rewards),
        "samples": len(flat_len),
        "mean_reward": statistics.fmean(per_prompt),
        "stderr": statistics.stdev(per_prompt) / len(per_prompt) ** 0.5 if len(per_prompt) > 1 else None,
        "mixed_groups": statistics.fmean(float(0 < sum(r) < len(r)) for r in rewards),
        "mean_completion_tokens": statistics.fmean(flat_len),
        "truncated": statistics.fmean(float(n >= max_new_tokens) for n in flat_len),
    }


def _measure(engine, workflow, splits: dict[str, int | None], n_samples: int) -> dict[tuple[str, str], dict]:
    """Roll out the first ``limit`` rows of each split, one batch per operator, then the
    test rows again behind the worked example; results keyed by (split, op)."""
    from megarl.data import load_rl_dataset

    results = {}
    for split, limit in splits.items():
        rows = [dict(r) for r in load_rl_dataset("arithmetic", split, type="chat")][:limit]
        for op in sorted({r["op"] for r in rows}):
            results[split, op] = _rollout(engine, workflow, [r for r in rows if r["op"] == op], n_samples)
        if split == "test":
            demo = [{**r, "messages": DEMO + r["messages"]} for r in rows]
            results[split, "one-shot demo"] = _rollout(engine, workflow, demo, n_samples)
    return results


def run(quick: bool) -> list[dict]:
    from transformers import AutoTokenizer

    from megarl.api.io_struct import GenerationHyperparameters
    from megarl.config.rollout import InferenceEngineConfig, VLLMConfig
    from megarl.models import resolve_model_path
    from megarl.reward.arithmetic import arithmetic_reward_fn
    from megarl.rollout import RemoteInferenceEngine
    from megarl.serving import InferenceServer, vllm_launch_spec
    from megarl.utils.network import find_free_ports
    from megarl.workflow import RLVRWorkflow

    n_samples = 2 if quick else N_SAMPLES
    splits = {"test": 16} if quick else {"test": None, "train": None}
    model = resolve_model_path("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(model)
    gconfig = GenerationHyperparameters(
        n_samples=n_samples, max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE, top_p=TOP_P
    )
    vconfig = VLLMConfig(max_model_len=1024, max_num_seqs=64)
    spec = vllm_launch_spec(vconfig, model, "127.0.0.1", find_free_ports(1)[0], insecure=True)  # loopback, no key
    with InferenceServer(spec, name="bench-vllm").start() as server:
        server.wait_until_healthy(vconfig.startup_timeout)
        config = InferenceEngineConfig(max_concurrent_rollouts=16, max_staleness=10**6)
        engine = RemoteInferenceEngine(config).initialize(server_addrs=[server.address], batch_size=16)
        workflow = RLVRWorkflow(arithmetic_reward_fn, gconfig, tokenizer, reward_max_workers=1)
        try:
            results = _measure(engine, workflow, splits, n_samples)
        finally:
            workflow.close()
            engine.destroy()
    return _rows(results, gconfig)


def _rows(results: dict[tuple[str, str], dict[str, list]], gconfig) -> list[dict]:
    settings = {
        "n_samples": gconfig.n_samples,
        "max_new_tokens": gconfig.max_new_tokens,
        "temperature": gconfig.temperature,
        "top_p": gconfig.top_p,
    }
    rows = []
    for split in dict.fromkeys(s for s, _ in results):
        ops = [op for s, op in results if s == split and op in OPS]
        for op in ops:
            r = results[split, op]
            rows.append({"split": split, "op": op, **_summary(**r, max_new_tokens=gconfig.max_new_tokens)})
        rewards = [g for op in ops for g in results[split, op]["rewards"]]
        lengths = [g for op in ops for g in results[split, op]["lengths"]]
        summary = _summary(rewards, lengths, gconfig.max_new_tokens)
        rows.append({"split": split, "op": "all", **summary, **settings, "prompt": PROMPT})
    demo = results["test", "one-shot demo"]
    rows.append(
        {"split": "test", "op": "all, one-shot demo", **_summary(**demo, max_new_tokens=gconfig.max_new_tokens)}
    )
    return rows


if __name__ == "__main__":
    main_for(__name__)
