"""Ports and addresses: free-port search, the host's reachable IP, host:port strings."""

from __future__ import annotations

import ipaddress
import logging
import os
import random
import socket
from collections.abc import Collection

logger = logging.getLogger(__name__)

HOST_IP_ENV = "MEGARL_HOST_IP"
INTERFACE_ENV = "MEGARL_NETWORK_INTERFACE"  # the sbatch script exports launcher.slurm.network_interface
# Any address outside this machine works: connecting a UDP socket only asks the kernel
# for a route (and so a source address); no packet is sent. 192.0.2.0/24 is TEST-NET-1.
_PROBE_ADDRESS = ("192.0.2.1", 9)
_MAX_ATTEMPTS = 1000


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _try_bind(host: str, port: int) -> socket.socket | None:
    """A TCP socket bound to (host, port), or None if the port is taken."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        # No SO_REUSEADDR: a port in TIME_WAIT is not reported free.
        sock.bind((host, port))
    except OSError:
        sock.close()
        return None
    return sock


def find_free_ports(
    count: int,
    host: str = "127.0.0.1",
    exclude: Collection[int] = (),
    port_range: tuple[int, int] | None = None,
) -> list[int]:
    """Return ``count`` distinct TCP ports that were free on ``host`` just now.

    Every candidate is bound while the search runs, so the ports are distinct; all are
    released before returning, so another process may still grab one (bind soon).

    Args:
        count: How many ports.
        host: Interface to bind on (IPv4 or IPv6 literal).
        exclude: Ports never to return.
        port_range: Inclusive ``(low, high)`` to choose from, in random order; by
            default the OS picks ephemeral ports.
    """
    if count < 1:
        raise ValueError(f"find_free_ports: count must be >= 1, got {count}")
    if port_range is None:
        candidates = (0 for _ in range(max(_MAX_ATTEMPTS, 2 * count)))  # OS picks: every one held is new
    else:
        low, high = port_range
        if not 1 <= low <= high <= 65535:
            raise ValueError(f"find_free_ports: port_range must satisfy 1 <= low <= high <= 65535, got {port_range}")
        candidates = random.sample(range(low, high + 1), high - low + 1)
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for candidate in candidates:
            if candidate in exclude:
                continue
            sock = _try_bind(host, candidate)
            if sock is None:
                continue
            held.append(sock)  # keep excluded OS picks bound too, so they are not offered again
            port = sock.getsockname()[1]
            if port not in exclude:
                ports.append(port)
            if len(ports) == count:
                return ports
    finally:
        for sock in held:
            sock.close()
    raise RuntimeError(
        f"found only {len(ports)} of {count} free ports on {host} (port_range={port_range}, {len(exclude)} excluded)"
    )


def find_free_port(host: str = "127.0.0.1") -> int:
    """One free TCP port on ``host``."""
    return find_free_ports(1, host=host)[0]


def interface_ip(name: str) -> str:
    """The IPv4 address of network interface ``name``; a clear error naming the interfaces there are."""
    import psutil

    addrs = psutil.net_if_addrs()
    if name not in addrs:
        raise ValueError(
            f"network interface {name!r} does not exist on {socket.gethostname()}: "
            f"it has {', '.join(sorted(addrs)) or 'none'} (launcher.slurm.network_interface)"
        )
    ipv4 = [a.address for a in addrs[name] if a.family == socket.AF_INET]
    if not ipv4:
        raise ValueError(f"network interface {name!r} on {socket.gethostname()} has no IPv4 address")
    return ipv4[0]


def gethostip(interface: str | None = None) -> str:
    """The address other nodes can reach this host at.

    ``$MEGARL_HOST_IP`` wins when set; then the IPv4 address of ``interface`` when given,
    else of ``$MEGARL_NETWORK_INTERFACE`` (so every process of a Slurm job, the weight bridge's
    too, uses the cluster interface); otherwise the source address of the default route (found
    without sending any packet); otherwise ``127.0.0.1``.
    """
    env = os.environ.get(HOST_IP_ENV, "").strip()
    if env:
        return env
    interface = interface or os.environ.get(INTERFACE_ENV, "").strip() or None
    if interface:
        return interface_ip(interface)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(_PROBE_ADDRESS)
            ip = sock.getsockname()[0]
    except OSError as e:
        logger.warning("no route to find this host's IP (%s); using 127.0.0.1", e)
        return "127.0.0.1"
    if ip in ("0.0.0.0", ""):
        return "127.0.0.1"
    return ip


def _check_port(port: object, what: str) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"{what}: port must be an int in [0, 65535], got {port!r}")
    return port


def format_host_port(host: str, port: int) -> str:
    """``"host:port"``, with IPv6 literals bracketed (``"[::1]:80"``)."""
    _check_port(port, f"format_host_port({host!r}, {port!r})")
    if not host:
        raise ValueError(f"format_host_port: empty host (port {port})")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def parse_host_port(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` or ``"[v6]:port"`` into ``(host, port)``; IPv6 is unbracketed."""
    what = f"parse_host_port({address!r})"
    host, sep, port_str = address.strip().rpartition(":")
    if not sep or not host or not (port_str.isascii() and port_str.isdigit()):
        raise ValueError(f"{what}: expected 'host:port' or '[ipv6]:port'")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{what}: {host!r} in brackets is not an IPv6 address") from None
    elif ":" in host or "[" in host or "]" in host:
        raise ValueError(f"{what}: IPv6 hosts must be bracketed, e.g. '[::1]:8000'")
    return host, _check_port(int(port_str), what)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) reaches this machine only: ``127.0.0.0/8``, ``::1``."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any address
