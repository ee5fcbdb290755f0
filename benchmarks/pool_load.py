"""The rollout pool under load: 512 concurrent episodes for 30 minutes against
servers that delay or fail 10% of their requests at random.

A trainer-like loop (``prepare_batch``, ``set_version``, a stats export per step) drives a real
``RemoteInferenceEngine`` over HTTP against the fault-injecting fake vLLM server
(``tests/rollout/fake_server.py``, its own processes): 5% of requests fail with one of its
retryable bad replies (5xx, 429, invalid JSON, an HTML page, a body cut short, a dropped
connection, NaN or positive logprobs, lists of different lengths ...) and 5% are delayed by up
to 2 s. The loop steps as fast as the pool delivers (no training time), so episodes held up
by a delay or by retries outlive the staleness bound more often than in a real run: those are
dropped at hand-off as designed (``rollout/n_stale_dropped``, logged) and counted here. Every
dataset item has its own id, so the books balance exactly::

    items fed = handed out + dropped after failures (counted) + dropped as stale and not rerun + pending

(a dataloader item whose trajectory came too late runs again, up to 3 times: ``n_stale_rerun``)

and no id is handed out twice; every handed-out row is checked token by token against what
the server generates (nothing misaligned reaches the trainer). It also samples the client's
RSS, open file descriptors, threads and the pool loop's asyncio tasks: RSS may grow < 5% after
the warm-up, and once the pool is drained no episode task is left.

``--quick`` runs 1 minute with 128 episodes (the test ``tests/rollout/test_pool_load.py`` runs
a shorter one still).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks._harness import main_for

TITLE = "Rollout pool under load: concurrent episodes, 10% of requests delayed or failed at random"
PROMPT_LEN, NEW_TOKENS = 5, 8


@dataclass
class CountingLoader:
    """An endless dataloader of items with unique ids; remembers how many it fed."""

    batch_size: int
    fed: int = 0

    def __iter__(self):
        while True:
            batch = [{"id": self.fed + i} for i in range(self.batch_size)]
            self.fed += self.batch_size
            yield batch


class IdBitmap:
    """The ids handed out so far, one bit each: a set of a million ints would itself grow the RSS
    this benchmark measures by ~60 MB."""

    def __init__(self) -> None:
        self.bits = bytearray()
        self.count = 0

    def add(self, item: int) -> bool:
        """Add ``item``; whether it was there already."""
        byte, bit = divmod(item, 8)
        if byte >= len(self.bits):
            self.bits.extend(bytes(max(byte + 1 - len(self.bits), 1 << 16)))
        seen = bool(self.bits[byte] >> bit & 1)
        self.bits[byte] |= 1 << bit
        self.count += not seen
        return seen


@dataclass
class Samples:
    """Per-step resource samples of the client process."""

    rss_mb: list[float] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)
    loop_tasks: list[int] = field(default_factory=list)

    def take(self, proc: psutil.Process, loop: asyncio.AbstractEventLoop) -> None:
        self.rss_mb.append(proc.memory_info().rss / 2**20)
        self.fds.append(proc.num_fds())
        self.threads.append(proc.num_threads())
        self.loop_tasks.append(_loop_tasks(loop))


def _loop_tasks(loop: asyncio.AbstractEventLoop) -> int:
    async def count() -> int:
        return len(asyncio.all_tasks()) - 1  # not this probe itself

    return asyncio.run_coroutine_threadsafe(count(), loop).result(timeout=30)


def soak(
    minutes: float,
    concurrency: int,
    n_servers: int = 2,
    fail_rate: float = 0.05,
    delay_rate: float = 0.05,
    max_delay: float = 2.0,
    seed: int = 0,
) -> dict:
    """Drive the pool for ``minutes``; returns the counts and resource figures (see the module doc)."""
    from megarl.utils import stats_tracker
    from tests.rollout.conftest import make_engine, start_fake_servers
    from tests.rollout.helpers import OneShotWorkflow, expected_tokens

    logs = tempfile.TemporaryDirectory(prefix="megarl-pool-load-")
    servers = start_fake_servers(
        n_servers,
        token_delay=0.002,
        log_dir=Path(logs.name),
        fail_rate=fail_rate,
        delay_rate=delay_rate,
        max_delay=max_delay,
        seed=seed,
    )
    engine = make_engine(
        [s.address for s in servers],
        batch_size=concurrency,
        max_concurrent_rollouts=concurrency,
        max_staleness=1,
        request_retries=3,
        retry_backoff=0.05,
        request_timeout=30.0,
        unhealthy_retry_interval=1.0,
        episode_retries=2,
    )
    loader, workflow = CountingLoader(concurrency), OneShotWorkflow(NEW_TOKENS, PROMPT_LEN)
    tokens, logprobs = expected_tokens(PROMPT_LEN, NEW_TOKENS)
    proc, samples = psutil.Process(), Samples()
    handed_out = IdBitmap()
    totals = {"doubled": 0, "misaligned": 0, "failed": 0, "dropped": 0, "stale": 0, "stale rerun": 0, "steps": 0}
    stats_tracker.export_all(local=True)  # what this process recorded earlier is not this run's
    start = time.monotonic()
    try:
        while time.monotonic() - start < 60 * minutes:
            batch = engine.prepare_batch(loader, workflow)
            engine.set_version(totals["steps"] + 1)
            stats = stats_tracker.export(local=True)  # the trainer exports once per step: nothing accumulates
            totals["steps"] += 1
            totals["failed"] += int(stats.get("rollout/n_failed", 0))
            totals["dropped"] += int(stats.get("rollout/n_dropped_items", 0))
            totals["stale"] += int(stats.get("rollout/n_stale_dropped", 0))
            totals["stale rerun"] += int(stats.get("rollout/n_stale_rerun", 0))
            for row, reward in enumerate(batch["rewards"].tolist()):
                totals["doubled"] += handed_out.add(int(reward))
                clean = batch["input_ids"][row, PROMPT_LEN:].tolist() == tokens and all(
                    abs(a - b) < 1e-6 for a, b in zip(batch["logprobs"][row, PROMPT_LEN:].tolist(), logprobs)
                )
                totals["misaligned"] += not clean
            samples.take(proc, engine.pool.loop)
        pending = len(engine.pool.pending_items())
        engine.pause()  # stop starting episodes, abort the running generations ...
        engine.resume(start_episodes=False)  # ... which finish now; nothing new starts
        drained = _wait_idle(engine, timeout=120)
        tasks_after = _loop_tasks(engine.pool.loop)
        pending_after = len(engine.pool.pending_items())
        server_stats = [_server_stats(s.address) for s in servers]
    finally:
        engine.destroy()
        for server in servers:
            server.stop()
        logs.cleanup()
    warm = max(1, len(samples.rss_mb) // 10)  # the first tenth of the run is warm-up
    rss_start = statistics.median(samples.rss_mb[warm : 2 * warm]) if len(samples.rss_mb) > 2 else samples.rss_mb[0]
    rss_end = statistics.median(samples.rss_mb[-warm:])
    faults = sum(v for st in server_stats for k, v in st.items() if k.startswith("fault_"))
    requests = sum(st.get("generate", 0) for st in server_stats)
    return {
        "minutes": round((time.monotonic() - start) / 60, 1),
        "concurrency": concurrency,
        "steps": totals["steps"],
        "items fed": loader.fed,
        "handed out": handed_out.count,
        "dropped (counted)": totals["dropped"],
        "stale (counted)": totals["stale"],
        "stale, item rerun": totals["stale rerun"],
        # the accepted-not-yet-handed-out ones stay pending too: they reach the trainer next step
        "pending at end": pending,
        "lost": loader.fed - handed_out.count - totals["dropped"] - (totals["stale"] - totals["stale rerun"]) - pending,
        "doubled": totals["doubled"],
        "misaligned": totals["misaligned"],
        "requests": requests,
        "faults injected": faults,
        "delayed": sum(st.get("delayed", 0) for st in server_stats),
        "episodes failed (rerun)": totals["failed"],
        "RSS MB after warm-up": round(rss_start, 1),
        "RSS MB at end": round(rss_end, 1),
        "RSS growth %": round(100 * (rss_end - rss_start) / rss_start, 2),
        "max fds": max(samples.fds),
        "max threads": max(samples.threads),
        "max loop tasks": max(samples.loop_tasks),
        "drained": drained,
        "loop tasks after drain": tasks_after,
        "pending after drain": pending_after,
    }


def _wait_idle(engine, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not engine.pool_idle():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _server_stats(address: str) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://{address}/_stats", timeout=30) as resp:
        stats = json.loads(resp.read())
    stats.pop("payloads", None)
    return stats


def run(quick: bool) -> list[dict]:
    logging.getLogger("megarl").setLevel(logging.ERROR)  # a stale drop or a rerun is a warning each: counted instead
    return [soak(minutes=1.0, concurrency=128) if quick else soak(minutes=30.0, concurrency=512)]


def summary(rows: list[dict]) -> str:
    row = rows[0]
    ok = (
        row["lost"] == 0
        and row["doubled"] == 0
        and row["misaligned"] == 0
        and row["RSS growth %"] < 5
        and row["drained"]
        and row["loop tasks after drain"] <= 2
    )
    verdict = "PASS" if ok else "FAIL"
    return (
        f"{verdict}: {row['handed out']} episodes in {row['minutes']} min, lost {row['lost']}, doubled "
        f"{row['doubled']}, misaligned {row['misaligned']}, RSS growth {row['RSS growth %']}% (< 5%), "
        f"{row['loop tasks after drain']} loop tasks left after draining (the pool's own loop)"
    )


if __name__ == "__main__":
    main_for(__name__)
