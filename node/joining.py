"""Joining the mesh together: the nodes of a host, and the hosts of one launch.

Building a node (its data, model and endpoint) is CPU work, and a host of hundreds of
nodes on a busy machine takes a minute or more to build them all. A node that greets
the mesh while others are still being built makes them answer late: a node under
construction shares its process's interpreter lock with the builds around it. At
1,000 nodes in 5 hosts the hosts finished building up to a minute apart, and the
nodes of the early ones took the late ones' slow answers for silence and marked them
down. So each node, once built, waits until every node of its host is built, and a host
started by `meshfl launch` waits, once its nodes are built, until every host of the
launch has built its own (each says so with a file in the launch's JOINING_DIR).
Where the gate cannot be written (a full disk), a host joins as soon as its own nodes
are built: the gate spares the mesh false alarms, and nothing more depends on it.

A wait ends at the latest PATIENCE_S after the last arrival: a member stuck (a build
that hangs, a host that died) must not hold the others for good, but one that is only
slow, because hundreds are built beside it, keeps them waiting as long as the builds go
on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("meshfl.host")

# In a launch's run folder: a file per host whose nodes are built. No peer's folder can
# have this name: a peer name starts with a letter or a digit (protocol/membership.py).
JOINING_DIR = ".joining"
# How long a wait goes on after the last node or host arrived.
PATIENCE_S = 60.0
# How often a host looks for the other hosts' files.
LOOK_EVERY_S = 0.5


def wait_while_arriving(
    count: Callable[[], int], expected: int, pause: Callable[[float], object], patience: float
) -> bool:
    """Wait until `count()` reaches `expected`, or has not grown for `patience` seconds;
    True when all arrived. `pause(seconds)`: waits that long at most (less on news)."""
    seen, since = count(), time.monotonic()
    while seen < expected:
        left = since + patience - time.monotonic()
        if left <= 0:
            return False
        pause(left)
        now = count()
        if now > seen:
            seen, since = now, time.monotonic()
    return True


class LaunchGate:
    """The hosts of one launch, joining together: `arrive_and_wait` says this host's
    nodes are built (a file named `host` in `folder`) and waits for the `hosts` in all
    to say so. A host started again once all had arrived finds every file there, and
    waits for none. A launch names a host's file after its first node, and starts a
    failed host again with its unfinished nodes: that first node is among them unless it
    finished, and then every host had arrived long before, so a file under another
    name never counts a host twice while one is still waited for."""

    def __init__(self, folder: Path, host: str, hosts: int, patience: float = PATIENCE_S) -> None:
        self.folder = folder
        self.host = host
        self.hosts = hosts
        self.patience = patience

    def arrive_and_wait(self) -> bool:
        """True when every host arrived; False when the wait ran out of patience, or
        when the folder cannot be written or read."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / self.host).touch()
            return wait_while_arriving(
                self._arrived,
                self.hosts,
                lambda left: time.sleep(min(left, LOOK_EVERY_S)),
                self.patience,
            )
        except OSError as error:
            log.warning("joining without waiting for the other hosts: %s", error)
            return False

    def _arrived(self) -> int:
        return sum(1 for _ in self.folder.iterdir())


class JoinTogether:
    """The `nodes` of one host: each calls `built` once built (or once its build failed)
    and returns from it when all are built, and, where the host has a `gate`, when every
    host of its launch has built its nodes too; each wait also ends `patience` seconds
    after the last arrival. A node built after its host stopped waiting goes at once."""

    def __init__(
        self, nodes: int, gate: LaunchGate | None = None, patience: float = PATIENCE_S
    ) -> None:
        self.nodes = nodes
        self.gate = gate
        self.patience = patience
        self._built = 0
        self._changed = threading.Condition()
        self._opener_chosen = False
        self._open = threading.Event()

    def built(self) -> None:
        with self._changed:
            self._built += 1
            self._changed.notify_all()
            # Once one node has stopped waiting, the others' waits are over too.
            wait_while_arriving(
                lambda: self.nodes if self._opener_chosen else self._built,
                self.nodes,
                self._changed.wait,
                self.patience,
            )
            opens, self._opener_chosen = not self._opener_chosen, True
            self._changed.notify_all()
        if opens:  # one node of the host waits for the other hosts; its host waits on it
            try:
                if self.gate is not None:
                    self.gate.arrive_and_wait()
            finally:
                self._open.set()
        self._open.wait()
