"""Async vs sync at 128 GPUs, simulated from the planner's rates: max_staleness 0, 1, 2 and 4.

The run simulated is the planner's first choice for ``configs/gsm8k_grpo_qwen2.5-7b_128gpu.yaml``
under the ASSUMED H100 rates of ``benchmarks/plan_rates_h100_qwen2.5-7b.yaml``
(``benchmarks/results/plan_128gpu.md``): ``vllm:d64t1+megatron:d16p1t4``, 256 prompts x 16 samples
a step, 150 prompt + 300 generated tokens on average, at most 1,024. The numbers are only as good
as those rates: none is measured on a GPU cluster.

**A slice with the full run's per-server load.** 8 simulated servers (1/8 of the 64) and 1/8 of the
batch: 512 episodes a step (one sample each, :class:`~benchmarks.scale_sim.ItemWorkflow`), with
``rollout.max_concurrent_rollouts = 512``, so each server runs 64 requests at once, as each of the 64
does in the full run (the planner's server rate is for that concurrency). Not modelled: GRPO groups
(in the bundled config an episode is a group of 16 samples, handed over when its longest ends, and
``max_concurrent_rollouts: 512`` counts groups per data-parallel head), a single pool for the slice
(the full run has one per trainer DP head, 16), and everything a simulated server leaves out
(KV-cache pressure, preemption, prefill cost beyond a fixed delay, network latency). Each staleness
bound runs in its own process: ``warm-up`` steps (``s + 1``: a
deeper bound takes that many steps to fill its buffer of ready trajectories; before, its idle shares
and staleness are a transient), then the measured steps, each in ``megarl.train.rl_step``'s order
(as ``benchmarks/scale_sim.py`` drives one):

1. ``DistRolloutCoordinator.prepare_batch`` on megarl's own ``RemoteInferenceEngine`` (pool,
   staleness control with ``max_staleness = s``, interruptible generation), **real**;
2. the train phase: a **sleep** of the planner's ``train_seconds`` for the full layout (6.3 s: 1/8 of
   the tokens on 1/8 of the trainer take the same time);
3. the planner's ``overhead_s`` (1.0 s: hand-off, advantages, logging): a **sleep** in full
   (megarl's real hand-off, concatenating the batch, takes milliseconds and lies in step 1's wait;
   advantages and logging are not run);
4. ``WeightSync.update_weights`` in disk mode, **real** (a one-rank Megatron trainer of a tiny model
   writes the checkpoint; pause, every server's update and commit, resume), with each server's
   receive **simulated** as the planner's bytes / rate part (15.2 GB at 5 GB/s = 3.04 s,
   ``sim_host.WeightLoad``) and the planner's fixed part (2.0 s: pause, commit, resume) **slept**
   while the servers are paused, less what megarl's own update took beyond the receive (its median
   over the previous updates: the checkpoint write and the control calls; the row reports it). The
   consistency probe is off: the planner has no term for it.

**The servers** (``tests/scale/sim_host.py``: continuous batching, ``peak * c / (c + half)`` tokens/s
shared by the ``c`` running requests) are fitted to the planner's TP-1 rate: 5,000 tokens/s at the
workload's 64 requests a server. Peak 12,500 tokens/s (the top of the public figures the rates file
cites, taken as saturation) and ``half_concurrency`` 96 give exactly that (12.8 ms a token per
request at 64) and 7.8 ms a token for a request alone. The planner's other server number,
``token_latency_s`` = 30 ms a token for the longest sample of a synchronous step, cannot hold with
it: a continuous-batching server's requests decode faster as its batch drains, never slower than at
64, so a 1,024-token sample takes 13.1 s at most, not 30.7. The row of ``max_staleness`` 0 shows the
synchronous rollout the simulation gives instead, and the summary the planner's speedup with that
tail. A request's first token comes 50 ms after it arrives (prefill of a 150-token prompt).

**Answer lengths**: log-normal, sigma 1.0 (a long tail: 5% of the answers reach the 1,024 cap), its
mean chosen so that the capped mean is the planner's 300 generated tokens (336 before the cap).
Prompts are 150 tokens (they seed each answer's length).

Per bound, a row: the step's median seconds and steps per hour, the inference side's idle share
(server-time with no request, paused included; the paused share and the tokens generated over the
servers' rated 5,000 tokens/s beside it), the trainer's (1 - train sleep / wall), the histogram of
the consumed trajectories' staleness (the trainer's version when the batch is handed over minus the
oldest version among a trajectory's generated tokens, the version it started under: what the pool
checks against the bound), and the planner's prediction (``megarl.plan.predict``) and speedups
over ``max_staleness`` 0 beside the simulation's.

Real time, no compression: about 10 minutes on an otherwise idle 2-core machine (``--quick``: 2
servers, 1 + 2 steps per bound, every time scaled by :data:`QUICK_SCALE`, about 2 minutes; its times
are reported divided by it, megarl's own real costs with them, so they read 5x too large there).
The simulated servers and megarl's side must not compete for the cores with other work: the
``client cores``, ``hosts cores`` and ``pool loop lag ms`` columns show whether they did.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks._harness import REPO, main_for

TITLE = (
    "Async vs sync at 128 GPUs (Qwen2.5-7B, vllm:d64t1+megatron:d16p1t4), simulated from the planner's "
    "ASSUMED H100 rates: steps/hour, idle shares, staleness, planner beside"
)
RATES_FILE = REPO / "benchmarks" / "plan_rates_h100_qwen2.5-7b.yaml"
LAYOUT = "vllm:d64t1+megatron:d16p1t4"
STALENESS = (0, 1, 2, 4)
SERVERS, SERVERS_QUICK = 8, 2
STEPS, STEPS_QUICK = 5, 2
QUICK_SCALE = 0.2
"""``--quick``: every simulated time (train, overhead, sync, decode, prefill) times this."""
PROMPT_LEN = 150
SIGMA = 1.0
PEAK_TOKENS_PER_S = 12_500.0
"""One server's throughput at saturation (the fit: see the module doc)."""
TTFT_S = 0.05
AREAL_SPEEDUP = 2.77
"""AReaL's reported best speedup of asynchronous over synchronous RL (arXiv 2505.24298)."""


# ------------------------------------------------------------------------------------ the planner's side


def plan_inputs():
    """The rates, the workload (the rates file's: the bundled config's) and the layout."""
    from megarl.config.allocation import AllocationMode
    from megarl.plan import load_rates

    rates = load_rates(RATES_FILE)
    return rates, rates.workload, AllocationMode.from_str(LAYOUT)


def planner_step(max_staleness: int, rates=None) -> float:
    """The planner's predicted step seconds for the layout at ``max_staleness``."""
    from megarl.plan import predict

    base, work, alloc = plan_inputs()
    return predict(rates or base, work, alloc, max_staleness).step_s


def per_server() -> int:
    """Requests a server runs at once in the full run: one step's samples over the servers."""
    _, work, alloc = plan_inputs()
    return work.prompts * work.samples // alloc.inference.dp


def capped_mean(mean: float, sigma: float, cap: float) -> float:
    """The mean of ``min(X, cap)`` for X log-normal with ``mean`` and ``sigma``."""
    from statistics import NormalDist

    phi = NormalDist().cdf
    mu = math.log(mean) - sigma**2 / 2
    z = (math.log(cap) - mu) / sigma
    return mean * phi(z - sigma) + cap * (1 - phi(z))


def answer_mean(target: float, sigma: float, cap: float) -> float:
    """The log-normal's mean whose capped mean is ``target`` (bisection)."""
    lo, hi = target, 10 * cap
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if capped_mean(mid, sigma, cap) < target else (lo, mid)
    return (lo + hi) / 2


def serving_model(scale: float = 1.0):
    """One server fitted to the planner's TP-1 rate at the workload's concurrency (module doc), its
    times times ``scale``."""
    from tests.scale.sim_host import ServingModel

    rates, work, _ = plan_inputs()
    c = per_server()
    rate = rates.server[1].tokens_per_s
    half = c * (PEAK_TOKENS_PER_S / rate - 1)  # peak * c / (c + half) == rate
    mean = answer_mean(work.gen_tokens, SIGMA, work.max_new_tokens)
    return ServingModel(PEAK_TOKENS_PER_S / scale, half, TTFT_S * scale, mean, SIGMA)


class PausedFixedCost:
    """The rollout side as the weight sync sees it (it delegates everything), with the planner's fixed
    sync part slept right after the servers are paused, less megarl's own share of it: the median,
    over the updates so far, of what an update took beyond the simulated receive and this sleep."""

    def __init__(self, rollout, fixed_s: float, receive_s: float):
        self._rollout, self.fixed_s, self.receive_s = rollout, fixed_s, receive_s
        self.own: list[float] = []
        self.slept = 0.0

    def pause(self, servers: bool = True) -> None:
        self._rollout.pause(servers)
        self.slept = max(0.0, self.fixed_s - (statistics.median(self.own) if self.own else 0.0))
        time.sleep(self.slept)

    def observe(self, sync_seconds: float) -> None:
        """An update took ``sync_seconds`` (pause to resume)."""
        self.own.append(max(0.0, sync_seconds - self.receive_s - self.slept))

    def __getattr__(self, name):
        return getattr(self._rollout, name)


# ------------------------------------------------------------------------------------ one bound


def measure(max_staleness: int, servers: int = SERVERS, warmup: int | None = None, steps: int = STEPS, scale=1.0):
    """One staleness bound on ``servers`` simulated servers: ``warmup`` (default ``max_staleness + 1``)
    then ``steps`` measured steps; times scaled by ``scale`` (reported divided by it)."""
    from megarl.models.tiny import make_tiny_model
    from tests.scale.sim_cluster import SimCluster
    from tests.scale.sim_host import WeightLoad

    logging.getLogger("megarl").setLevel(logging.ERROR)
    rates, _, _ = plan_inputs()
    load = WeightLoad(model_bytes=rates.model_bytes, bytes_per_s=rates.sync_bytes_per_s / scale, tp=1)
    warmup = max_staleness + 1 if warmup is None else warmup
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model("qwen2", Path(tmp) / "model")
        # no --model for the hosts: the probe is off, nothing scores, and a 2-core machine keeps its cores
        cluster = SimCluster(servers, PROMPT_LEN, serving=serving_model(scale), load=load)
        cluster.start()
        try:
            row = _drive(max_staleness, cluster, model_dir, Path(tmp), warmup, steps, scale)
        finally:
            cluster.stop()
    return row


def _drive(max_staleness: int, cluster, model_dir, tmp: Path, warmup: int, steps: int, scale: float) -> dict:
    from benchmarks.pool_load import CountingLoader
    from benchmarks.scale_sim import ItemWorkflow, LoopLag, _cpu_seconds, _trainer
    from megarl.config.bridge import WeightUpdateConfig
    from megarl.config.rollout import InferenceEngineConfig
    from megarl.plan import train_seconds
    from megarl.rollout import RemoteInferenceEngine
    from megarl.rollout.coordinator import DataParallelLayout, DistRolloutCoordinator
    from megarl.run.weight_sync import WeightUpdateMeta, connect_engine
    from megarl.utils import stats_tracker
    from megarl.utils.gc_pauses import freeze_startup_objects

    rates, work, alloc = plan_inputs()
    train_s = train_seconds(rates, work, alloc) * scale
    overhead_s = rates.overhead_s * scale
    batch_size = per_server() * cluster.n
    trainer = _trainer(model_dir)
    config = InferenceEngineConfig(max_concurrent_rollouts=batch_size, max_staleness=max_staleness)
    rollout = RemoteInferenceEngine(config, "vllm").initialize(
        server_addrs=cluster.addresses, batch_size=batch_size, vocab_size=trainer.desc.dims.vocab_size
    )
    coordinator = DistRolloutCoordinator(rollout, DataParallelLayout(0, 1, True), 1)
    update = WeightUpdateConfig(mode="disk", disk_path=str(tmp / "updates"), probe_sequences=0)
    control = PausedFixedCost(rollout, rates.sync_fixed_s * scale, cluster.load.seconds)
    sync = connect_engine(trainer, control, WeightUpdateMeta(update))
    freeze_startup_objects()  # as megarl.train does once the trainer is built
    loader, workflow = CountingLoader(batch_size), ItemWorkflow(PROMPT_LEN, work.max_new_tokens)
    starts, waits, syncs, own, staleness = [], [], [], [], collections.Counter()
    client, hosts = psutil.Process(), [psutil.Process(p.pid) for p in cluster.processes]
    lag = None
    try:
        for step in range(warmup + steps):
            measured = step >= warmup
            if step == warmup:
                before, cpu_before = cluster.stats(), (_cpu_seconds([client]), _cpu_seconds(hosts))
                lag = LoopLag(rollout.pool.loop)
                lag.start_window()
            starts.append(time.monotonic())
            batch = coordinator.prepare_batch(loader, workflow)
            wait = time.monotonic() - starts[-1]
            if measured:
                waits.append(wait)
                staleness.update(_staleness(batch, rollout.get_version()))
            time.sleep(train_s)
            time.sleep(overhead_s)
            stats = sync.update_weights(WeightUpdateMeta(update, version=step + 1))
            control.observe(stats["sync_seconds"])
            if measured:
                syncs.append(stats["sync_seconds"])
                own.append(control.own[-1])
            stats_tracker.export(local=True)  # the step's stats, as rl_step exports them
        end = time.monotonic()
        after, cpu = cluster.stats(), (_cpu_seconds([client]) - cpu_before[0], _cpu_seconds(hosts) - cpu_before[1])
    finally:
        worst_lag = lag.stop()["loop_lag_ms"] / 1000 if lag is not None else math.nan
        rollout.destroy()
        trainer.destroy()
    steps_s = [b - a for a, b in zip(starts[warmup:], [*starts[warmup + 1 :], end])]
    wall = end - starts[warmup]
    alive = _delta(after, before, "alive_s")
    rated = cluster.serving.throughput(per_server()) * alive
    step = statistics.median(steps_s) / scale
    rows = sum(staleness.values())
    return {
        "max_staleness": max_staleness,
        "servers": cluster.n,
        "episodes/step": batch_size,
        "steps (warm-up + measured)": f"{warmup} + {steps}",
        "step s": step,
        "steps/hour": 3600 / step,
        "rollout wait s": statistics.median(waits) / scale,
        "sync s": statistics.median(syncs) / scale,
        "megarl own sync s (real)": statistics.median(own),
        "inference idle": 1 - _delta(after, before, "busy_s") / alive,
        "servers paused": 1 - _delta(after, before, "unpaused_s") / alive,
        "tokens / rated": _delta(after, before, "tokens") / rated,
        "trainer idle": 1 - steps * train_s / wall,
        "staleness hist": " ".join(f"{k}:{staleness[k]}" for k in sorted(staleness)),
        "mean staleness": sum(k * n for k, n in staleness.items()) / max(1, rows),
        "planner step s": planner_step(max_staleness),
        # is the machine fast enough for the simulation? the trainer's process (pool, coordinator, weight
        # sync), the simulated servers, and how late a 50 ms sleep on the pool's event loop woke at worst
        "client cores": cpu[0] / wall,
        "hosts cores": cpu[1] / wall,
        "pool loop lag ms": 1000 * worst_lag,
    }


def _staleness(batch: dict, version: int) -> list[int]:
    """Each row's staleness: ``version`` minus the oldest version among its generated tokens."""
    versions = batch["versions"]  # -1 on the prompt and the padding
    oldest = versions.masked_fill(versions < 0, versions.max().item() + 1).min(dim=1).values
    return [version - int(v) for v in oldest.tolist()]


def _delta(after: list[dict], before: list[dict], key: str) -> float:
    return sum(a[key] - b[key] for a, b in zip(after, before))


def _in_own_process(max_staleness: int, servers: int, warmup: int | None, steps: int, scale: float) -> dict:
    """:func:`measure` in a fresh process: its torch.distributed group and its resources are its own."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(measure, max_staleness, servers, warmup, steps, scale).result()


# ------------------------------------------------------------------------------------ the table


def run(quick: bool, on_rows=None) -> list[dict]:
    """One row per bound of :data:`STALENESS`, each in its own process; speedups over the first (0)."""
    rows = []
    for s in STALENESS:
        if quick:
            row = _in_own_process(s, SERVERS_QUICK, 1, STEPS_QUICK, QUICK_SCALE)
        else:
            row = _in_own_process(s, SERVERS, None, STEPS, 1.0)
        rows.append(row)
        _speedups(rows)
        if on_rows is not None:
            on_rows(rows)
    return rows


FIRST_COLUMNS = (
    "max_staleness",
    "step s",
    "planner step s",
    "sim speedup",
    "planner speedup",
    "sim / planner",
    "sim / AReaL 2.77x",
    "steps/hour",
)


def _speedups(rows: list[dict]) -> None:
    """Each row's speedups over the first (max_staleness 0), simulated and predicted, beside its step."""
    sync = rows[0]
    for i, row in enumerate(rows):
        row["sim speedup"] = sync["step s"] / row["step s"]
        row["planner speedup"] = sync["planner step s"] / row["planner step s"]
        row["sim / planner"] = row["sim speedup"] / row["planner speedup"]
        row["sim / AReaL 2.77x"] = row["sim speedup"] / AREAL_SPEEDUP
        rows[i] = {**{k: row[k] for k in FIRST_COLUMNS}, **{k: v for k, v in row.items() if k not in FIRST_COLUMNS}}


def summary(rows: list[dict]) -> str:
    """The speedup at max_staleness 2, sim vs planner, and the planner with the simulated tail."""
    from megarl.plan import ServerRate

    at = {r["max_staleness"]: r for r in rows}
    if 0 not in at or 2 not in at:
        return "(max_staleness 0 or 2 missing: no summary)"
    sync, two = at[0], at[2]
    rates, work, alloc = plan_inputs()
    diff = two["sim speedup"] / two["planner speedup"] - 1
    # the synchronous rollout the simulation gives, as the planner's latency term would have to say it
    latency = sync["rollout wait s"] / work.max_new_tokens
    server = {**rates.server, 1: ServerRate(rates.server[1].tokens_per_s, latency)}
    fitted = dataclasses.replace(rates, server=server)
    refit = planner_step(0, fitted) / planner_step(2, fitted)
    return (
        f"At max_staleness 2 the simulated speedup over synchronous (max_staleness 0) is {two['sim speedup']:.2f}x "
        f"and the planner's {two['planner speedup']:.2f}x: {diff:+.0%} (goal: within 15%, "
        f"{'met' if abs(diff) <= 0.15 else 'not met'}). What decides it is the synchronous step's tail: the planner "
        f"waits max_new_tokens x token_latency_s = {work.max_new_tokens} x "
        f"{rates.server[1].token_latency_s * 1e3:.0f} ms = {work.max_new_tokens * rates.server[1].token_latency_s:.1f} s "
        f"for the longest sample, the simulated servers (5,000 tokens/s at 64 requests, faster per request as "
        f"the batch drains) {sync['rollout wait s']:.1f} s, i.e. {latency * 1e3:.1f} ms a token; with that "
        f"token_latency_s the planner predicts {refit:.2f}x. AReaL reports up to {AREAL_SPEEDUP}x "
        f"(sim: {two['sim speedup'] / AREAL_SPEEDUP:.0%} of it) on long chain-of-thought math and code, "
        "whose answers run to tens of thousands of tokens and whose synchronous steps wait on the longest; "
        f"here answers average {work.gen_tokens:.0f} tokens capped at {work.max_new_tokens}, and the "
        f"asynchronous step is bound by training ({two['planner step s']:.1f} s predicted: train, then a weight "
        "sync and overhead that nothing overlaps), so the synchronous step has less to lose."
    )


if __name__ == "__main__":
    main_for(__name__)
