"""Processes that stall on purpose, with heartbeats, for the watchdog tests.

``python tests/launcher/stall_worker.py MODE RUN_DIR [args]``:

* ``collective RANK WORLD PORT``: gloo ranks loop over phases ``compute`` then ``sync`` (an
  all_reduce); ``MEGARL_FAULT_STALL`` makes one rank sleep in ``compute``, the others wait in ``sync``;
* ``server ADDRESS``: one rollout episode in phase ``rollout`` against a (hanging) server;
* ``reward``: one reward call that never returns, in phase ``rollout``;
* ``blocked_loop ADDRESS``: a rollout pool whose workflow blocks its event loop (a synchronous call
  that never returns), the pool's heartbeat beaten from that loop.
"""

from __future__ import annotations

import asyncio
import sys
import time

import torch
import torch.distributed as dist

from megarl.utils import heartbeat

INTERVAL_S = 0.2


def collective(run_dir: str, rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    heartbeat.start(run_dir, f"trainer-{rank}", INTERVAL_S, trace_collectives=True)
    for _ in range(1000):
        with heartbeat.phase("compute"):
            time.sleep(0.01)
        with heartbeat.phase("sync"):
            dist.all_reduce(torch.ones(1))


def server(run_dir: str, address: str) -> None:
    from megarl.api import ModelRequest
    from megarl.api.io_struct import GenerationHyperparameters
    from megarl.config.rollout import InferenceEngineConfig
    from megarl.rollout import RemoteInferenceEngine

    config = InferenceEngineConfig(request_timeout=3600.0, setup_timeout=30.0)
    engine = RemoteInferenceEngine(config).initialize(server_addrs=[address], batch_size=1)
    heartbeat.start(run_dir, "trainer-0", INTERVAL_S)
    heartbeat.set_detail_fn(engine.describe_outstanding)
    with heartbeat.phase("rollout"):
        request = ModelRequest(input_ids=[1, 2, 3], gconfig=GenerationHyperparameters(max_new_tokens=4))
        asyncio.run(engine.agenerate(request))


def never_returns(*args, **kwargs) -> float:
    time.sleep(3600)
    return 0.0


def reward(run_dir: str) -> None:
    from megarl.reward.executor import AsyncRewardWrapper, describe_in_flight
    from tests.launcher.stall_worker import never_returns as importable  # not __main__'s: the worker imports it

    wrapper = AsyncRewardWrapper(importable, timeout_seconds=3600, max_workers=1)
    heartbeat.start(run_dir, "trainer-0", INTERVAL_S)
    heartbeat.set_detail_fn(describe_in_flight)
    with heartbeat.phase("rollout"):
        asyncio.run(wrapper("prompt", "completion", [1], [2]))


def blocked_loop(run_dir: str, address: str) -> None:
    from megarl.api.workflow_api import RolloutWorkflow
    from megarl.config.rollout import InferenceEngineConfig
    from megarl.rollout import RemoteInferenceEngine

    class Blocking(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            time.sleep(3600)  # blocks the pool's event loop, as a synchronous reward or tool call would

    engine = RemoteInferenceEngine(InferenceEngineConfig(setup_timeout=30.0)).initialize(
        server_addrs=[address], batch_size=1
    )
    engine.start_heartbeat(run_dir, "rollout-0", INTERVAL_S)
    heartbeat.start(run_dir, "trainer-0", INTERVAL_S)
    with heartbeat.phase("rollout"):
        engine.submit({"prompt": "x"}, Blocking())
        engine.wait(1)


if __name__ == "__main__":
    mode, run_dir, *args = sys.argv[1:]
    if mode == "collective":
        collective(run_dir, *map(int, args))
    elif mode == "server":
        server(run_dir, args[0])
    elif mode == "blocked_loop":
        blocked_loop(run_dir, args[0])
    else:
        reward(run_dir)
