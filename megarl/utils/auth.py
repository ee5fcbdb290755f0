"""The run's API key: the inference servers refuse every request that does not carry it.

The launchers make a fresh key per run (:func:`run_api_key`) and hand it to every server and
trainer process in ``$MEGARL_API_KEY`` (never on a command line, where ``ps`` would show it, and
never in the saved config). ``megarl serve`` started by hand without that variable takes the run's
key from ``{run_dir}/api_key``, creating it (mode 0600) when missing (:func:`server_key`). Clients
add :func:`auth_headers` to each request: the rollout pool, the weight bridge's control calls.

vLLM's own ``--api-key`` (here ``$VLLM_API_KEY``) guards only its ``/v1`` routes, not the
development routes megarl needs (``/pause``, ``/resume``, the weight-update routes,
``/collective_rpc``), so vLLM servers also load :class:`RequireApiKey` (``--middleware``), which
guards every route but ``/health``. A server runs without a key only when told so in so many words
(``megarl serve --insecure``, ``insecure=True`` of the launch specs: :func:`unguarded_env`); a
server without a key that was not told so refuses every guarded route. A server launched from library code
on loopback in a process without a key gets a key made for that process (:func:`server_guard_env`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megarl.utils.network import is_loopback

logger = logging.getLogger(__name__)

API_KEY_ENV = "MEGARL_API_KEY"
"""Environment variable holding the run's key."""
INSECURE_ENV = "MEGARL_INSECURE"
"""Set to ``1`` in the environment of a server started without a key on purpose (``--insecure``)."""
OPEN_ROUTES = ("/health",)
"""Routes answered without the key (liveness only)."""
KEY_FILE = "api_key"
"""``{run_dir}/api_key``: the run's key, readable by its owner only: for servers that join the run later
(``megarl serve --join RUN_DIR``), servers started by hand and a trainer started by hand."""


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


def save_run_key(run_dir) -> None:
    """Write this process's key to ``{run_dir}/api_key`` (mode 0600); nothing without a key."""
    if not api_key():
        return
    path = os.path.join(run_dir, KEY_FILE)
    os.makedirs(run_dir, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # a file that existed keeps its mode otherwise
        f.write(api_key() + "\n")


def load_run_key(run_dir) -> None:
    """Take the run's key from ``{run_dir}/api_key`` unless this process has one (a run without a key: none)."""
    path = os.path.join(run_dir, KEY_FILE)
    if not api_key() and os.path.exists(path):
        os.environ[API_KEY_ENV] = _read_key(Path(path))


def server_key(run_dir) -> Path | None:
    """Give a server started by hand (and this process's children) the run's key in ``$MEGARL_API_KEY``.

    ``$MEGARL_API_KEY`` wins when set (returns None); else the key in ``{run_dir}/api_key`` (returns its
    path), made fresh when that file does not exist yet. Several servers of one run started at once
    on a shared run directory end up with the same key: the file appears whole or not at all.
    """
    if api_key():
        return None
    path = Path(run_dir) / KEY_FILE
    if not path.exists():
        _create_key_file(path)
    load_run_key(run_dir)
    return path


def _create_key_file(path: Path) -> None:
    """Write a fresh key to ``path`` (mode 0600) unless another process did first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        os.link(tmp, path)  # atomic, and fails when the file exists: the first writer's key stays
        logger.info("made the run's API key: %s", path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()


def _read_key(path: Path) -> str:
    key = path.read_text().strip()
    if not key:
        raise ValueError(f"{path} holds no API key: delete it (a fresh one is made) or set ${API_KEY_ENV}")
    return key


def server_guard_env(host: str, insecure: bool, server: str) -> dict[str, str]:
    """The environment that guards a server this process launches at ``host``; a ``ValueError`` when none may.

    With this process's key: the key guards it (empty; the launch spec hands the key over). Without one:
    ``insecure`` serves every route without a key (:func:`unguarded_env`); on loopback a key is made for this
    process (:func:`make_process_key`), which its clients and the processes it starts afterwards send;
    on an address other machines reach, its clients there need the key too: refused, saying how to pass one.
    """
    if api_key():
        return {}
    if insecure:
        return unguarded_env(host, server)
    if is_loopback(host):
        make_process_key(server)
        return {}
    raise ValueError(
        f"refusing to start {server} on {host}, an address other machines can reach, without an API key: anyone "
        f"who reaches it could pause it, run code in its workers (/collective_rpc) and replace its weights. Set "
        f"${API_KEY_ENV} to the key its clients send (megarl serve makes one in {{run_dir}}/{KEY_FILE} by itself), "
        "or serve without a key: insecure=True of the launch spec (vllm_launch_spec, sglang_launch_spec, "
        "server_spec), --insecure of megarl serve"
    )


def make_process_key(server: str) -> str:
    """A fresh key in this process's ``$MEGARL_API_KEY``: the servers it launches, its clients (made after
    this) and the processes it starts afterwards share it."""
    os.environ[API_KEY_ENV] = secrets.token_urlsafe(32)
    logger.info("%s: made an API key for this process in $%s, which its clients send", server, API_KEY_ENV)
    return api_key()


def unguarded_env(host: str, server: str) -> dict[str, str]:
    """The environment of a server launched at ``host`` without a key on purpose (``insecure``)."""
    if not is_loopback(host):
        logger.warning(
            "%s on %s without an API key (insecure): every route, /collective_rpc and the weight-update "
            "routes included, is open to anyone who reaches that address",
            server,
            host,
        )
    return {INSECURE_ENV: "1"}


def auth_headers() -> dict[str, str]:
    """``Authorization: Bearer <key>`` when this process has a run key."""
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class RequireApiKey:
    """ASGI middleware: 401 for any request to a route outside :data:`OPEN_ROUTES` without the key.

    Without a key it lets every request through only in a server started without one on purpose
    (``$MEGARL_INSECURE=1``, set by ``--insecure``); otherwise it refuses every guarded route.
    """

    def __init__(self, app):
        self.app = app
        key = api_key()
        self._digest = _digest(key) if key else None
        self._open = self._digest is None and os.environ.get(INSECURE_ENV) == "1"

    async def __call__(self, scope, receive, send):
        if self._open or scope["type"] != "http" or scope.get("method") == "OPTIONS" or self._authorized(scope):
            return await self.app(scope, receive, send)
        from starlette.responses import JSONResponse

        reply = JSONResponse({"error": self._refusal()}, 401)
        await reply(scope, receive, send)

    def _refusal(self) -> str:
        if self._digest is None:
            return (
                f"Unauthorized: this server was started without an API key (${API_KEY_ENV}); restart it with "
                "one, or without one on purpose: insecure=True of the launch spec (vllm_launch_spec, "
                "sglang_launch_spec, server_spec), --insecure of megarl serve"
            )
        return f"Unauthorized: this server needs the run's API key (${API_KEY_ENV})"

    def _authorized(self, scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_ROUTES:
            return True
        if self._digest is None:
            return False
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(_digest(token), self._digest)
