"""network: free ports, host IP discovery, host:port formatting and parsing."""

import ipaddress
import socket

import pytest

from megarl.utils import network
from megarl.utils.network import (
    find_free_port,
    find_free_ports,
    format_host_port,
    gethostip,
    parse_host_port,
)


def _bindable(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def test_find_free_ports_distinct_and_bindable():
    ports = find_free_ports(8)
    assert len(set(ports)) == 8
    assert all(_bindable(p) for p in ports)
    assert _bindable(find_free_port())


def test_find_free_ports_finds_more_than_a_thousand():
    """1,024 simulated servers on one host (``benchmarks/scale_sim.py``): the OS's picks are not capped at 1,000."""
    ports = find_free_ports(1100)
    assert len(set(ports)) == 1100


def test_find_free_ports_respects_range_and_exclude():
    excluded = {20001, 20003}
    ports = find_free_ports(3, exclude=excluded, port_range=(20000, 20005))
    assert len(set(ports)) == 3
    assert all(20000 <= p <= 20005 and p not in excluded for p in ports)


def test_find_free_ports_skips_busy_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match="found only 0 of 1"):
            find_free_ports(1, port_range=(taken, taken))


def test_find_free_ports_excluded_os_pick_not_returned(monkeypatch):
    excluded = set()
    real_try_bind = network._try_bind

    def try_bind_excluding_first(host, port):
        sock = real_try_bind(host, port)
        if not excluded:  # pretend the caller had excluded the OS's first pick
            excluded.add(sock.getsockname()[1])
        return sock

    monkeypatch.setattr(network, "_try_bind", try_bind_excluding_first)
    ports = find_free_ports(3, exclude=excluded)
    assert len(set(ports)) == 3 and not excluded & set(ports)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"count": 0}, "count must be >= 1, got 0"),
        ({"count": 1, "port_range": (10, 5)}, r"got \(10, 5\)"),
        ({"count": 1, "port_range": (0, 5)}, r"got \(0, 5\)"),
        ({"count": 1, "port_range": (1, 70000)}, r"got \(1, 70000\)"),
    ],
)
def test_find_free_ports_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        find_free_ports(**kwargs)


def test_gethostip_env_override(monkeypatch):
    monkeypatch.setenv(network.HOST_IP_ENV, " 10.1.2.3 ")
    assert gethostip() == "10.1.2.3"


def test_gethostip_of_an_interface(monkeypatch):
    monkeypatch.delenv(network.HOST_IP_ENV, raising=False)
    assert gethostip("lo") == "127.0.0.1"
    with pytest.raises(ValueError, match=r"network interface 'nope0' does not exist on .*: it has .*\blo\b"):
        gethostip("nope0")


def test_gethostip_route_lookup_sends_nothing(monkeypatch):
    monkeypatch.delenv(network.HOST_IP_ENV, raising=False)
    sent = []
    real_socket = socket.socket

    class SpySocket(real_socket):
        def send(self, *a, **k):
            sent.append(a)
            return super().send(*a, **k)

        def sendto(self, *a, **k):
            sent.append(a)
            return super().sendto(*a, **k)

    monkeypatch.setattr(network.socket, "socket", SpySocket)
    ip = gethostip()
    assert ipaddress.ip_address(ip).version == 4
    assert not sent


def test_gethostip_falls_back_to_loopback(monkeypatch):
    monkeypatch.delenv(network.HOST_IP_ENV, raising=False)

    class NoRoute:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def connect(self, addr):
            raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(network.socket, "socket", NoRoute)
    assert gethostip() == "127.0.0.1"


@pytest.mark.parametrize(
    "host, port, text",
    [
        ("10.0.0.1", 80, "10.0.0.1:80"),
        ("node-01", 0, "node-01:0"),
        ("::1", 8000, "[::1]:8000"),
        ("[fe80::1]", 65535, "[fe80::1]:65535"),
    ],
)
def test_format_and_parse_round_trip(host, port, text):
    assert format_host_port(host, port) == text
    assert parse_host_port(text) == (host.strip("[]"), port)


@pytest.mark.parametrize("port", [-1, 65536, "80", 8.0, True])
def test_format_host_port_bad_port(port):
    with pytest.raises(ValueError, match="port must be an int"):
        format_host_port("h", port)


def test_format_host_port_empty_host():
    with pytest.raises(ValueError, match="empty host"):
        format_host_port("", 80)


@pytest.mark.parametrize(
    "text, match",
    [
        ("localhost", "expected 'host:port'"),
        (":80", "expected 'host:port'"),
        ("host:", "expected 'host:port'"),
        ("host:http", "expected 'host:port'"),
        ("host:-1", "expected 'host:port'"),
        ("host:70000", "port must be an int"),
        ("::1:80", "must be bracketed"),
        ("[nothost]:80", "not an IPv6 address"),
    ],
)
def test_parse_host_port_bad_input(text, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_host_port(text)
    assert repr(text) in str(info.value)


def test_is_loopback():
    from megarl.utils.network import is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "192.0.2.2", "10.0.0.1", "::", "node01", ""))
