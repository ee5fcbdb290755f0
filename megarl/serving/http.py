"""How megarl talks HTTP to the inference servers: sessions, retries, errors, blocking calls.

The rollout side's requests run on its event loop (:func:`arequest_with_retry` over the loop's
:class:`~megarl.serving.kept_http.KeptConnections`); the trainer's control calls are blocking (:func:`http_json`,
:func:`http_ok`: the standard library's client, on the thread that makes them) and its health checks
of many servers go out at once (:func:`http_ok_all`).

Failures of the rollout side's requests fall in three groups:

* connection failures (refused, reset, server gone mid-response, a body cut short): retried with
  backoff; when the budget is spent, :class:`ServerUnavailableError`, which the engine answers by
  marking the server unhealthy and re-issuing the request elsewhere;
* 5xx replies, 408 and 429 (the server is busy), timeouts (no reply before the deadline: a hang; or a
  body that does not arrive whole within :attr:`RetryPolicy.body_timeout` of its headers: a stall or a
  trickle) and malformed bodies (not JSON, an HTML page, or a 200 reply that cannot be trained on):
  retried with backoff, then :class:`InferenceServerError` naming the server, endpoint, attempts and
  last failure;
* other 4xx replies: the request itself is wrong; :class:`InferenceServerError` at once.

Every attempt and every wait between attempts fits in the request's deadline,
:attr:`RetryPolicy.timeout` (``rollout.request_timeout``) from its first attempt: a retry that would
start past it is not made, and the request fails with its last failure.

Each error carries a ``kind`` (:data:`FAILURE_KINDS`) that the rollout pool counts in the
step metrics when it ends an episode for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlencode

import aiohttp

from megarl.serving.kept_http import KeptConnections, ReplyCutError, ReplyTimeout
from megarl.utils import json_codec
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

    def __reduce__(self):  # raised in a trainer head's process, read in another (its arguments, not its text)
        return type(self), (self.address, self.route, self.reason)


class MalformedResponseError(ValueError):
    """A 200 reply whose body is not what the endpoint promises."""


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try one request: its deadline, retries, initial backoff (doubling).

    ``timeout`` is the deadline: seconds from the first attempt to the final result, every attempt and
    backoff included.
    """

    timeout: float = 3600.0
    retries: int = 3
    backoff: float = 1.0
    max_backoff: float = 30.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based)."""
        return min(self.max_backoff, self.backoff * 2 ** (attempt - 1))

    @property
    def body_timeout(self) -> float:
        """Seconds a reply's body may take once its headers are in: one attempt's share of the deadline, so
        that a body that stalls is cut and retried in time. (A read timeout cannot say this: it also times
        the wait for the headers, which for a generation is the whole generation.)"""
        return self.timeout / (self.retries + 1)


class _Retryable(Exception):
    def __init__(self, reason: str, kind: str):
        super().__init__(reason)
        self.reason = reason
        self.kind = kind

    @property
    def connection(self) -> bool:
        return self.kind == "connection"


async def _attempt(
    connections: KeptConnections,
    method: str,
    address: str,
    path: str,
    body: bytes | None,
    policy: RetryPolicy,
    deadline: float,
    parse: Callable[[Any], T],
    expect_json: bool,
    hold: Callable[[], Awaitable[None]] | None,
) -> T:
    """One try, ended by ``deadline`` (``time.monotonic()``); raises _Retryable for retryable failures,
    InferenceServerError for 4xx."""
    try:
        reply = await connections.request(
            address, path, body, method=method, deadline=deadline, body_timeout=policy.body_timeout
        )
        if hold is not None:
            await hold()
        text = reply.body.decode()
    except ReplyTimeout as e:
        if e.waiting_for == "body":
            reason = f"no complete reply: the body did not arrive within {policy.body_timeout:.3g}s of the headers"
        else:
            reason = f"no complete reply within the request's deadline of {policy.timeout:g}s (request_timeout)"
        raise _Retryable(reason, "timeout") from None
    except ReplyCutError as e:
        raise _Retryable(f"reply cut short: {e}", "connection") from None
    except OSError as e:  # refused, reset, closed before replying, not HTTP
        raise _Retryable(f"connection failed: {type(e).__name__}: {e}", "connection") from None
    except UnicodeDecodeError as e:
        raise _Retryable(f"malformed reply (not text: {e})", "malformed") from None
    status = reply.status
    if status >= 500 or status in _BUSY_STATUSES:
        raise _Retryable(f"HTTP {status}: {text[:_BODY_SNIPPET]!r}", "http_5xx" if status >= 500 else "http_4xx")
    if status >= 400:
        raise InferenceServerError(
            f"http://{address}{path}",
            "",
            f"HTTP {status} (bad request, not retried): {text[:_BODY_SNIPPET]!r}",
            kind="http_4xx",
        )
    try:
        return parse((json_codec.loads(reply.body) if text else None) if expect_json else text)
    except (json.JSONDecodeError, MalformedResponseError) as e:
        raise _Retryable(f"malformed reply ({e}): {text[:_BODY_SNIPPET]!r}", "malformed") from None


async def arequest_with_retry(
    connections: KeptConnections,
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
    hold: Callable[[], Awaitable[None]] | None = None,
) -> T:
    """Send one request to ``http://{address}{endpoint}`` over ``connections`` with retries; return
    ``parse(json_body)``.

    ``parse`` may raise :class:`MalformedResponseError` for a body of the wrong shape;
    that is retried like malformed JSON. ``give_up()`` is asked after a connection
    failure; true (e.g. another request already found the server dead) ends the
    retries at once with :class:`ServerUnavailableError`. ``expect_json=False`` hands
    ``parse`` the body text (control endpoints that answer in plain text). ``hold()``, if given, is
    awaited between a reply's arrival and its parsing (the rollout pool holds the replies that come while
    it is paused: the requests its servers abort as a weight update pauses them come back at once, a
    reply per request in flight, and are parsed as the pool resumes, a batch per turn of its loop).
    """
    path = f"{endpoint}?{urlencode(params)}" if params else endpoint
    body = None if payload is None else json_codec.dumps(payload)
    deadline = time.monotonic() + policy.timeout
    last: _Retryable | None = None
    attempts = 0
    for attempt in range(policy.retries + 1):
        if attempt:
            if time.monotonic() + policy.delay(attempt) >= deadline:
                if last.kind != "timeout":  # a timeout's reason names its time already
                    last.reason += f" (no time left to retry within request_timeout={policy.timeout:g}s)"
                break
            await asyncio.sleep(policy.delay(attempt))
        attempts += 1
        try:
            return await _attempt(connections, method, address, path, body, policy, deadline, parse, expect_json, hold)
        except _Retryable as e:
            last = e
            logger.debug("attempt %d/%d on %s%s failed: %s", attempts, policy.retries + 1, address, path, e.reason)
            if e.connection and give_up():
                raise ServerUnavailableError(address, endpoint, e.reason, attempts) from None
        except InferenceServerError as e:
            raise InferenceServerError(address, endpoint, e.reason, attempts, e.kind) from None
    assert last is not None
    error_cls = ServerUnavailableError if last.connection else InferenceServerError
    raise error_cls(address, endpoint, last.reason, attempts, kind=last.kind)


SERVER_KEEPALIVE_S = 3600
"""How long the servers megarl starts keep an idle connection open (vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``,
5 s by default): the trainer's update calls reuse the previous update's connection to each server, where
a new TCP connection per server per update would cost the trainer's process milliseconds each."""

CONTROL_KEEPALIVE_S = SERVER_KEEPALIVE_S / 2
"""How long the trainer's control session keeps an idle connection (shorter than the servers' own, so that
it never sends on a connection the server is closing)."""


def make_session(max_connections: int, keepalive_s: float = 15.0) -> aiohttp.ClientSession:
    """A client session for the running loop with at most ``max_connections`` open sockets (0: no limit),
    each kept ``keepalive_s`` while idle."""
    connector = aiohttp.TCPConnector(
        limit=max_connections, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=keepalive_s
    )
    # Per-request timeouts come from RetryPolicy; the session default must not cut them short.
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None), headers=auth_headers())


# ------------------------------------------------------------------------- blocking calls (the trainer's)

_CONTROL_BODY_SNIPPET = 400


def http_json(
    address: str, route: str, payload: Any = None, timeout: float = 60.0, method: str = "POST", text: bool = False
) -> Any:
    """``method`` ``http://address/route`` with a JSON body, blocking; the decoded JSON reply (None if
    empty), or with ``text`` the reply's text (routes that answer in plain text).
    :class:`ServerControlError` names the server, the route and why a call failed.

    The calling thread does the whole call (the weight update fans out on threads, one per server), so
    no event loop of these calls competes with the rollout pool's for the interpreter."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(
        f"http://{address}{route}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **auth_headers()},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            body = reply.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:_CONTROL_BODY_SNIPPET].decode(errors="replace")
        raise ServerControlError(address, route, f"HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
        raise ServerControlError(address, route, f"unreachable or timed out after {timeout:g}s ({e})") from None
    if text:
        return body.decode(errors="replace")
    try:
        return json.loads(body) if body.strip() else None
    except ValueError:
        raise ServerControlError(address, route, f"reply is not JSON: {body[:_CONTROL_BODY_SNIPPET]!r}") from None


def http_ok(address: str, route: str, timeout: float = 5.0) -> bool:
    """Whether ``GET http://address/route`` answers 200 within ``timeout`` s (a health check), blocking."""
    try:
        with urllib.request.urlopen(f"http://{address}{route}", timeout=timeout) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def http_ok_all(addresses: list[str], route: str, timeout: float = 5.0) -> list[bool]:
    """:func:`http_ok` of each of ``addresses``, all at once on an event loop of the calling thread
    (which must not be running one)."""

    async def ok(session: aiohttp.ClientSession, address: str) -> bool:
        try:
            async with session.get(f"http://{address}{route}", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def every() -> list[bool]:
        async with make_session(len(addresses) + 1) as session:
            return list(await asyncio.gather(*(ok(session, a) for a in addresses)))

    return asyncio.run(every()) if addresses else []
