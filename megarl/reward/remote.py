"""A reward computed by an HTTP service of yours (slime's ``remote_rm``): a reward model, a code sandbox,
a verifier that lives on other machines.

In the config::

    reward_fn: megarl.reward.remote.remote_reward_fn
    reward:
      timeout_seconds: 60
      kwargs: {url: "http://rm-node:8000/score"}

Each call POSTs one JSON object to ``url``::

    {"prompt": "...", "response": "...", "label": <the row's answer>,
     "prompt_ids": [...], "completion_ids": [...], "row": {<the row's other fields>}}

(``prompt``, ``response`` and ``label`` are what slime's ``remote_rm`` sends, so a service written for it
answers as it is) and reads the reply's JSON body as the reward: a number, or an object holding one under
``"reward"`` (or ``"score"``). The call is an ``async def``: it waits on the rollout's event loop, not in
a worker process, so a slow service holds no process per call.

A connection that fails and a 429 or 5xx reply are retried, waiting 0.1 s and doubling up to 2 s, until
``reward.timeout_seconds`` ends the call (a timed-out call, counted in ``rollout/reward/timeout``); any
other status, a body that is not JSON or holds no number raises :class:`RemoteRewardError` naming the
address, the status and the start of the body (a failed call with that message in ``trainer.log``). The
run's usual rules then apply (``docs/guides/own-reward-workflow-loss.md``, "When your reward fails").
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

import aiohttp

from megarl.utils.logging import LogEvery

RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})
"""Replies that say "later" (overloaded, restarting, behind a proxy that lost it): retried."""
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.1, 2.0
WARN_EVERY_S = 60.0
"""A service that keeps failing is named in the log at most this often (per address)."""

MAX_CONNECTIONS = 256
"""Reward requests of one event loop open at most this many connections at once (the rest wait for one)."""

logger = logging.getLogger(__name__)
_RETRY_WARNINGS = LogEvery(logger, WARN_EVERY_S)
_SESSIONS: dict[asyncio.AbstractEventLoop, tuple[Any, aiohttp.ClientSession]] = {}


class RemoteRewardError(RuntimeError):
    """A reward service's reply that is not a reward (the message names the address and what came back)."""


async def remote_reward_fn(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    *,
    url: str,
    api_key_env: str | None = None,
    **row: Any,
) -> float:
    """The reward ``url`` gives this completion (see the module doc). ``api_key_env``: the name of an
    environment variable whose value is sent as ``Authorization: Bearer <value>`` (the key itself stays
    out of the config)."""
    payload = {
        "prompt": prompt,
        "response": completions,
        "label": row.get("answer"),
        "prompt_ids": list(prompt_ids),
        "completion_ids": list(completion_ids),
        "row": {key: value for key, value in row.items() if key != "answer"},
    }
    body = await fetch_json(url, payload, bearer_headers(api_key_env))
    return reward_in(body, url)


def reward_in(body: Any, url: str) -> float:
    """The number a reward service answered: the body itself, or its ``"reward"`` (or ``"score"``)."""
    value = body
    if isinstance(body, dict):
        value = next((body[key] for key in ("reward", "score") if key in body), None)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RemoteRewardError(
            f"{url} answered {_start(json.dumps(body))}: expected a number, or an object with a numeric 'reward' or 'score'"
        )
    return float(value)


def bearer_headers(api_key_env: str | None) -> dict[str, str]:
    """``Authorization: Bearer $api_key_env``, or no header when ``api_key_env`` is None."""
    if api_key_env is None:
        return {}
    key = os.environ.get(api_key_env)
    if not key:
        raise RemoteRewardError(
            f"api_key_env={api_key_env!r}: that environment variable is not set in the trainer's environment"
        )
    return {"Authorization": f"Bearer {key}"}


async def fetch_json(url: str, payload: dict | None = None, headers: dict[str, str] | None = None) -> Any:
    """POST ``payload`` to ``url`` (GET without one) and return the reply's JSON, retrying what may pass
    (the module doc) until the caller's timeout cancels it."""
    data = None if payload is None else json.dumps(payload, default=_jsonable)
    headers = {"Content-Type": "application/json", **(headers or {})}
    backoff = FIRST_BACKOFF_S
    session = await loop_session()
    while True:
        try:
            async with session.request("GET" if data is None else "POST", url, data=data, headers=headers) as resp:
                text = await resp.text()
                if resp.status not in RETRIED_STATUSES:
                    return _json_reply(url, resp.status, text)
                _warn_retrying(url, f"HTTP {resp.status}: {_start(text)}")
        except aiohttp.ClientConnectionError as e:  # refused, reset, DNS: it may be starting or restarting
            _warn_retrying(url, f"{type(e).__name__}: {e}")
        await asyncio.sleep(backoff)
        backoff = min(2 * backoff, MAX_BACKOFF_S)


async def loop_session() -> aiohttp.ClientSession:
    """The running event loop's session for reward requests: its connections are kept and reused, as a
    connection a call would open and close leaves its port waiting a minute (thousands of rewards a
    second would run out of ports). At most :data:`MAX_CONNECTIONS` at once, others queue.

    It is opened inside an async generator that stays suspended while the loop runs: the loop's
    ``shutdown_asyncgens`` (which ``asyncio.run`` and the rollout pool's loop run before they close)
    resumes it, and its ``async with`` closes the session on its own loop."""
    loop = asyncio.get_running_loop()
    held = _SESSIONS.get(loop)
    if held is None or held[1].closed:
        for closed in [other for other, (_, session) in _SESSIONS.items() if session.closed]:
            del _SESSIONS[closed]  # its loop ended: nothing else holds it
        holder = _hold_session()
        held = _SESSIONS[loop] = (holder, await anext(holder))
    return held[1]


async def _hold_session():
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS)) as session:
        yield session


def _warn_retrying(url: str, problem: str) -> None:
    _RETRY_WARNINGS(
        url, logging.WARNING, "reward service %s: %s; retrying until the call's reward.timeout_seconds", url, problem
    )


def _json_reply(url: str, status: int, text: str) -> Any:
    if status != 200:
        raise RemoteRewardError(f"{url} answered HTTP {status}: {_start(text)}")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise RemoteRewardError(f"{url} answered HTTP 200 with a body that is not JSON: {_start(text)}") from None


def _jsonable(value: Any) -> Any:
    """Row values JSON does not know: numpy's and torch's numbers and arrays as Python's, anything else as text."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else str(value)


def _start(text: str, limit: int = 200) -> str:
    text = text.strip()
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
