"""Ports for nodes about to listen: picked where nothing else on the machine will take
them first, and never handed out twice by one process in quick succession."""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path

from .errors import UserError

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Listening ports are picked at or above this, and below the ephemeral range.
LOWEST_PICKED_PORT = 20000
# A port handed out is not handed out again for this long: time for the node it was
# meant for to bind it. Then it may be again, if free, so that a process that starts
# mesh after mesh never runs out.
HANDED_OUT_S = 600.0
_handed_out: dict[tuple[str, int], float] = {}  # (host, port) -> when it was handed out
# A generator of its own: a run that seeds `random` must not make two launchers on one
# machine pick the same ports.
_port_picker = random.Random()


def ephemeral_ports_start() -> int:
    """The first port the OS may give an outgoing connection (Linux's default, 32768,
    where it does not say)."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` different ports free on `host` right now, for nodes about to listen.

    They are picked below the OS's ephemeral range, so that no outgoing connection (the
    mesh's first nodes dial out while later ones still start) can take one before its
    node binds it, and not twice in one process within HANDED_OUT_S, so two meshes
    started one after the other from one launcher cannot be handed the same port."""
    now = time.monotonic()
    recent = {key for key, when in _handed_out.items() if now - when < HANDED_OUT_S}
    below_ephemeral = ephemeral_ports_start()
    if below_ephemeral - LOWEST_PICKED_PORT < 1000:  # an OS that lends almost every port
        below_ephemeral = 65536
    candidates = list(range(LOWEST_PICKED_PORT, below_ephemeral))
    _port_picker.shuffle(candidates)
    picked: list[int] = []
    for port in candidates:
        if len(picked) == count:
            break
        if (host, port) not in recent and port_is_free(host, port):
            picked.append(port)
    if len(picked) < count:
        raise UserError(f"only {len(picked)} of {count} listening ports are free on {host}")
    _handed_out.update({(host, port): now for port in picked})
    return picked


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
