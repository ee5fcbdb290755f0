"""megarl's control plane in front of N simulated inference servers (8, 64, 256, 1,024): does it keep up?

The servers are ``tests/scale/sim_host.py`` (64 per process, each its own HTTP endpoint speaking
vLLM's routes and megarl's update route, with continuous batching, log-normal answer lengths and a
weight-load time). In front of them runs megarl's own code, unmodified: ``RemoteInferenceEngine``
(pool, runner, staleness control, server set, health checks), ``DistRolloutCoordinator.prepare_batch``,
and ``connect_engine`` / ``WeightSync.update_weights``, on 1 to 16 trainer heads (Megatron ranks of a
gloo world, each with its own pool) of a small model, in ``sharded`` mode by default (every simulated
server's workers join the trainer's group and receive their slices of each update over it; then the
load takes ``model_bytes / (tp * bytes_per_s)``) or ``disk``; the consistency probe's answers come
from a real HF model of the weights each server was sent. The trainer does not train: a step is
``prepare_batch``, then ``TRAIN_S`` (the check of the batch's rows, Python holding the interpreter lock
for ``TRAIN_GIL_SHARE`` of it, then sleep), then the weight update, with the probe every second update,
as ``megarl.train.rl_step`` orders them. The servers answer at a real head's request rate
(:func:`head_request_rate`).

Per size, in its own process (so that resources are the size's own), then (not ``--quick``) once
per fault of :data:`FAULTS` at :data:`FAULT_SERVERS` servers:

* ``pool_share``: tokens the servers generated over what they could have, each at the concurrency
  the pool is configured to give it (``PER_SERVER`` requests), between weight syncs (``pool_share_all``:
  over the whole run, syncs and probes included, while not paused);
* ``update_overhead_s``: the update's control time: its calls from the first to every server's
  commit (``sync_seconds``: the probe comes after it), minus the simulated receive and the trainer's
  send (``send_seconds``); ``pause_s``, ``commit_s`` and ``resume_s`` are three of its parts;
* ``calls_per_server_per_update``, ``trainer_cpu_s_per_update``, ``process_cpu_s_per_update``: the
  control calls each server got in an update without a probe, and the CPU seconds in it of the
  trainer process's threads but the pool's loop (the data's own sending aside: ``send_cpu_s_per_update``,
  gloo's copies over loopback), and of the whole process;
* ``probe_s``: the consistency probe (every server scores 2 sequences);
* the rollout process's peak RSS, open file descriptors and threads, the pool loop's worst and 99th
  percentile lag (how late a 50 ms sleep on it wakes, in the window of the other columns: from the end
  of the first batch, which starts the pool; ``loop_lag_p99_ms/batch``, ``/train``, ``/update``: in
  each phase of the step), the generation requests per second it
  sustained and the CPU time it spent per request (the trainer's process: pool, coordinator, weight
  sync; ``pool_loop_cpu_ms/request``: the pool's loop thread alone), and how many cores the simulated servers took (on a small machine they compete with the
  process under test);
* the books, as ``benchmarks/pool_load.py`` keeps them: items fed = handed out + counted drops +
  stale not rerun + pending, no id twice, every row token by token what its server generated.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil

from benchmarks._harness import main_for

TITLE = "Control plane at N simulated servers: pool throughput, weight-update overhead, probe, resources"
SIZES_QUICK = (8, 64)
SIZES = (8, 64, 256, 1024)
PROMPT_LEN = 8
MAX_NEW_TOKENS = 1024
PER_SERVER = 8
"""Episodes in flight per server (``max_concurrent_rollouts = PER_SERVER * N``)."""
STEPS, STEPS_QUICK = 4, 3
TRAIN_S = 1.0
TRAIN_GIL_SHARE = 0.5
"""Share of the train phase in which the trainer's Python holds the interpreter lock (an assumption:
a real step's Python between its kernels; the rest releases it)."""
RECEIVE_S = 0.5
"""The simulated weight load per server (``model_bytes / (tp * bytes_per_s)``)."""


SIM_MODEL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "tie_word_embeddings": True,
}
"""The trainer's model: a Qwen2 of the simulated servers' vocabulary, 42 k parameters (0.17 MB per worker
and update in float32, sent for real in ``sharded`` mode over loopback, whose copies take this machine's
CPU as NCCL's would not; the simulated receive time stands for a real model's)."""

REAL_SERVER_TOKENS_PER_S = 5000.0
"""A real server's generated tokens/s: the planner's rate for one TP-1 H100 vLLM server of Qwen2.5-7B
(``benchmarks/plan_rates_h100_qwen2.5-7b.yaml``, ``server.t1``), the bundled 128-GPU config's servers."""
REAL_HEADS = 16
"""That config's trainer heads (``megatron:d16p1t4``): each head's rollout pool sends its share of the requests."""
HALF_CONCURRENCY = 16.0


def head_request_rate(mean_tokens: float = 300.0) -> float:
    """Generation requests per second one head's pool sends each server in a real cluster of the bundled
    128-GPU layout: the server's rate in answers (of ``mean_tokens``), shared by its :data:`REAL_HEADS`."""
    return REAL_SERVER_TOKENS_PER_S / mean_tokens / REAL_HEADS


def serving_model(mean_tokens: float = 300.0):
    """Simulated servers that, at the pool's :data:`PER_SERVER` requests each, answer at
    :func:`head_request_rate`: the process under test is one head of a real cluster, at its real rate."""
    from tests.scale.sim_host import ServingModel

    tokens_per_s = head_request_rate(mean_tokens) * mean_tokens  # at PER_SERVER requests in flight
    peak = tokens_per_s * (PER_SERVER + HALF_CONCURRENCY) / PER_SERVER
    return ServingModel(
        peak_tokens_per_s=peak, half_concurrency=HALF_CONCURRENCY, ttft_s=0.02, mean_tokens=mean_tokens, sigma=0.6
    )


def weight_load(tp: int = 1):
    """Each of a server's ``tp`` workers loads its part in :data:`RECEIVE_S`."""
    from tests.scale.sim_host import WeightLoad

    return WeightLoad(model_bytes=RECEIVE_S * 25e9 * tp, bytes_per_s=25e9, tp=tp)


class ItemWorkflow:
    """One generation per item, its prompt made of the item's id (so every answer's length differs);
    the reward is the id, to follow items through the pool."""

    def __init__(self, prompt_len: int, max_new_tokens: int):
        from megarl.api.io_struct import GenerationHyperparameters

        self.gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=max_new_tokens, temperature=1.0)
        self.prompt_len = prompt_len

    def prompt(self, item: int) -> list[int]:
        return [11 + (item >> (7 * i)) % 128 for i in range(self.prompt_len)]

    async def arun_episode(self, engine, data):
        from megarl.api.io_struct import ModelRequest
        from megarl.api.trajectory import make_trajectory

        resp = await engine.agenerate(ModelRequest(input_ids=self.prompt(data["id"]), gconfig=self.gconfig))
        resp.check_aligned()
        return make_trajectory(
            resp.input_tokens, resp.output_tokens, resp.output_logprobs, resp.output_versions, float(data["id"])
        )


def row_is_clean(input_ids: list[int], logprobs: list[float], prompt_len: int) -> bool:
    """A generated row is what the simulated server generates: ``token_at`` / ``logprob_at`` of each
    position, the last token EOS when the answer stopped there."""
    from tests.rollout.fake_server import EOS, logprob_at, token_at

    out = input_ids[prompt_len:]
    for i, token in enumerate(out):
        p = prompt_len + i
        want = EOS if (i == len(out) - 1 and token == EOS) else token_at(p, 0)
        if token != want or abs(logprobs[prompt_len + i] - logprob_at(p)) > 1e-6:
            return False
    return bool(out)


class LoopLag:
    """How late a 50 ms sleep on an event loop (another thread's) wakes, sampled until stopped, each
    sample under the step's phase (``phase``: ``batch``, ``train`` or ``update``, set by the driver);
    samples before :meth:`start_window` (the first batch, which starts the pool) are not kept."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.lags: dict[str, list[float]] = {}
        self.phase: str | None = None  # None: outside the window
        self._stop = threading.Event()
        self._future = asyncio.run_coroutine_threadsafe(self._watch(), loop)

    def start_window(self) -> None:
        self.phase = "train"

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            start, phase = loop.time(), self.phase
            await asyncio.sleep(0.05)
            if phase is not None:
                self.lags.setdefault(phase, []).append(loop.time() - start - 0.05)

    def stop(self) -> dict[str, float]:
        """The worst lag and the 99th percentile, overall and per phase, in milliseconds."""
        self._stop.set()
        try:
            self._future.result(timeout=60)
        except concurrent.futures.TimeoutError:  # the loop is that late: the samples so far say so
            self._future.cancel()
        every = [lag for lags in self.lags.values() for lag in lags]
        row = {"loop_lag_ms": 1000 * max(every, default=0.0), "loop_lag_p99_ms": _p99(every)}
        for phase, lags in self.lags.items():
            row[f"loop_lag_p99_ms/{phase}"] = _p99(lags)
        return row


def _p99(lags: list[float]) -> float:
    lags = sorted(lags) or [0.0]
    return 1000 * lags[min(len(lags) - 1, int(0.99 * len(lags)))]


def _trainer(model_dir: Path, rank: int = 0, heads: int = 1, port: int | None = None):
    """Trainer rank ``rank`` of ``heads`` (a Megatron engine of the tiny model, data-parallel over the
    heads: each rank is a head, as in ``megatron:d<heads>p1t1``); ``port``: the group's (None: a free
    one, for one rank alone: this runs in a fresh process, whose inherited MASTER_PORT may be another's)."""
    from megarl.actor.engine import MegatronEngine
    from megarl.config.train import OptimizerConfig, TrainEngineConfig
    from megarl.utils.network import find_free_port

    port = port if port is not None else find_free_port()

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(heads), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    engine = MegatronEngine(TrainEngineConfig(path=str(model_dir), dtype="float32", optimizer=OptimizerConfig(lr=1e-5)))
    engine.create_process_group(f"d{heads}p1t1")
    engine.initialize()
    return engine


def head_concurrency(n: int, rank: int, heads: int) -> int:
    """Episodes in flight in head ``rank``'s pool: the first head (the process under test) runs
    :data:`PER_SERVER` per server, at a real head's request rate; the others together one per server
    (their pools run the same code; the simulated servers share this machine's cores)."""
    return PER_SERVER * n if rank == 0 else max(4, -(-n // (heads - 1)))


def sync_config(mode: str, tmp: Path, straggler_floor_s: float | None, servers_per_group: int | None = None):
    """The weight update's config, the same on every head (``servers_per_group`` None: its default)."""
    from megarl.config.bridge import WeightUpdateConfig

    config = WeightUpdateConfig(mode=mode, disk_path=str(tmp / "updates"), probe_sequences=2, probe_tokens=16)
    if servers_per_group is not None:
        config.servers_per_group = servers_per_group
    config.dtype = "float32"
    config.probe_every, config.probe_topk = 2, 0  # the steady-state columns come from the updates between probes
    if straggler_floor_s is not None:
        config.straggler_floor_s = straggler_floor_s
    return config


class Head:
    """One trainer head: its Megatron rank, its rollout pool, coordinator and weight sync (megarl's
    code as ``megarl.train`` builds it for a DP head; batches are not exchanged between heads)."""

    def __init__(self, rank: int, heads: int, port: int, cluster: dict, run_dir: Path, config):
        from benchmarks.pool_load import CountingLoader, IdBitmap
        from megarl.rollout import RemoteInferenceEngine
        from megarl.rollout.coordinator import DataParallelLayout, DistRolloutCoordinator
        from megarl.run.weight_sync import WeightUpdateMeta, connect_engine
        from tests.rollout.conftest import fast_config

        concurrency = head_concurrency(len(cluster["addresses"]), rank, heads)
        self.rank, self.config = rank, config
        self.trainer = _trainer(Path(cluster["model_dir"]), rank, heads, port)
        pool_config = fast_config(max_concurrent_rollouts=concurrency, max_staleness=2, request_timeout=600.0)
        self.rollout = RemoteInferenceEngine(pool_config, cluster["dialect"]).initialize(
            server_addrs=cluster["addresses"],
            batch_size=concurrency,
            vocab_size=self.trainer.desc.dims.vocab_size,
            dump_dir=run_dir,  # where the launcher records restarts and joins
        )
        self.coordinator = DistRolloutCoordinator(self.rollout, DataParallelLayout(rank, heads, True), 1)
        start = time.perf_counter()
        self.sync = connect_engine(self.trainer, self.rollout, WeightUpdateMeta(config, inference_tp=cluster["tp"]))
        self.connect_s = time.perf_counter() - start
        self.loader, self.workflow = CountingLoader(concurrency), ItemWorkflow(PROMPT_LEN, MAX_NEW_TOKENS)
        self.handed_out = IdBitmap()
        self.books = {"doubled": 0, "misaligned": 0, "dropped": 0, "stale": 0, "stale rerun": 0}

    def batch(self):
        return self.coordinator.prepare_batch(self.loader, self.workflow)

    def train(self, batch) -> None:
        """The step (:func:`_train` on the first head, whose Python holds the lock as a real step's
        does; the others check their rows and sleep), then the data-parallel ranks meet (a real step's
        gradient all-reduce): every head starts the update together."""
        import torch.distributed as dist

        if self.rank == 0:
            _train(batch, self.books, self.handed_out)
        else:
            _count_rows(batch, self.books, self.handed_out)
            time.sleep(TRAIN_S)
        dist.barrier()

    def update(self, version: int) -> dict:
        from megarl.run.weight_sync import WeightUpdateMeta
        from megarl.utils import stats_tracker

        stats = self.sync.update_weights(WeightUpdateMeta(self.config, version=version))
        _count_drops(stats_tracker.export(local=True), self.books)
        return stats

    def ledger(self) -> dict:
        """This head's books: items fed = handed out + counted drops + stale not rerun + pending + lost."""
        pending = len(self.rollout.pool.pending_items())
        stale = self.books["stale"] - self.books["stale rerun"]
        handed = self.handed_out.count
        return {
            "items fed": self.loader.fed,
            "handed out": handed,
            "dropped": self.books["dropped"],
            "stale not rerun": stale,
            "pending": pending,
            "lost": self.loader.fed - handed - self.books["dropped"] - stale - pending,
            "doubled": self.books["doubled"],
            "misaligned": self.books["misaligned"],
        }

    def close(self) -> None:
        self.rollout.destroy()
        self.trainer.destroy()


def _other_head(rank: int, heads: int, port: int, cluster: dict, run_dir: str, config, steps: int) -> None:
    """A head but the first, in its own process: the same steps, its books gathered by the first at the end."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.getLogger("megarl").setLevel(logging.ERROR)
    head = Head(rank, heads, port, cluster, Path(run_dir), config)
    try:
        for step in range(steps):
            head.train(head.batch())
            head.update(step + 1)
        dist.gather_object(head.ledger(), None, dst=0)
    finally:
        head.close()


def start_other_heads(heads: int, port: int, cluster: dict, run_dir: Path, config, steps: int) -> list:
    """Heads 1..``heads``-1, each in a fresh process (spawned: a trainer rank of its own)."""
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank in range(1, heads):
        args = (rank, heads, port, cluster, str(run_dir), config, steps)
        procs.append(ctx.Process(target=_other_head, args=args, daemon=False, name=f"sim-head-{rank}"))
        procs[-1].start()
    return procs


FAULTS = {
    "hang_update": "one server accepts the weight update and never answers (the default deadlines: evicted at the "
    "relative deadline, not after update_timeout)",
    "slow_pause": "one server's update call takes 120 s to pause (a slow /pause)",
    "slow_receive": "one server loads the weights 100x slower than the others (slow but alive)",
    "control_down": "one server's update call hangs before it pauses while its health check answers",
    "die_in_update": "5% of the servers die (nothing listens, connections dropped) during a weight update; "
    "the launcher restarts them in their slots right after",
    "straggler": "one server generates 10x slower than the rest",
    "burst_429": "a quarter of the servers answer their next 20 generation requests with HTTP 429",
    "join_leave": "16 servers join the run (megarl serve --join) and 16 others leave it, at once",
}
"""The faults ``measure`` can inject at step 1, and what each does."""


class FaultPlan:
    """Injects one of :data:`FAULTS` into the cluster at step 1, as the launcher and the servers would,
    and says which servers it hit."""

    def __init__(self, name: str | None, cluster, run_dir: Path):
        if name is not None and name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}; one of {sorted(FAULTS)}")
        self.name, self.cluster, self.run_dir, self.hit = name, cluster, run_dir, []
        self.timer: threading.Timer | None = None
        self.joined = None  # the SimCluster of the servers that joined

    def at_start(self) -> None:
        if self.name == "straggler":
            self.hit = [1]
            self.cluster.fault(1, slow=10.0)

    def before_update(self, step: int) -> None:
        n = self.cluster.n
        if step != 1 or self.name is None:
            return
        one = {
            "hang_update": {"hang_update": True},
            "slow_pause": {"pause_delay": 120.0},
            "slow_receive": {"receive_factor": 100.0},
            "control_down": {"control_down": True},
        }
        if self.name in one:
            self.hit = [n // 2]
            self.cluster.fault(self.hit[0], **one[self.name])
        elif self.name == "die_in_update":
            self.hit = list(range(1, n, 20))[: max(1, n // 20)]
            self.timer = threading.Timer(RECEIVE_S / 2, lambda: [self.cluster.fault(i, die=True) for i in self.hit])
            self.timer.start()
        elif self.name == "burst_429":
            self.hit = list(range(0, n, 4))
            for i in self.hit:
                self.cluster.queue_faults(i, ["429"] * 20)
        elif self.name == "join_leave":
            self._join_and_leave(16)

    def after_update(self, step: int) -> None:
        """The launcher restarts the servers that died, each in its slot, and records it."""
        from megarl.serving.restarts import append_record

        if step != 1 or self.name != "die_in_update":
            return
        self.timer.join()
        for i in self.hit:
            self.cluster.fault(i, restart=True)
            record = {"time": time.time(), "server": f"server-{i}", "address": self.cluster.addresses[i]}
            append_record(self.run_dir / "server_restarts.jsonl", {**record, "exit_code": -9, "restart": 1})

    def _join_and_leave(self, count: int) -> None:
        from megarl.serving.restarts import JOINS_FILE, append_record
        from tests.scale.sim_cluster import SimCluster

        c = self.cluster
        self.joined = SimCluster(count, c.prompt_len, c.dialect, c.model_dir, c.serving, c.load).start()
        for i, address in enumerate(self.joined.addresses):
            record = {"event": "join", "server": f"server-{c.n + i}", "address": address}
            append_record(self.run_dir / JOINS_FILE, record)
        self.hit = list(range(count))
        for i in self.hit:
            record = {"event": "leave", "server": f"server-{i}", "address": c.addresses[i]}
            append_record(self.run_dir / JOINS_FILE, record)

    def stop(self) -> None:
        if self.joined is not None:
            self.joined.stop()


def measure(
    n: int,
    steps: int,
    fault: str | None = None,
    mean_tokens: float = 300.0,
    dialect: str = "vllm",
    straggler_floor_s: float | None = None,
    heads: int = 1,
    mode: str = "sharded",
    tp: int = 1,
    servers_per_group: int | None = None,
) -> dict:
    """One row: ``heads`` trainer heads (pools, coordinators, weight syncs) driving ``n`` simulated
    servers of TP ``tp`` in update ``mode``, with one of :data:`FAULTS` at step 1 if ``fault`` names
    one (answers of ``mean_tokens`` on average), the servers speaking ``dialect`` (``vllm`` or
    ``sglang``); ``straggler_floor_s`` and ``servers_per_group``: the weight update's (None: its default)."""
    from megarl.models.tiny import make_tiny_model
    from megarl.utils.network import find_free_port
    from tests.rollout.fake_server import VOCAB_SIZE
    from tests.scale.sim_cluster import SimCluster

    # gloo connects the pairs that exchange messages only, as NCCL does at first use (a group of
    # 1,024 workers would otherwise open a million connections at once); inherited by hosts and heads
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    logging.getLogger("megarl").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        # at TP > 1 the model needs a query head per server worker (the KV head is replicated)
        shape = {**SIM_MODEL, "num_attention_heads": max(SIM_MODEL["num_attention_heads"], tp)}
        model_dir = make_tiny_model("qwen2", Path(tmp) / "model", vocab_size=VOCAB_SIZE, **shape)
        cluster = SimCluster(
            n, PROMPT_LEN, dialect, str(model_dir), serving=serving_model(mean_tokens), load=weight_load(tp)
        )
        cluster.start()
        faults = FaultPlan(fault, cluster, Path(tmp) / "run")
        config = sync_config(mode, Path(tmp), straggler_floor_s, servers_per_group)
        where = {"addresses": cluster.addresses, "model_dir": str(model_dir), "dialect": dialect, "tp": tp}
        port = find_free_port()
        others = start_other_heads(heads, port, where, faults.run_dir, config, steps)
        try:
            row = _drive(Head(0, heads, port, where, faults.run_dir, config), steps, cluster, faults)
        finally:
            for proc in others:
                proc.join(timeout=60)
                proc.kill()
            faults.stop()
            cluster.stop()
    per_group = config.group_servers(n) if mode != "disk" else None
    return {"servers": n, "tp": tp, "heads": heads, "mode": mode, "servers_per_group": per_group, **row}


def _drive(head: Head, steps: int, cluster, faults: FaultPlan) -> dict:
    """The first head's steps, measured; the others' books gathered at the end."""
    import torch.distributed as dist

    from megarl.utils.gc_pauses import freeze_startup_objects

    n = cluster.n
    freeze_startup_objects()  # as megarl.train does once the trainer is built
    proc = psutil.Process()
    peaks = {"rss_mb": 0.0, "fds": 0, "threads": 0}
    updates = []
    faults.at_start()
    hosts = [psutil.Process(p.pid) for p in cluster.processes]
    sending = SendCPU(head.sync.bridge)
    lag = LoopLag(head.rollout.pool.loop)
    try:
        before, start, synced = None, None, None
        between_syncs = []  # (counters after a weight sync, counters before the next)
        for step in range(steps):
            lag.phase = lag.phase and "batch"
            batch = head.batch()
            if step == 0:  # the first batch warms the pool up: the window starts here
                before, start = cluster.stats(), time.monotonic()
                synced = before
                cpu_before = (_cpu_seconds([proc], children=False), _cpu_seconds(hosts), _pool_loop_cpu())
                lag.start_window()
            lag.phase = "train"
            head.train(batch)
            between_syncs.append((synced, cluster.stats()))
            faults.before_update(step)
            cpu_start = (_cpu_seconds([proc], children=False), _update_threads_cpu())
            sending.seconds = 0.0
            lag.phase = "update"
            updates.append(head.update(step + 1))
            updates[-1]["process_cpu_s"] = _cpu_seconds([proc], children=False) - cpu_start[0]
            updates[-1]["send_cpu_s"] = sending.seconds
            updates[-1]["trainer_cpu_s"] = _update_threads_cpu() - cpu_start[1] - sending.seconds
            faults.after_update(step)
            synced = cluster.stats()
            updates[-1]["calls_per_server"] = _control_calls(synced, between_syncs[-1][1]) / n
            if step == 1:
                after_fault = cluster.stats()
            for key, value in (
                ("rss_mb", proc.memory_info().rss / 2**20),
                ("fds", proc.num_fds()),
                ("threads", proc.num_threads()),
            ):
                peaks[key] = max(peaks[key], value)
        after, seconds = cluster.stats(), time.monotonic() - start
        cpu = (
            _cpu_seconds([proc], children=False) - cpu_before[0],
            _cpu_seconds(hosts) - cpu_before[1],
            _pool_loop_cpu() - cpu_before[2],
        )
        ledgers = [None] * dist.get_world_size() if dist.get_world_size() > 1 else None
        mine = head.ledger()
        if ledgers is not None:
            dist.gather_object(mine, ledgers, dst=0)
    finally:
        lags = lag.stop()
        head.close()
    books = {key: sum(ledger[key] for ledger in ledgers or [mine]) for key in mine}
    row = {"fault": faults.name or "none"}
    row.update(_row(cluster, steps, before, after, seconds, cpu, updates[1:], books, peaks))
    row["connect_s"] = head.connect_s
    # the group formed again in an update (a server died, joined or left): the slowest such connect
    row["reconnect_s"] = max((u.get("connect_seconds", 0.0) for u in updates[1:]), default=0.0)
    row["pool_share"] = _share(cluster, between_syncs)
    row.update(lags)
    row["dialect"] = cluster.dialect
    row["servers on the last version"] = sum(str(s["version"]) == str(steps) for s in after)
    row["servers hit"] = len(faults.hit)
    row["evicted"] = int(sum(u.get("servers_evicted", 0) for u in updates))
    row["readmitted"] = int(sum(u.get("servers_readmitted", 0) for u in updates))
    # a server out of rotation (evicted, or left the run) gets no generation request after that update
    out = faults.name in ("hang_update", "slow_pause", "slow_receive", "control_down", "join_leave") and steps > 2
    row["requests to hit after"] = (
        sum(after[i]["generate"] - after_fault[i]["generate"] for i in faults.hit) if out else None
    )
    if faults.joined is not None:
        row["joined serving"] = sum(s["generate"] > 0 and s["version"] >= 2 for s in faults.joined.stats())
    row["bytes_received"] = sum(s["bytes_received"] for s in after)
    return row


class SendCPU:
    """The CPU seconds the update's threads spend while the trainer sends the data (``send_cpu_s``):
    over loopback, gloo's copies of a small model's bytes to every worker, which NCCL does on the GPU;
    counted apart from the control plane's (``trainer_cpu_s``). Wraps each sender's ``send`` (the
    bridge's senders are rebuilt at every connect: looked up at each update)."""

    def __init__(self, bridge):
        self.bridge, self.seconds = bridge, 0.0
        original = bridge.update

        def update(*args, **kwargs):
            for sender in bridge.senders.values():
                if not getattr(sender, "_sim_timed", False):
                    sender.send, sender._sim_timed = self._timed(sender.send), True
            return original(*args, **kwargs)

        bridge.update = update

    def _timed(self, send):
        def timed(source):
            start = _update_threads_cpu()
            try:
                return send(source)
            finally:
                self.seconds += _update_threads_cpu() - start

        return timed


def _update_threads_cpu() -> float:
    """CPU seconds so far of this process's threads but the rollout pool's loop (``megarl-rollout``): the
    weight update's own (the calling thread, the control loop, the fan-out threads of the probe, and those
    that ended). The process's total less the pool's thread: two reads, where listing every thread would
    take tens of milliseconds at 1,024 servers (a thread per server) and count in what it measures."""
    return time.process_time() - _pool_loop_cpu()


def _pool_loop_cpu() -> float:
    """CPU seconds so far of the rollout pool's loop thread (``megarl-rollout``)."""
    return sum(_thread_cpu(t.native_id) for t in threading.enumerate() if t.name.startswith("megarl-rollout"))


def _thread_cpu(tid: int) -> float:
    """User + system CPU seconds of this process's thread ``tid`` (``/proc/self/task/<tid>/stat``)."""
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_seconds(procs, children: bool = True) -> float:
    """User + system CPU seconds of ``procs`` (``children``: theirs too: a host is a keeper and its
    server; the trainer's process has the simulated cluster among its children, so not for it)."""
    total = 0.0
    for p in procs:
        for q in (p, *p.children(recursive=True)) if children else (p,):
            times = q.cpu_times()
            total += times.user + times.system
    return total


def _train(batch, books, handed_out) -> None:
    """The trainer's step: ``TRAIN_S`` at least, in which the batch's rows are checked (the check's
    CPU time falls where a real trainer's Python runs too, not in the weight update), then Python runs
    holding the interpreter lock for ``TRAIN_GIL_SHARE`` of the step (as a real step's Python does between
    its kernels; the pool's loop thread gets the lock only at the interpreter's switch interval), then
    the rest of the step sleeps (kernels that release the lock)."""
    start = time.monotonic()
    _count_rows(batch, books, handed_out)
    busy_until = start + TRAIN_GIL_SHARE * TRAIN_S
    while time.monotonic() < busy_until:
        sum(range(1000))  # pure Python: holds the lock
    time.sleep(max(0.0, TRAIN_S - (time.monotonic() - start)))


def _count_drops(stats, books) -> None:
    books["dropped"] += int(stats.get("rollout/n_dropped_items", 0))
    books["stale"] += int(stats.get("rollout/n_stale_dropped", 0))
    books["stale rerun"] += int(stats.get("rollout/n_stale_rerun", 0))


def _count_rows(batch, books, handed_out) -> None:
    ids, logprobs, mask = batch["input_ids"].tolist(), batch["logprobs"].tolist(), batch["attention_mask"]
    for row, reward in enumerate(batch["rewards"].tolist()):
        books["doubled"] += handed_out.add(int(reward))
        length = int(mask[row].sum())
        books["misaligned"] += not row_is_clean(ids[row][:length], logprobs[row][:length], PROMPT_LEN)


def _control_calls(after: list[dict], before: list[dict]) -> int:
    """Control calls the servers got between two snapshots (every route but generation and health,
    ``tests/rollout/fake_server.py``'s ``calls /route`` counters), summed over the servers."""
    return sum(
        value - b.get(key, 0) for a, b in zip(after, before) for key, value in a.items() if key.startswith("calls /")
    )


def _delta(after: list[dict], before: list[dict], key: str) -> float:
    """How much counter ``key`` grew, summed over the servers."""
    return sum(a[key] - b[key] for a, b in zip(after, before))


def _share(cluster, windows: list[tuple[list[dict], list[dict]]]) -> float:
    """Tokens the servers generated over what they could have, in the windows between weight syncs
    (the sync, with its probe, is the update columns' business: a simulated server scores the probe on
    this machine's CPU, 256 of them take seconds, and the pool starts no episode meanwhile)."""
    tokens = sum(_delta(b, a, "tokens") for a, b in windows)
    capacity = sum(_delta(b, a, "unpaused_s") for a, b in windows) * cluster.serving.throughput(PER_SERVER)
    return tokens / capacity


def _row(cluster, steps, before, after, seconds, cpu, updates, books, peaks) -> dict:
    unpaused, requests = _delta(after, before, "unpaused_s"), _delta(after, before, "requests")
    overhead = [u["sync_seconds"] - RECEIVE_S - u["send_seconds"] for u in updates]  # the probe comes after
    probing = [u for u in updates if "probe_seconds" in u]
    steady = [u for u in updates if "probe_seconds" not in u] or updates  # no probe in the update
    return {
        # calls each server got in an update (probe scoring aside: generation requests), and the CPU seconds
        # in it of the trainer process's threads but the pool's loop (the update's own cost: the servers
        # share this machine's cores), and of the whole process (the pool's handling of the aborts too)
        "calls_per_server_per_update": statistics.median_high(u["calls_per_server"] for u in steady),
        "update_overhead_s": statistics.median_high(overhead),
        "trainer_cpu_s_per_update": statistics.median_high(u["trainer_cpu_s"] for u in steady),
        "send_cpu_s_per_update": statistics.median_high(u["send_cpu_s"] for u in steady),
        "loop_lag_p99_ms": None,  # _drive
        "connect_plan_s": None,  # run(): the planning of a real model at this size (connect_plan.py)
        "lost": books["lost"],
        "doubled": books["doubled"],
        "misaligned": books["misaligned"],
        "host processes": len(cluster.processes),
        "steps": steps,
        "pool_share": None,  # between weight syncs: _share
        "pool_share_all": _delta(after, before, "tokens") / (cluster.serving.throughput(PER_SERVER) * unpaused),
        "mean_running": _delta(after, before, "running_s") / unpaused,
        "requests/s": requests / seconds,
        "process_cpu_s_per_update": statistics.median_high(u["process_cpu_s"] for u in steady),
        "sync_s": statistics.median_high(u["sync_seconds"] for u in updates),
        # the overhead's parts: pausing every server (their in-flight requests abort), their commit
        # of the new version, resuming them
        "pause_s": statistics.median_high(u["pause_seconds"] for u in updates),
        "commit_s": statistics.median_high(u["commit_seconds"] for u in updates),
        "resume_s": statistics.median_high(u["resume_seconds"] for u in updates),
        "send_s": statistics.median_high(u["send_seconds"] for u in updates),
        "probe_s": statistics.median_high(u["probe_seconds"] for u in probing) if probing else None,
        "peak_rss_MB": round(peaks["rss_mb"], 1),
        "peak_fds": peaks["fds"],
        "peak_threads": peaks["threads"],
        "client_cpu_ms/request": 1000 * cpu[0] / max(1, requests),
        "pool_loop_cpu_ms/request": 1000 * cpu[2] / max(1, requests),
        "hosts_cores": cpu[1] / seconds,  # what the simulated servers took of the machine
        "items fed": books["items fed"],
        "handed out": books["handed out"],
        "dropped": books["dropped"],
        "stale not rerun": books["stale not rerun"],
        "pending": books["pending"],
    }


def _in_own_process(n: int, steps: int, fault: str | None = None, **kwargs) -> dict:
    """:func:`measure` in a fresh process: its resources and its torch.distributed group are its own."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(measure, n, steps, fault, **kwargs).result()


FAULT_SERVERS = 256
"""The size the faults run at (``--quick``: none run)."""
REAL_PLAN_MODEL = "qwen2.5-7b"
"""Whose connect planning ``connect_plan_s`` reports (``benchmarks/connect_plan.py``): the bundled
128-GPU config's model, at the row's servers, TP and mode."""


ROW_GROUPS = ("sizes", "heads", "faults", "extra", "blocks")
"""The benchmark's rows in groups (``--rows``, default all, in this order): steady state at every size with
one head, the same with :data:`REAL_HEADS` heads up to 256 servers, each fault at :data:`FAULT_SERVERS`
servers, then 1,024 servers with 16 heads, TP 4 at 256 servers (1,024 workers; steady, then with 5% of
the servers dying in an update, after which the group forms again) and ``disk`` at 256; then the
dying row twice more, with the default blocks of servers per group and with one group of every
worker (``weight_update.servers_per_group`` 0), one after the other, then the same pair without a
fault."""
CLI_OPTIONS = {"--rows": ("MEGARL_SCALE_SIM_ROWS", {"all": "all", **{g: g for g in ROW_GROUPS}})}


def results_name() -> str:
    """``scale_sim``, or ``scale_sim_<group>`` for one group of rows (``--rows``)."""
    rows = os.environ.get("MEGARL_SCALE_SIM_ROWS", "all")
    return "scale_sim" if rows == "all" else f"scale_sim_{rows}"


def plan(quick: bool, groups: tuple[str, ...] = ROW_GROUPS) -> list[dict]:
    """The rows of ``groups`` (:data:`ROW_GROUPS`); ``--quick``: 8 servers, then 64 with 4 heads."""
    if quick:
        return [{"n": 8}, {"n": 64, "heads": 4}]
    rows = {
        "sizes": [{"n": n} for n in SIZES],
        "heads": [{"n": n, "heads": REAL_HEADS} for n in SIZES[:-1]],
        "faults": [{"n": FAULT_SERVERS, "fault": fault} for fault in FAULTS],
        "extra": [
            {"n": SIZES[-1], "heads": REAL_HEADS},
            {"n": 256, "tp": 4},
            {"n": 256, "tp": 4, "fault": "die_in_update"},  # the group formed again over 1,024 workers
            {"n": 256, "mode": "disk"},
        ],
        "blocks": [
            {"n": 256, "tp": 4, "fault": "die_in_update"},  # the dead servers' blocks form again
            {"n": 256, "tp": 4, "fault": "die_in_update", "servers_per_group": 0},  # one group of 1,024 workers
            {"n": 256, "tp": 4},  # what the blocks cost an update without a fault
            {"n": 256, "tp": 4, "servers_per_group": 0},
        ],
    }
    return [row for group in groups for row in rows[group]]


def run(quick: bool, on_rows=None) -> list[dict]:
    """:func:`plan`'s rows, each in its own process, with the real model's connect planning beside."""
    from benchmarks import connect_plan

    selected = os.environ.get("MEGARL_SCALE_SIM_ROWS", "all")
    rows = []
    for spec in plan(quick, ROW_GROUPS if selected == "all" else (selected,)):
        n = spec.pop("n")
        try:
            rows.append(_in_own_process(n, STEPS_QUICK if quick else STEPS, **spec))
        except Exception as e:  # noqa: BLE001 (the row says what failed; the others still run)
            rows.append(
                {"servers": n, "tp": 1, "heads": 1, "mode": "sharded", **spec, "error": f"{type(e).__name__}: {e}"}
            )
            logging.getLogger(__name__).exception("scale_sim row %s failed", rows[-1])
        if rows[-1]["mode"] != "disk" and "error" not in rows[-1]:
            planned = connect_plan._in_own_process(REAL_PLAN_MODEL, rows[-1]["mode"], n, rows[-1]["tp"])
            rows[-1]["connect_plan_s"] = planned["connect_plan_s"]
        if on_rows is not None:
            on_rows(rows)
    return rows


if __name__ == "__main__":
    main_for(__name__)
