"""Ports for nodes about to listen: picked where nothing else on the machine will take
them first, and never handed out twice in quick succession, by one launcher or by two
running at once on the machine."""

from __future__ import annotations

import getpass
import os
import random
import socket
import tempfile
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


# Where a handed-out port is claimed, one empty file a port: every launcher of this
# user on the machine sees the claims, so two started at once (two `meshfl launch`,
# two test workers) cannot both be handed a port that neither node has bound yet. A
# probe's bind alone cannot tell them: the port stays free until its node binds it.
def _claims_dir() -> Path:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name (some containers)
        user = "anyone"
    return Path(tempfile.gettempdir()) / f"meshfl-port-claims-{user}"


CLAIMS_DIR = _claims_dir()
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
    node binds it, and each is claimed for HANDED_OUT_S (`claim`), so that no launcher
    on the machine, this one included, is handed it again while its node starts."""
    below_ephemeral = ephemeral_ports_start()
    if below_ephemeral - LOWEST_PICKED_PORT < 1000:  # an OS that lends almost every port
        below_ephemeral = 65536
    candidates = list(range(LOWEST_PICKED_PORT, below_ephemeral))
    _port_picker.shuffle(candidates)
    picked: list[int] = []
    for port in candidates:
        if len(picked) == count:
            break
        if port_is_free(host, port) and claim(host, port):
            picked.append(port)
    if len(picked) < count:
        raise UserError(f"only {len(picked)} of {count} listening ports are free on {host}")
    return picked


def claim(host: str, port: int) -> bool:
    """Whether this process now holds the claim on `port` of `host`: made where there was
    none, taken over where the last one is older than HANDED_OUT_S. Atomic between
    processes: a claim is made by creating its file exclusively, and an old one is taken
    over by renaming it away first, which only one process can do. Where no claim can be
    written at all (a read-only temporary directory), the port is handed out unclaimed,
    as the probe's bind allows."""
    path = CLAIMS_DIR / f"{host}-{port}"
    try:
        CLAIMS_DIR.mkdir(exist_ok=True)
        if _create(path):
            return True
        if time.time() - path.stat().st_mtime < HANDED_OUT_S:
            return False
        taken = path.with_name(f"{path.name}.{os.getpid()}.{time.monotonic_ns()}")
        path.rename(taken)  # raises where another process took it over first
        taken.unlink()
        return _create(path)
    except FileNotFoundError:  # a claim removed or taken over meanwhile: let it be
        return False
    except OSError:
        return True


def _create(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
