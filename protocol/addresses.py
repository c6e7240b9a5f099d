"""What a node may be dialled at: a ZeroMQ TCP endpoint, and nothing else.

Every address a node dials came from someone: its own configuration, a contact string,
or a signed message of a stranger. ZeroMQ would take `ipc://`, `inproc://`, `udp://` or a
wildcard for a connect, and fail on garbage only once it tries; a node decides first.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket

TCP_ENDPOINT_FORM = "tcp://HOST:PORT, HOST a hostname, IPv4 or [IPv6] address, 1 <= PORT <= 65535"
WIRE_ENDPOINT_FORM = "tcp://IP:PORT, IP an IPv4 or [IPv6] address, 1 <= PORT <= 65535"
MAX_ADDRESS_CHARS = 300  # a 253-character hostname with its scheme and port fits

# No named groups: it is also a pattern of the config's JSON Schema (ECMAScript regex).
TCP_ENDPOINT_PATTERN = r"tcp://(\[[^\]]*\]|[^:/\[\]]+):([0-9]{1,5})"
_ENDPOINT = re.compile(TCP_ENDPOINT_PATTERN)
_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*")


def tcp_endpoint(address: object) -> tuple[str, int] | None:
    """(host, port) of `address` when it is a ZeroMQ TCP endpoint a node can dial (see
    TCP_ENDPOINT_FORM), the host lowercased and `localhost` read as 127.0.0.1 so that two
    spellings of one socket compare equal; None for anything else."""
    if not isinstance(address, str) or len(address) > MAX_ADDRESS_CHARS:
        return None
    match = _ENDPOINT.fullmatch(address)
    if not match or not 1 <= int(match[2]) <= 65535:
        return None
    host = match[1]
    try:
        if host.startswith("["):
            host = f"[{ipaddress.IPv6Address(host[1:-1])}]"
        elif host.replace(".", "").isdigit():
            host = str(ipaddress.IPv4Address(host))
        elif not _HOSTNAME.fullmatch(host) or len(host) > 253:
            return None
    except ValueError:
        return None
    if host.lower() == "localhost":  # the loopback's name: the same socket as 127.0.0.1
        host = "127.0.0.1"
    return host.lower(), int(match[2])


def is_wire_endpoint(address: object) -> bool:
    """Whether a message may name `address` (WIRE.md 5): a TCP endpoint whose host is an
    IP address. ZeroMQ resolves a hostname on its one I/O thread, blocking every socket
    of the node while it waits: a stranger's hostname must never reach it."""
    return isinstance(address, str) and _is_wire_endpoint(address)


@functools.lru_cache(maxsize=4096)  # every heartbeat and hello names its sender's address
def _is_wire_endpoint(address: str) -> bool:
    endpoint = tcp_endpoint(address)
    return endpoint is not None and _is_ip(endpoint[0])


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def resolved(address: str) -> str:
    """`address` with its hostname, if any, resolved once to an IP address: what a node
    tells others to dial (they take IP addresses only); `localhost` is 127.0.0.1.
    Unresolvable: left as it is."""
    endpoint = tcp_endpoint(address)
    if endpoint is None:
        return address
    host, port = endpoint
    if _is_ip(host):  # localhost among them, read as 127.0.0.1
        return f"tcp://{host}:{port}"
    try:
        family, *_, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        return address
    ip = sockaddr[0]
    return f"tcp://[{ip}]:{port}" if family == socket.AF_INET6 else f"tcp://{ip}:{port}"


# How a bounded view groups the addresses it limits (WIRE.md 7.7): `auto` by /24 (IPv4)
# or /48 (IPv6) network for global addresses, and any other (loopback, private,
# link-local: one machine, or a LAN one operator runs) by address and port, so that no
# limit binds there; or every address by `network`, by `ip` (a LAN of machines not all
# trusted alike), or by `port`.
GROUPINGS = ("auto", "network", "ip", "port")
NETWORK_BITS = {4: 24, 6: 48}
MACHINE_BITS = {4: 32, 6: 64}  # what one machine commonly holds: an address, an IPv6 /64


@functools.lru_cache(maxsize=4096)
def network_group(address: str, by: str = "auto") -> str:
    """The group `address` counts against, under the grouping `by` (GROUPINGS). A
    hostname is a group of its own; so is anything that is not a TCP endpoint."""
    endpoint = tcp_endpoint(address)
    if endpoint is None or not _is_ip(endpoint[0]):
        return address
    ip = ipaddress.ip_address(endpoint[0].strip("[]"))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:a.b.c.d is a.b.c.d
    if by == "auto":
        by = "network" if ip.is_global else "port"
    if by == "port":
        return address
    if by == "ip":
        return str(ip)
    return str(ipaddress.ip_network(f"{ip}/{NETWORK_BITS[ip.version]}", strict=False))


@functools.lru_cache(maxsize=4096)
def machine_of(address: str) -> str:
    """The machine `address` is on, as far as an address tells: its IPv4 address, or
    the /64 of its IPv6 address; a hostname, or anything not a TCP endpoint, itself."""
    endpoint = tcp_endpoint(address)
    if endpoint is None or not _is_ip(endpoint[0]):
        return address
    ip = ipaddress.ip_address(endpoint[0].strip("[]"))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ipaddress.ip_network(f"{ip}/{MACHINE_BITS[ip.version]}", strict=False))
