"""A reward service: what ``megarl.reward.remote.remote_reward_fn`` calls, in one file to start from.

    python examples/rewards/reward_service.py --port 8100 --reward megarl.reward.arithmetic.arithmetic_reward_fn
    megarl run configs/arithmetic_grpo_cpu.yaml reward_fn=megarl.reward.remote.remote_reward_fn \\
        reward.kwargs.url=http://127.0.0.1:8100/score

It answers ``POST /score`` (the body megarl sends: ``prompt``, ``response``, ``label``, ``prompt_ids``,
``completion_ids``, ``row``) with ``{"reward": <float>}``, scoring with any megarl reward function (here
in a thread: a real service puts its model or sandbox there). A body that lacks a field gets a 400 that
names it, and a reward that raises gets a 422 with the error (a 500 would be retried as a busy service
until the reward's timeout); the trainer reports either as a failed reward call.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib

from aiohttp import web

FIELDS = ("prompt", "response", "label", "prompt_ids", "completion_ids", "row")


def make_app(reward_fn) -> web.Application:
    async def score(request: web.Request) -> web.Response:
        body = await request.json()
        missing = [field for field in FIELDS if field not in body]
        if missing:
            return web.Response(status=400, text=f"missing field(s) {missing}")
        row = {**body["row"], "answer": body["label"]}
        try:
            reward = await asyncio.to_thread(
                reward_fn, body["prompt"], body["response"], body["prompt_ids"], body["completion_ids"], **row
            )
            return web.json_response({"reward": float(reward)})
        except Exception as e:  # a bug, not a busy service: 422 is not retried, so the trainer sees it at once
            return web.Response(status=422, text=f"{type(e).__name__}: {e}")

    app = web.Application()
    app.router.add_post("/score", score)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--reward", default="megarl.reward.arithmetic.arithmetic_reward_fn", help="module.function")
    args = parser.parse_args()
    module, name = args.reward.rsplit(".", 1)
    web.run_app(make_app(getattr(importlib.import_module(module), name)), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
