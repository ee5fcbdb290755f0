"""megarl's one HTTP stack to the inference servers (aiohttp): sessions, retries, errors, blocking calls.

The rollout side's requests run on its event loop (:func:`arequest_with_retry` on a
:func:`make_session`); the trainer's control calls are blocking (:func:`http_json`, :func:`http_ok`)
and run on one event loop kept in a thread of this process, with one session for every server
(connections kept between calls: a weight update's pause, update and commit reuse them).

Failures of the rollout side's requests fall in three groups:

* connection failures (refused, reset, server gone mid-response): retried with backoff;
  when the budget is spent, :class:`ServerUnavailableError`, which the engine answers by
  marking the server unhealthy and re-issuing the request elsewhere;
* 5xx replies, 408 and 429 (the server is busy), timeouts (no complete reply within
  ``request_timeout``: a hang or a trickle) and malformed bodies (not JSON, an HTML page,
  cut short, or a 200 reply that cannot be trained on): retried with backoff, then
  :class:`InferenceServerError` naming the server, endpoint, attempts and last failure;
* other 4xx replies: the request itself is wrong; :class:`InferenceServerError` at once.

Each error carries a ``kind`` (:data:`FAILURE_KINDS`) that the rollout pool counts in the
step metrics when it ends an episode for it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from megarl.utils.auth import auth_headers

logger = logging.getLogger(__name__)

T = TypeVar("T")
_BODY_SNIPPET = 300
_BUSY_STATUSES = (408, 429)  # 4xx that mean "not now" rather than "never": retried like a 5xx

FAILURE_KINDS = ("http_4xx", "http_5xx", "timeout", "malformed", "connection", "no_server", "server_lost", "other")
"""Why a request failed for good, as counted in ``rollout/failed/{kind}``."""


class InferenceServerError(RuntimeError):
    """A request to an inference server failed for good (see the message for why).

    ``kind`` is one of :data:`FAILURE_KINDS`.
    """

    def __init__(self, address: str, endpoint: str, reason: str, attempts: int = 1, kind: str = "other"):
        self.address = address
        self.endpoint = endpoint
        self.reason = reason
        self.attempts = attempts
        self.kind = kind
        tries = f" after {attempts} attempt{'s' if attempts != 1 else ''}" if attempts else ""
        super().__init__(f"inference server {address}{endpoint} failed{tries}: {reason}")


class ServerUnavailableError(InferenceServerError):
    """The server could not be reached (or dropped the connection) on every attempt."""

    def __init__(self, address: str, endpoint: str, reason: str, attempts: int = 1, kind: str = "connection"):
        super().__init__(address, endpoint, reason, attempts, kind)


class ServerControlError(RuntimeError):
    """A control call to an inference server failed (unreachable, error reply, timeout)."""

    def __init__(self, address: str, route: str, reason: str):
        self.address, self.route, self.reason = address, route, reason
        super().__init__(f"inference server {address}{route}: {reason}")


class MalformedResponseError(ValueError):
    """A 200 reply whose body is not what the endpoint promises."""


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try one request: timeout per attempt, retries, initial backoff (doubling)."""

    timeout: float = 3600.0
    retries: int = 3
    backoff: float = 1.0
    max_backoff: float = 30.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based)."""
        return min(self.max_backoff, self.backoff * 2 ** (attempt - 1))


class _Retryable(Exception):
    def __init__(self, reason: str, kind: str):
        super().__init__(reason)
        self.reason = reason
        self.kind = kind

    @property
    def connection(self) -> bool:
        return self.kind == "connection"


async def _attempt(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    payload: Any,
    params: dict | None,
    timeout: float,
    parse: Callable[[Any], T],
    expect_json: bool,
) -> T:
    """One try; raises _Retryable for retryable failures, InferenceServerError for 4xx."""
    try:
        async with session.request(
            method, url, json=payload, params=params, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            text = await resp.text()
            status = resp.status
    except TimeoutError:
        raise _Retryable(f"no complete reply within {timeout:g}s (request_timeout)", "timeout") from None
    except aiohttp.ClientPayloadError as e:  # the body ended short of its length, or could not be decoded
        raise _Retryable(f"reply cut short: {type(e).__name__}: {e}", "connection") from None
    except (aiohttp.ClientConnectionError, ConnectionError) as e:
        raise _Retryable(f"connection failed: {type(e).__name__}: {e}", "connection") from None
    except UnicodeDecodeError as e:
        raise _Retryable(f"malformed reply (not text: {e})", "malformed") from None
    if status >= 500 or status in _BUSY_STATUSES:
        raise _Retryable(f"HTTP {status}: {text[:_BODY_SNIPPET]!r}", "http_5xx" if status >= 500 else "http_4xx")
    if status >= 400:
        raise InferenceServerError(
            url, "", f"HTTP {status} (bad request, not retried): {text[:_BODY_SNIPPET]!r}", kind="http_4xx"
        )
    try:
        body = (json.loads(text) if text else None) if expect_json else text
        return parse(body)
    except (json.JSONDecodeError, MalformedResponseError) as e:
        raise _Retryable(f"malformed reply ({e}): {text[:_BODY_SNIPPET]!r}", "malformed") from None


async def arequest_with_retry(
    session: aiohttp.ClientSession,
    address: str,
    endpoint: str,
    payload: Any = None,
    *,
    method: str = "POST",
    params: dict | None = None,
    policy: RetryPolicy = RetryPolicy(),
    parse: Callable[[Any], T] = lambda body: body,
    give_up: Callable[[], bool] = lambda: False,
    expect_json: bool = True,
) -> T:
    """Send one request to ``http://{address}{endpoint}`` with retries; return ``parse(json_body)``.

    ``parse`` may raise :class:`MalformedResponseError` for a body of the wrong shape;
    that is retried like malformed JSON. ``give_up()`` is asked after a connection
    failure; true (e.g. another request already found the server dead) ends the
    retries at once with :class:`ServerUnavailableError`. ``expect_json=False`` hands
    ``parse`` the body text (control endpoints that answer in plain text).
    """
    url = f"http://{address}{endpoint}"
    last: _Retryable | None = None
    for attempt in range(policy.retries + 1):
        if attempt:
            await asyncio.sleep(policy.delay(attempt))
        try:
            return await _attempt(session, method, url, payload, params, policy.timeout, parse, expect_json)
        except _Retryable as e:
            last = e
            logger.debug("attempt %d/%d on %s failed: %s", attempt + 1, policy.retries + 1, url, e.reason)
            if e.connection and give_up():
                raise ServerUnavailableError(address, endpoint, e.reason, attempt + 1) from None
        except InferenceServerError as e:
            raise InferenceServerError(address, endpoint, e.reason, attempt + 1, e.kind) from None
    assert last is not None
    error_cls = ServerUnavailableError if last.connection else InferenceServerError
    raise error_cls(address, endpoint, last.reason, policy.retries + 1, kind=last.kind)


def make_session(max_connections: int) -> aiohttp.ClientSession:
    """A client session for the running loop with at most ``max_connections`` open sockets."""
    connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, ttl_dns_cache=300)
    # Per-request timeouts come from RetryPolicy; the session default must not cut them short.
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None), headers=auth_headers())


# ------------------------------------------------------------------------- blocking calls (the trainer's)

_CONTROL_BODY_SNIPPET = 400
_blocking_lock = threading.Lock()
_blocking: tuple[int, asyncio.AbstractEventLoop] | None = None  # (pid, loop) of this process's control loop
_control_session: aiohttp.ClientSession | None = None  # on that loop


def _control_loop() -> asyncio.AbstractEventLoop:
    """This process's control loop, in a daemon thread started on first use (again after a fork)."""
    global _blocking, _control_session
    with _blocking_lock:
        if _blocking is None or _blocking[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="megarl-http", daemon=True).start()
            _blocking, _control_session = (os.getpid(), loop), None
            atexit.register(_close_control_session, loop, os.getpid())
        return _blocking[1]


def _close_control_session(loop: asyncio.AbstractEventLoop, pid: int) -> None:
    """At exit: close the control loop's session (its sockets) while the loop still runs (not in a forked
    child, which has neither)."""
    session = _control_session
    if pid == os.getpid() and session is not None and not session.closed and loop.is_running():
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(session.close(), loop).result(timeout=5)


def run_blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on this process's control loop and wait for its result (from any thread but that loop's)."""
    return asyncio.run_coroutine_threadsafe(coro, _control_loop()).result()


def _session() -> aiohttp.ClientSession:
    """The control loop's session (on the loop): no cap on connections, every server's kept open."""
    global _control_session
    if _control_session is None or _control_session.closed:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        _control_session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
    return _control_session


async def _ajson(address: str, route: str, payload: Any, timeout: float, method: str, text: bool) -> Any:
    try:
        async with _session().request(
            method,
            f"http://{address}{route}",
            data=None if payload is None else json.dumps(payload),
            headers={"Content-Type": "application/json", **auth_headers()},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as reply:
            body = await reply.read()
            status = reply.status
    except (TimeoutError, aiohttp.ClientError, OSError) as e:  # refused, reset, cut short, timed out
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise ServerControlError(address, route, f"unreachable or timed out after {timeout:g}s ({why})") from None
    if status >= 400:
        detail = body[:_CONTROL_BODY_SNIPPET].decode(errors="replace")
        raise ServerControlError(address, route, f"HTTP {status}: {detail}")
    if text:
        return body.decode(errors="replace")
    try:
        return json.loads(body) if body.strip() else None
    except ValueError:
        raise ServerControlError(address, route, f"reply is not JSON: {body[:_CONTROL_BODY_SNIPPET]!r}") from None


def http_json(
    address: str, route: str, payload: Any = None, timeout: float = 60.0, method: str = "POST", text: bool = False
) -> Any:
    """``method`` ``http://address/route`` with a JSON body, blocking; the decoded JSON reply (None if
    empty), or with ``text`` the reply's text (routes that answer in plain text).
    :class:`ServerControlError` names the server, the route and why a call failed."""
    return run_blocking(_ajson(address, route, payload, timeout, method, text))


def http_ok(address: str, route: str, timeout: float = 5.0) -> bool:
    """Whether ``GET http://address/route`` answers within ``timeout`` s without an error (a health check)."""
    return http_ok_all([address], route, timeout)[0]


def http_ok_all(addresses: list[str], route: str, timeout: float = 5.0) -> list[bool]:
    """:func:`http_ok` of each of ``addresses``, all at once, blocking."""

    async def ok(address: str) -> bool:
        try:
            await _ajson(address, route, None, timeout, "GET", True)
        except ServerControlError:
            return False
        return True

    async def every() -> list[bool]:
        return list(await asyncio.gather(*(ok(a) for a in addresses)))

    return run_blocking(every()) if addresses else []
