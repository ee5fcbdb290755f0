"""Small workflows for rollout tests (no reward process pool, no tokenizer)."""

from __future__ import annotations

import collections

from megarl.api import ModelRequest, RolloutWorkflow, make_trajectory
from megarl.api.io_struct import GenerationHyperparameters
from tests.rollout.fake_server import logprob_at, token_at


class OneShotWorkflow(RolloutWorkflow):
    """One generation per item; the reward is the item's ``id`` (to track items through the pool)."""

    def __init__(self, max_new_tokens: int = 16, prompt_len: int = 5):
        self.gconfig = GenerationHyperparameters(n_samples=1, max_new_tokens=max_new_tokens, temperature=1.0)
        self.prompt_len = prompt_len

    async def arun_episode(self, engine, data):
        prompt = [11 + (data["id"] + i) % 50 for i in range(self.prompt_len)]
        resp = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=self.gconfig))
        resp.check_aligned()
        return make_trajectory(
            resp.input_tokens, resp.output_tokens, resp.output_logprobs, resp.output_versions, float(data["id"])
        )


def expected_tokens(prompt_len: int, n: int, eos_every: int = 0) -> tuple[list[int], list[float]]:
    """What the fake server generates after a prompt of ``prompt_len`` tokens."""
    positions = range(prompt_len, prompt_len + n)
    return [token_at(p, eos_every) for p in positions], [logprob_at(p) for p in positions]


class LoopTurns:
    """Counts the turns of an event loop: :meth:`tick` (called on the loop) schedules itself once per turn
    until ``done()``. ``most_in_one_turn(turns)``: of the turn numbers recorded at some events (``now``
    when each happened), the most that fell in one turn."""

    def __init__(self, loop, done):
        self.loop, self.done, self.now = loop, done, 0

    def tick(self) -> None:
        self.now += 1
        if not self.done():
            self.loop.call_soon(self.tick)

    @staticmethod
    def most_in_one_turn(turns: list[int]) -> int:
        return collections.Counter(turns).most_common(1)[0][1]
