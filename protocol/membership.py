"""Who is in the mesh: the peer table, timed on the receiver's own monotonic clock."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .identity import node_id

ALIVE, DOWN, LEFT = "alive", "down", "left"

# A peer's name is what it calls itself, and what rules, metrics and folders call it:
# a narrow alphabet (it becomes a file name), and at most one live key per name.
PEER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
BAD_NAME, NAME_TAKEN = "bad_name", "name_taken"

# Heartbeats a node sends per `heartbeat_interval` in a big mesh: past this many peers,
# each peer is beaten less often and given longer before it counts as down, so that the
# control traffic of a full mesh grows with its size, not with its square (WIRE.md 7.3).
HEARTBEAT_FANOUT = 10


def liveness_stretch(peers: int) -> float:
    """How much longer than the configured interval and timeout a node with `peers`
    known peers waits between heartbeats to one peer, and before marking it down."""
    return max(1.0, peers / HEARTBEAT_FANOUT)


@dataclass
class PeerEntry:
    public_key: bytes
    name: str
    address: str
    instance: bytes
    last_seen: float = field(default_factory=time.monotonic)
    state: str = ALIVE
    round: int = 0
    # Whether a handshake with the node at `address` has completed: until then it is a
    # stranger's word, and is forgotten if no node answers there (WIRE.md 7.3).
    reached: bool = False
    # Whether it greeted this node from a grouped address: a neighbour the node did not
    # choose (a bounded view holds few of them, WIRE.md 7.7).
    greeted: bool = False
    since: float = field(default_factory=time.monotonic)  # when it took its current state
    entered: float = field(default_factory=time.monotonic)  # when it came at this address

    @property
    def id(self) -> str:
        return node_id(self.public_key)

    def describe(self) -> dict[str, object]:
        """The entry as it travels in a `peers` message."""
        return {"name": self.name, "addr": self.address, "key": self.public_key}


class PeerTable:
    """Peers keyed by public key. Not thread-safe: the endpoint's worker owns it.

    `clock` says when what the table is told happened: the endpoint's is the arrival
    time of the message it is handling, so a node that reads its inbox late (a busy
    process) neither ages its peers nor marks them down for its own delay."""

    def __init__(
        self, timeout: float, clock: Callable[[], float] = time.monotonic, crowd: int = 1
    ) -> None:
        self.timeout = timeout
        self.clock = clock
        # Nodes sharing this node's process (a node host): they share its CPU too, so
        # each is as slow to answer as a node with that many peers (Lifeguard's local
        # health, arXiv 1707.00788: a node that knows itself slow widens its waits).
        self.crowd = crowd
        self.entries: dict[bytes, PeerEntry] = {}
        # The most peers the node has known, starting from those it was told to dial:
        # its mesh's size before it heard from them all (a 100-node mesh starting up is
        # not a 5-node one), and after some left (the others still beat at its pace).
        self.most_known = 0

    def known(self) -> int:
        """The most peers this node has known not marked left (the ones it heartbeats),
        at least as many as it was listed at start: every node of a mesh stretches its
        liveness waits (`liveness_stretch`) alike, however its table stands now."""
        return max(self.most_known, self._not_left())

    def stretch(self) -> float:
        """How much this node stretches its liveness waits (`liveness_stretch`): by the
        most peers it has known, or by the nodes sharing its process, whichever is more."""
        return liveness_stretch(max(self.known(), self.crowd))

    def _not_left(self) -> int:
        # Only reached peers: strangers naming addresses where nobody answers must not
        # stretch this node's liveness waits (they are forgotten, this maximum is not).
        return sum(entry.reached and entry.state != LEFT for entry in self.entries.values())

    def mark_reached(self, public_key: bytes) -> None:
        """Note that a handshake with this peer's node completed: a proof of life, so its
        silence counts from now, not from when a contact named it. On a starved machine
        a handshake can take longer than the down timeout (1,000 nodes on 2 cores: 100
        s), and the peer was marked down the moment it answered."""
        entry = self.entries.get(public_key)
        if entry is not None and not entry.reached:
            entry.reached = True
            entry.last_seen = max(entry.last_seen, self.clock())
            self.most_known = max(self.most_known, self._not_left())

    def forget(self, public_key: bytes) -> PeerEntry | None:
        return self.entries.pop(public_key, None)

    def at(self, address: str) -> list[PeerEntry]:
        return [entry for entry in self.entries.values() if entry.address == address]

    def holder_of(self, address: str) -> PeerEntry | None:
        """The reached, alive peer at `address`, if any: a stranger may not claim it."""
        for entry in self.entries.values():
            if entry.address == address and entry.reached and entry.state == ALIVE:
                return entry
        return None

    def alive(self) -> list[PeerEntry]:
        return [entry for entry in self.entries.values() if entry.state == ALIVE]

    def get(self, public_key: bytes) -> PeerEntry | None:
        return self.entries.get(public_key)

    def name_refusal(self, public_key: bytes, name: object, own_name: str) -> str | None:
        """Why `public_key` may not go by `name` here (BAD_NAME, NAME_TAKEN), or None. A
        name is taken by this node's own, and by another key that is alive with it."""
        if not isinstance(name, str) or not PEER_NAME.fullmatch(name):
            return BAD_NAME
        if name == own_name or any(
            entry.name == name and entry.public_key != public_key and entry.state == ALIVE
            for entry in self.entries.values()
        ):
            return NAME_TAKEN
        return None

    def heard_from(self, public_key: bytes, round_no: int) -> PeerEntry | None:
        """Note a valid message from a known peer; a down peer that speaks is alive again."""
        entry = self.entries.get(public_key)
        if entry is not None:
            entry.last_seen = self.clock()
            entry.round = max(entry.round, round_no)
            if entry.state == DOWN:
                entry.state, entry.since = ALIVE, self.clock()
        return entry

    def upsert(self, public_key: bytes, name: str, address: str, instance: bytes) -> bool:
        """Add or refresh a peer; True when it is new or came back."""
        entry = self.entries.get(public_key)
        if entry is None:
            now = self.clock()
            self.entries[public_key] = PeerEntry(
                public_key, name, address, instance, last_seen=now, since=now, entered=now
            )
            return True
        came_back = entry.state != ALIVE or entry.instance != instance
        if entry.address != address:  # a new address must answer anew
            entry.reached, entry.entered = False, self.clock()
        if entry.state != ALIVE:
            entry.since = self.clock()
        entry.name, entry.address, entry.instance = name, address, instance
        entry.state, entry.last_seen = ALIVE, self.clock()
        return came_back

    def conflicting_instance(self, public_key: bytes, instance: bytes, address: str | None) -> str:
        """The address where another live process already uses this key, or ''.

        A node restarted on the same address is the same node coming back: its old
        process must be dead, since the port could not be bound otherwise.
        """
        entry = self.entries.get(public_key)
        if entry is None or entry.state != ALIVE or entry.instance == instance:
            return ""
        if address is not None and address == entry.address:
            return ""
        return entry.address

    def mark_left(self, public_key: bytes) -> PeerEntry | None:
        entry = self.entries.get(public_key)
        if entry is not None and entry.state != LEFT:
            entry.state, entry.since = LEFT, self.clock()
        return entry

    def expire(self) -> list[PeerEntry]:
        """Mark peers silent for longer than the timeout (stretched to the mesh's size)
        as of `clock()` as down; return them."""
        now, timeout = self.clock(), self.timeout * self.stretch()
        expired = [entry for entry in self.alive() if now - entry.last_seen > timeout]
        for entry in expired:
            entry.state, entry.since = DOWN, now
        return expired
