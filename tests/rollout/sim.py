"""A simulated inference engine (no server) for pool and staleness tests."""

from __future__ import annotations

import asyncio
import random

from megarl.api import ModelRequest, ModelResponse, RolloutWorkflow, make_trajectory
from megarl.api.io_struct import GenerationHyperparameters


class SimEngine:
    """Generates in timed chunks, each stamped with the version current when it starts;
    waits while paused (like the remote engine's interrupted requests)."""

    def __init__(self):
        self.version = 0
        self.paused = False

    def get_version(self) -> int:
        return self.version

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        delays = req.metadata["chunk_delays"]
        resp = ModelResponse(input_tokens=list(req.input_ids))
        for i, delay in enumerate(delays):
            while self.paused:
                await asyncio.sleep(0.001)
            version = self.version
            await asyncio.sleep(delay)
            resp.output_tokens.append(100 + i)
            resp.output_logprobs.append(-0.5)
            resp.output_versions.append(version)
        return resp


class SimWorkflow(RolloutWorkflow):
    """One generation whose chunk timing and rejection come from the data item."""

    async def arun_episode(self, engine, data):
        gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=len(data["chunk_delays"]))
        resp = await engine.agenerate(
            ModelRequest(input_ids=[1, 2], gconfig=gconfig, metadata={"chunk_delays": data["chunk_delays"]})
        )
        if data.get("reject"):
            return None
        return make_trajectory(
            resp.input_tokens, resp.output_tokens, resp.output_logprobs, resp.output_versions, reward=float(data["id"])
        )


class ListLoader:
    """A minimal dataloader: a list of batches with a ``batch_size`` attribute."""

    def __init__(self, items: list[dict], batch_size: int):
        self.batch_size = batch_size
        self.batches = [items[i : i + batch_size] for i in range(0, len(items) - batch_size + 1, batch_size)]

    def __iter__(self):
        return iter(self.batches)


def sim_items(n: int, seed: int, reject_p: float = 0.0, slow_p: float = 0.2, max_chunks: int = 4) -> list[dict]:
    """Items with random chunk counts and delays (a ``slow_p`` share of them 10-50x slower,
    so episodes finish out of order) and rejections; reproducible from ``seed``."""
    rng = random.Random(seed)

    def delay() -> float:
        return rng.uniform(0.01, 0.05) if rng.random() < slow_p else rng.uniform(0, 0.002)

    return [
        {
            "id": i,
            "chunk_delays": [delay() for _ in range(rng.randint(1, max_chunks))],
            "reject": rng.random() < reject_p,
        }
        for i in range(n)
    ]
