"""The run's API key: the inference servers refuse every request that does not carry it.

The launchers make a fresh key per run (:func:`run_api_key`) and hand it to every server and
trainer process in ``$MEGARL_API_KEY`` (never on a command line, where ``ps`` would show it, and
never in the saved config). Clients add :func:`auth_headers` to each request: the rollout pool,
the weight bridge's control calls, the health checks.

vLLM's own ``--api-key`` (here ``$VLLM_API_KEY``) guards only its ``/v1`` routes, not the
development routes megarl needs (``/pause``, ``/resume``, the weight-update routes), so vLLM
servers also load :class:`RequireApiKey` (``--middleware``), which guards every route but
``/health``. Without a key in the environment (a server started by hand, the tests' shared
server) nothing is guarded.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

API_KEY_ENV = "MEGARL_API_KEY"
"""Environment variable holding the run's key."""
OPEN_ROUTES = ("/health",)
"""Routes answered without the key (liveness only)."""


def api_key() -> str:
    """This process's run key ('' when none)."""
    return os.environ.get(API_KEY_ENV, "")


@contextmanager
def run_api_key() -> Iterator[str]:
    """The run's key in this process's environment while the run lasts (its children inherit it);
    made fresh unless one is set already (then kept, e.g. from the Slurm script)."""
    if api_key():
        yield api_key()
        return
    os.environ[API_KEY_ENV] = secrets.token_urlsafe(32)
    try:
        yield api_key()
    finally:
        os.environ.pop(API_KEY_ENV, None)


KEY_FILE = "api_key"
"""``{run_dir}/api_key``: the run's key, readable by its owner only, for servers that join the run later
(``megarl serve --join RUN_DIR``)."""


def save_run_key(run_dir) -> None:
    """Write this process's key to ``{run_dir}/api_key`` (mode 0600); nothing without a key."""
    if not api_key():
        return
    path = os.path.join(run_dir, KEY_FILE)
    os.makedirs(run_dir, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(api_key() + "\n")


def load_run_key(run_dir) -> None:
    """Take the run's key from ``{run_dir}/api_key`` unless this process has one (a run without a key: none)."""
    path = os.path.join(run_dir, KEY_FILE)
    if not api_key() and os.path.exists(path):
        with open(path) as f:
            os.environ[API_KEY_ENV] = f.read().strip()


def auth_headers() -> dict[str, str]:
    """``Authorization: Bearer <key>`` when this process has a run key."""
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class RequireApiKey:
    """ASGI middleware: 401 for any request to a route outside :data:`OPEN_ROUTES` without the key."""

    def __init__(self, app):
        self.app = app
        key = api_key()
        self._digest = _digest(key) if key else None

    async def __call__(self, scope, receive, send):
        if (
            self._digest is None
            or scope["type"] != "http"
            or scope.get("method") == "OPTIONS"
            or self._authorized(scope)
        ):
            return await self.app(scope, receive, send)
        from starlette.responses import JSONResponse

        reply = JSONResponse({"error": "Unauthorized: this server needs the run's API key ($MEGARL_API_KEY)"}, 401)
        await reply(scope, receive, send)

    def _authorized(self, scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_ROUTES:
            return True
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(_digest(token), self._digest)
