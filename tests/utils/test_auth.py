"""The run's key for servers started by hand (``{run_dir}/api_key``, mode 0600, or ``$MEGARL_API_KEY``) and the
rule that a server without a key must be told ``insecure`` in so many words, or, launched from library code on
loopback, gets a key made for its process."""

from __future__ import annotations

import logging

import pytest

from megarl.utils.auth import (
    API_KEY_ENV,
    INSECURE_ENV,
    KEY_FILE,
    api_key,
    auth_headers,
    server_guard_env,
    server_key,
)


@pytest.fixture
def no_key(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)


def test_a_server_by_hand_makes_the_run_key_once_readable_by_its_owner_only(tmp_path, monkeypatch, no_key):
    run_dir = tmp_path / "exp" / "trial0"
    path = server_key(run_dir)
    assert path == run_dir / KEY_FILE and path.stat().st_mode & 0o777 == 0o600
    made = api_key()
    assert len(made) >= 32 and path.read_text().strip() == made
    assert [p.name for p in run_dir.iterdir()] == [KEY_FILE], "no temporary file is left behind"
    monkeypatch.delenv(API_KEY_ENV)
    assert server_key(run_dir) == path and api_key() == made, "a second server of the run takes the same key"


def test_a_server_by_hand_takes_megarl_api_key_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-the-script")
    assert server_key(tmp_path) is None and api_key() == "from-the-script"
    assert not (tmp_path / KEY_FILE).exists()


def test_an_empty_key_file_is_an_error_that_says_what_to_do(tmp_path, no_key):
    (tmp_path / KEY_FILE).write_text("\n")
    with pytest.raises(ValueError, match=f"holds no API key: delete it .* or set \\${API_KEY_ENV}"):
        server_key(tmp_path)


def test_no_key_off_loopback_is_refused_naming_the_library_option(no_key):
    with pytest.raises(ValueError) as refused:
        server_guard_env("192.0.2.7", insecure=False, server="vLLM server 0")
    message = str(refused.value)
    assert "on 192.0.2.7, an address other machines can reach" in message and "/collective_rpc" in message
    assert f"${API_KEY_ENV}" in message and "insecure=True of the launch spec" in message
    assert api_key() == "", "no key is made for a server other machines' clients reach"


def test_no_key_on_loopback_makes_one_for_the_process(no_key):
    """A server launched from library code (no launcher, no key): guarded by a key this process's clients send."""
    assert server_guard_env("127.0.0.1", insecure=False, server="vLLM server 0") == {}
    made = api_key()
    assert len(made) >= 32 and auth_headers() == {"Authorization": f"Bearer {made}"}
    assert server_guard_env("127.0.0.1", insecure=False, server="vLLM server 1") == {} and api_key() == made


def test_insecure_serves_without_a_key_and_a_key_always_guards(monkeypatch, no_key, caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.utils.auth"):
        assert server_guard_env("127.0.0.1", insecure=True, server="s") == {INSECURE_ENV: "1"}
        assert not caplog.records
        assert server_guard_env("192.0.2.7", insecure=True, server="s") == {INSECURE_ENV: "1"}
    assert "open to anyone who reaches that address" in caplog.text and api_key() == ""
    monkeypatch.setenv(API_KEY_ENV, "k")
    assert server_guard_env("192.0.2.7", insecure=False, server="s") == {}
    assert server_guard_env("192.0.2.7", insecure=True, server="s") == {}, "a key always guards"
