"""``megarl.reward.remote``: a reward service of the user's, reached over HTTP.

The service here is a small aiohttp server standing in for the user's (it records what it received and
answers as each test sets it up): what is checked is megarl's side of the protocol, what a service written
for slime's ``remote_rm`` reads, and what a user reads when the service misbehaves.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import aiohttp
from aiohttp import web

from megarl.api import context as workflow_context
from megarl.config.rollout import RewardConfig
from megarl.reward import AsyncRewardWrapper
from megarl.reward.failures import FIRST_CALLS, RewardFunctionError
from megarl.reward.remote import RemoteRewardError, remote_reward_fn
from megarl.utils.network import find_free_ports

Reply = Callable[[int, dict], web.Response]


def _serve_and_score(reply: Reply, completions: list[str], timeout: float = 10.0, **kwargs) -> tuple[list, list[dict]]:
    """Score ``completions`` through ``remote_reward_fn`` against a service answering its n-th request
    (from 0) with ``reply(n, request body)``; the rewards (a RewardFunctionError in the place of the call
    that raised it) and the bodies it received, with their headers under ``_headers``."""
    received: list[dict] = []

    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        port = request.transport.get_extra_info("peername")[1]
        received.append({**body, "_headers": dict(request.headers), "_port": port})
        return reply(len(received) - 1, body)

    async def main():
        app = web.Application()
        app.router.add_post("/score", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        port = find_free_ports(1)[0]
        await web.TCPSite(runner, "127.0.0.1", port).start()
        config = RewardConfig(timeout_seconds=timeout, kwargs={"url": f"http://127.0.0.1:{port}/score", **kwargs})
        wrapper = AsyncRewardWrapper.from_config(remote_reward_fn, config)
        out = []
        try:
            for i, completion in enumerate(completions):
                with workflow_context.use(workflow_context.WorkflowContext(task_id=i)):
                    try:
                        out.append(await wrapper("<prompt>", completion, [5, 6], [7], answer="42", level=3))
                    except RewardFunctionError as e:
                        out.append(e)
        finally:
            await runner.cleanup()
        return out

    return asyncio.run(main()), received


def test_the_service_gets_slimes_fields_and_the_row_and_its_number_is_the_reward():
    rewards, received = _serve_and_score(
        lambda n, body: web.json_response(float(body["response"] == body["label"])), ["42", "41"]
    )
    assert [float(r) for r in rewards] == [1.0, 0.0]
    body = {k: v for k, v in received[0].items() if not k.startswith("_")}
    assert body == {
        "prompt": "<prompt>",
        "response": "42",
        "label": "42",
        "prompt_ids": [5, 6],
        "completion_ids": [7],
        "row": {"level": 3},
    }
    assert "Authorization" not in received[0]["_headers"]


def test_the_calls_of_a_loop_share_their_connection_and_the_loops_end_closes_it():
    """Eight calls one after another: one connection (a connection per call would leave a port waiting a
    minute after each). The loop's end closes the session, with nothing left for the garbage collector
    to complain about."""
    from megarl.reward import remote

    rewards, received = _serve_and_score(lambda n, body: web.json_response(1), ["a"] * 8)
    assert len(received) == 8 and len({r["_port"] for r in received}) == 1, [r["_port"] for r in received]
    assert all(session.closed for _, session in remote._SESSIONS.values())


def test_an_object_with_a_reward_or_a_score_is_read():
    replies = [{"reward": 0.25}, {"score": 1}, {"reward": 0.5, "score": 9}]
    rewards, _ = _serve_and_score(lambda n, body: web.json_response(replies[n]), ["a", "b", "c"])
    assert [float(r) for r in rewards] == [0.25, 1.0, 0.5]


def test_busy_replies_and_a_restart_are_retried_until_an_answer(caplog):
    """Two 503s and a 429 before the answer: one reward, four requests, and the log names the service."""
    statuses = [503, 503, 429]

    def reply(n: int, body: dict) -> web.Response:
        return web.Response(status=statuses[n], text="overloaded") if n < len(statuses) else web.json_response(0.75)

    with caplog.at_level(logging.WARNING, logger="megarl.reward.remote"):
        rewards, received = _serve_and_score(reply, ["a"])
    assert [(float(r), r.outcome) for r in rewards] == [(0.75, "ok")] and len(received) == 4
    assert "/score: HTTP 503: 'overloaded'; retrying" in caplog.text, caplog.text


def test_a_bad_request_fails_at_once_naming_the_service_status_and_body():
    rewards, received = _serve_and_score(
        lambda n, body: web.Response(status=422, text="missing field 'label'"), ["x"] * FIRST_CALLS
    )
    assert len(received) == FIRST_CALLS, "a 4xx is not retried"
    text = str(rewards[-1])
    assert isinstance(rewards[-1], RewardFunctionError), rewards
    assert (
        "RemoteRewardError: http://127.0.0.1:" in text and "/score answered HTTP 422: \"missing field 'label'\"" in text
    ), text


def test_a_reply_that_is_not_a_reward_is_an_error_naming_what_came_back():
    cases = [
        (
            lambda: web.Response(text="<html>proxy error</html>"),
            "HTTP 200 with a body that is not JSON: '<html>proxy error</html>'",
        ),
        (lambda: web.json_response({"result": 1}), """answered '{"result": 1}': expected a number, or an object"""),
        (lambda: web.json_response("1.0"), """answered '"1.0"': expected a number"""),
        (lambda: web.json_response(True), "answered 'true': expected a number"),
    ]
    for reply, expected in cases:
        rewards, _ = _serve_and_score(lambda n, body: reply(), ["x"] * FIRST_CALLS)
        assert isinstance(rewards[-1], RewardFunctionError) and expected in str(rewards[-1]), str(rewards[-1])


def test_a_service_that_cannot_be_reached_times_out_and_the_log_says_why(caplog):
    port = find_free_ports(1)[0]
    wrapper = AsyncRewardWrapper.from_config(
        remote_reward_fn, RewardConfig(timeout_seconds=0.5, kwargs={"url": f"http://127.0.0.1:{port}/score"})
    )
    with caplog.at_level(logging.WARNING, logger="megarl.reward.remote"):
        reward = asyncio.run(wrapper("<prompt>", "42", [], [], answer="42"))
    assert (float(reward), reward.outcome) == (0.0, "timeout")
    assert f"127.0.0.1:{port}/score: ClientConnectorError: Cannot connect to host" in caplog.text, caplog.text


def test_the_api_key_comes_from_the_named_environment_variable(monkeypatch):
    monkeypatch.setenv("MY_RM_KEY", "s3cret")
    rewards, received = _serve_and_score(lambda n, body: web.json_response(1), ["a"], api_key_env="MY_RM_KEY")
    assert float(rewards[0]) == 1.0 and received[0]["_headers"]["Authorization"] == "Bearer s3cret"
    assert json.dumps(received[0]).count("s3cret") == 1, "the key is not in the body"
    monkeypatch.delenv("MY_RM_KEY")
    rewards, received = _serve_and_score(
        lambda n, body: web.json_response(1), ["a"] * FIRST_CALLS, api_key_env="MY_RM_KEY"
    )
    assert received == [] and "api_key_env='MY_RM_KEY': that environment variable is not set" in str(rewards[-1])


def test_the_example_service_scores_as_the_reward_it_wraps():
    """``examples/rewards/reward_service.py`` behind ``remote_reward_fn`` gives the arithmetic reward's own
    scores, a body that lacks fields gets a 400 naming them, and a reward that raises fails the call at
    once with its error (not retried as a busy service)."""
    from examples.rewards.reward_service import make_app
    from megarl.reward.arithmetic import arithmetic_reward_fn

    completions, answer = ["12", "The answer is 12.", "13", ""], "12"

    def broken_on_boom(prompt, completion, prompt_ids, completion_ids, answer, **row):
        if answer == "boom":
            raise ValueError("cannot score against 'boom'")
        return arithmetic_reward_fn(prompt, completion, prompt_ids, completion_ids, answer, **row)

    async def main():
        runner = web.AppRunner(make_app(broken_on_boom))
        await runner.setup()
        port = find_free_ports(1)[0]
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}/score"
        try:
            remote = [await remote_reward_fn("<prompt>", c, [], [], url=url, answer=answer) for c in completions]
            async with aiohttp.ClientSession() as session, session.post(url, json={"prompt": "p"}) as resp:
                bad = (resp.status, await resp.text())
            raised = "no error"
            try:
                await asyncio.wait_for(remote_reward_fn("<prompt>", "12", [], [], url=url, answer="boom"), 5)
            except RemoteRewardError as e:
                raised = str(e)
        finally:
            await runner.cleanup()
        return remote, bad, raised

    remote, bad, raised = asyncio.run(main())
    assert remote == [float(arithmetic_reward_fn("<prompt>", c, [], [], answer=answer)) for c in completions]
    assert len(set(remote)) > 1, "the completions score differently"
    assert bad == (400, "missing field(s) ['response', 'label', 'prompt_ids', 'completion_ids', 'row']")
    assert "answered HTTP 422" in raised and "ValueError: cannot score against 'boom'" in raised, raised
