"""Ports for nodes about to listen: picked where nothing else on the machine will take
them first, and never handed out twice in quick succession, by one launcher or by two
of the user's running at once on the machine."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from .errors import UserError

try:
    import fcntl
except ImportError:  # Windows: the claims stay in the launcher's memory
    fcntl = None  # type: ignore[assignment]

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Listening ports are picked at or above this, and below the ephemeral range.
LOWEST_PICKED_PORT = 20000
# A port handed out is not handed out again for this long: time for the node it was
# meant for to bind it. Then it may be again, if free, so that a process that starts
# mesh after mesh never runs out.
HANDED_OUT_S = 600.0
# Where the user's launchers on this machine claim the ports they hand out (one empty
# file a port, its time the claim's), under a lock: a port stays free to a probe until
# its node binds it, so two launchers started at once (two `meshfl launch`, two test
# workers) would otherwise both be handed it. Where the folder cannot be the user's
# own, or there is no file lock, claims are kept in the launcher's memory only.
CLAIMS_DIR = (
    Path(tempfile.gettempdir())
    / f"meshfl-port-claims-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
)
_claimed_here: dict[int, float] = {}  # port -> when this process handed it out
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
    node binds it, and none claimed in the last HANDED_OUT_S, by this launcher or
    another of the user's on the machine (CLAIMS_DIR); the ports handed out are claimed
    in turn. Nothing is claimed where not enough ports are free."""
    below_ephemeral = ephemeral_ports_start()
    if below_ephemeral - LOWEST_PICKED_PORT < 1000:  # an OS that lends almost every port
        below_ephemeral = 65536
    candidates = list(range(LOWEST_PICKED_PORT, below_ephemeral))
    _port_picker.shuffle(candidates)
    with _claims_locked() as claims:
        now = time.time()
        picked: list[int] = []
        for port in candidates:
            if len(picked) == count:
                break
            if not _claimed(claims, port, now) and port_is_free(host, port):
                picked.append(port)
        if len(picked) < count:
            raise UserError(f"only {len(picked)} of {count} listening ports are free on {host}")
        for port in picked:
            _claim(claims, port, now)
    return picked


@contextlib.contextmanager
def _claims_locked() -> Iterator[Path | None]:
    """The user's claims folder, held under its lock for the block; None where there is
    none to be had (claims then live in this process's memory only)."""
    claims = _own_claims_dir()
    if claims is None or fcntl is None:
        yield None
        return
    try:
        lock = open(claims / "lock", "a")  # closed, and unlocked, by the `with` below
    except OSError:
        yield None
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield claims


def _own_claims_dir() -> Path | None:
    """CLAIMS_DIR, made where missing, if it is this user's own folder that no one else
    may write to (another user could otherwise fill it with claims, or read none)."""
    try:
        CLAIMS_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        status = CLAIMS_DIR.lstat()
    except OSError:
        return None
    own = not hasattr(os, "getuid") or status.st_uid == os.getuid()
    private = stat.S_ISDIR(status.st_mode) and not status.st_mode & 0o022
    return CLAIMS_DIR if own and private else None


def _claimed(claims: Path | None, port: int, now: float) -> bool:
    """Whether `port` was handed out in the last HANDED_OUT_S, here or (claims) by any of
    the user's launchers."""
    if now - _claimed_here.get(port, -HANDED_OUT_S) < HANDED_OUT_S:
        return True
    if claims is None:
        return False
    try:
        return now - (claims / str(port)).stat().st_mtime < HANDED_OUT_S
    except OSError:  # never claimed (or the claim is unreadable: as good as none)
        return False


def _claim(claims: Path | None, port: int, now: float) -> None:
    _claimed_here[port] = now
    if claims is not None:
        with contextlib.suppress(OSError):  # an unwritten claim still holds in memory
            (claims / str(port)).touch()  # its time now: the claim's


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
