"""Hugging Face hub ids as model paths: from the HF cache, downloaded when the hub is reachable (a local
fake hub here, at ``HF_ENDPOINT``), and offline a message naming the id, the cache and the command."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import typing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from megarl.config import GRPOConfig
from megarl.config.base import ConfigError
from megarl.models.provision import HubModelError, hf_hub_cache, hub_snapshot, resolve_model_path
from megarl.run.prelaunch import build_config, load_expr_config

REPO = Path(__file__).resolve().parents[2]
BASE = [str(REPO / "configs/arithmetic_grpo_cpu.yaml")]
REPO_ID = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty HF cache under ``HF_HOME``; offline unless a test says otherwise."""
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf" / "hub"
    assert hf_hub_cache() == cache
    return cache


def _cache_model(cache: Path, model_dir: Path, repo_id: str = REPO_ID, commit: str = COMMIT) -> Path:
    """Put ``model_dir`` into ``cache`` as the hub client lays a download out (blobs, snapshot links, ref)."""
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir()
    for file in model_dir.iterdir():
        blob = storage / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.symlink_to(file)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    return snapshot


def test_a_cached_hub_id_resolves_offline_and_the_config_records_its_directory(hf_cache, tiny_model_dir):
    snapshot = _cache_model(hf_cache, tiny_model_dir("llama"))
    config = build_config(GRPOConfig, BASE, [f"actor.path={REPO_ID}", f"tokenizer_path={REPO_ID}"])
    assert config.actor.path == str(snapshot) and config.tokenizer_path == str(snapshot)
    assert resolve_model_path(REPO_ID) == str(snapshot), "the trainer's and servers' lookup agrees"
    assert hub_snapshot(f"{REPO_ID}@{COMMIT}") == snapshot


def test_a_hub_id_not_cached_offline_names_the_id_the_cache_and_the_command(hf_cache):
    with pytest.raises(ConfigError) as err:
        load_expr_config(["--config", BASE[0], "actor.path=Qwen/Qwen2.5-0.5B-Instruct@v1"], GRPOConfig)
    assert err.value.key == "actor.path"
    message = err.value.message
    assert message.startswith("'Qwen/Qwen2.5-0.5B-Instruct@v1' is no local directory nor a known short name")
    assert f"Qwen/Qwen2.5-0.5B-Instruct@v1 is not in the hub cache {hf_cache}, and HF_HUB_OFFLINE=1 is set" in message
    assert "`megarl models fetch Qwen/Qwen2.5-0.5B-Instruct@v1`" in message
    assert "`hf download Qwen/Qwen2.5-0.5B-Instruct --revision v1`" in message


def test_a_cached_snapshot_without_weights_is_not_taken_for_a_model(hf_cache, tiny_model_dir, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((tiny_model_dir("llama") / "config.json").read_text())
    _cache_model(hf_cache, partial)
    with pytest.raises(HubModelError, match=r"the cached snapshot .* lacks \['\*.safetensors'\], and HF_HUB_OFFLINE=1"):
        hub_snapshot(REPO_ID)


class _FakeHub(BaseHTTPRequestHandler):
    """The hub's model API as ``snapshot_download`` reads it: revision info, file tree, files."""

    files: typing.ClassVar[dict[str, bytes]] = {}
    requests: typing.ClassVar[list[str]] = []

    def _route(self) -> tuple[int, bytes, dict[str, str]]:
        path = unquote(urlparse(self.path).path)
        self.requests.append(f"{self.command} {path}")
        if path == f"/api/models/{REPO_ID}/revision/main":
            siblings = [{"rfilename": name} for name in self.files]
            return 200, json.dumps({"id": REPO_ID, "sha": COMMIT, "siblings": siblings}).encode(), {}
        if path == f"/api/models/{REPO_ID}/tree/{COMMIT}":
            tree = [
                {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                for name, data in self.files.items()
            ]
            return 200, json.dumps(tree).encode(), {}
        prefix = f"/{REPO_ID}/resolve/{COMMIT}/"
        if path.startswith(prefix) and path[len(prefix) :] in self.files:
            data = self.files[path[len(prefix) :]]
            return 200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
        return 404, b'{"error": "not found"}', {"X-Error-Code": "RepoNotFound"}

    def _answer(self, body: bool) -> None:
        status, data, headers = self._route()
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **headers, "Content-Length": str(len(data))}.items():
            self.send_header(name, value)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def do_GET(self):
        self._answer(body=True)

    def do_HEAD(self):
        self._answer(body=False)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_hub(monkeypatch, tiny_model_dir):
    """A local HTTP server holding ``tiny-org/tiny-llama`` (the tiny model plus a file no pattern fetches);
    online (``huggingface_hub`` read ``HF_HUB_OFFLINE`` at import, where the Makefile sets it)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    model = tiny_model_dir("llama")
    _FakeHub.files = {file.name: file.read_bytes() for file in model.iterdir() if file.is_file()}
    _FakeHub.files["pytorch_model.bin"] = b"not fetched: megarl loads safetensors"
    _FakeHub.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield _FakeHub
    server.shutdown()
    server.server_close()


def test_a_hub_id_not_cached_is_downloaded_when_the_hub_is_reachable(hf_cache, fake_hub, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    config = build_config(GRPOConfig, BASE, [f"actor.path={REPO_ID}"])
    snapshot = hf_cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    assert config.actor.path == str(snapshot)
    assert sorted(f.name for f in snapshot.iterdir()) == sorted(n for n in fake_hub.files if n != "pytorch_model.bin")
    assert (snapshot / "model.safetensors").read_bytes() == fake_hub.files["model.safetensors"]
    # now cached: offline, no request
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_hub.requests.clear()
    assert build_config(GRPOConfig, BASE, [f"actor.path={REPO_ID}"]).actor.path == str(snapshot)
    assert fake_hub.requests == []


def test_an_unreachable_or_unknown_hub_repo_names_the_endpoint_and_the_command(hf_cache, fake_hub, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(HubModelError) as err:
        hub_snapshot("tiny-org/no-such-model")
    assert f"not in the hub cache {hf_cache}, and downloading it from {os.environ['HF_ENDPOINT']} failed" in str(
        err.value
    )
    assert "`megarl models fetch tiny-org/no-such-model`" in str(err.value)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(
        HubModelError, match=r"downloading it from http://127.0.0.1:9 failed .*`hf download tiny-org/x`"
    ):
        hub_snapshot("tiny-org/x")


def test_megarl_models_fetch_fills_the_cache_an_offline_run_reads(hf_cache, fake_hub, monkeypatch, capsys):
    from megarl.launcher.cli import main

    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert main(["models", "fetch", REPO_ID]) == 0
    snapshot = hf_cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    assert capsys.readouterr().out.strip() == str(snapshot)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert build_config(GRPOConfig, BASE, [f"actor.path={REPO_ID}"]).actor.path == str(snapshot)
    assert main(["models", "fetch", "tiny-org/absent"]) == 2
    assert "megarl models: error: tiny-org/absent is not in the hub cache" in capsys.readouterr().err
