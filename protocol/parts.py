"""What the parts of an endpoint (worker.py, handshake.py, admission.py, liveness.py,
overlay.py, probe.StatusAnswers) reach through the endpoint that holds them: its
settings and the `Host` interface each part is given. Declared here, below them all, so
that no part imports the endpoint, nor one part another through it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .decoder import Decoder
from .exchange import BlobExchange
from .identity import Identity
from .inbox import DirectInbox
from .membership import PeerEntry, PeerTable
from .memory import MemoryTransport
from .transport import Transport, TransportOptions
from .views import PassiveView, ViewSettings
from .wire import Blob, Limits, Message, SignedClaim

Greeting = tuple[str, bool]  # an address to greet, and whether to ask it for a peer list


@dataclass(frozen=True)
class EndpointSettings:
    name: str
    listen: str  # where the ROUTER binds
    advertise: str = ""  # where peers dial us; default: `listen`
    heartbeat_interval: float = 1.0
    peer_timeout: float = 5.0
    store_bytes: int = 1 << 30
    max_inflight: int = 2  # blob fetches outstanding per peer
    fetch_timeout: float = 30.0  # an unanswered fetch frees its in-flight slot after this
    allowlist: frozenset[bytes] | None = None  # closed mesh: the only keys allowed
    encrypt: bool = True  # ZeroMQ CURVE on every connection; off only for measurements
    # Status answers, and unlinks answering heartbeats of non-neighbours, a second (each
    # one to a stranger costs a connection).
    status_per_second: int = 10
    max_peers: int = 1024  # entries in the peer table, whatever their state
    # Peers not yet reached (no handshake with a node at their address) at any one time:
    # each costs a connection attempt, and a stranger can name any number of them.
    max_unreached: int = 128
    # A peer that left this long ago is forgotten (it says hello if it comes back); one
    # never reached, after twice the (stretched) peer timeout (WIRE.md 7.1).
    forget_after: float = 300.0
    # The direct kinds this node reads (`next_message`): a coordinator `upload`s, a client
    # `personal` blobs. Any other direct message is dropped and counted, unread.
    direct_kinds: frozenset[str] = frozenset({"upload", "personal"})
    limits: Limits = Limits()
    transport: TransportOptions = TransportOptions()
    # None: a full mesh, every node a peer of every other; else bounded views (WIRE.md 7.7).
    views: ViewSettings | None = None
    crowd: int = 1  # nodes in this process, this one included (membership.PeerTable)
    # What this node's mesh is, for a human (WIRE.md 7.8): sent in every hello, so a node
    # of another mesh can say how the two differ. None: nothing said.
    about: dict[str, str | int] | None = None

    @property
    def address(self) -> str:
        return self.advertise or self.listen


@dataclass(frozen=True)
class OtherMesh:
    """A node of another mesh that said hello, and what it says its mesh is (its
    `about`, WIRE.md 7.8): enough for a human to see how the two meshes differ."""

    name: str
    address: str
    about: dict[str, str | int]


class RateLimit:
    """At most `count` events in any `period` seconds."""

    def __init__(self, count: int, period: float = 1.0) -> None:
        self.count = count
        self.period = period
        self._times: deque[float] = deque()

    def allow(self) -> bool:
        now = time.monotonic()
        while self._times and now - self._times[0] > self.period:
            self._times.popleft()
        if len(self._times) >= self.count:
            return False
        self._times.append(now)
        return True


class Topology(Protocol):
    """The overlay (overlay.Overlay) as the other parts use it."""

    views: ViewSettings | None
    passive: PassiveView

    def first_contacts(self, targets: list[str]) -> list[str]: ...
    def keeps_contacts(self) -> bool: ...
    def card_fields(self, linked: bool | None = None) -> dict[str, Any]: ...
    def note_unheard(self) -> None: ...
    def on_down(self, entry: PeerEntry) -> None: ...
    def beat(self, now: float, again: list[Greeting]) -> tuple[list[Greeting], tuple | None]: ...
    def refusal(self, name: str, address: str) -> str | None: ...
    def turns_away(self, name: str, address: str) -> str | None: ...
    def took_greeter(self, message: Message, address: str) -> None: ...
    def listed(self, alive: list[PeerEntry], greeter: bytes) -> list[PeerEntry]: ...
    def on_peers(self, message: Message, wanted_list: bool) -> None: ...
    def on_stranger_heartbeat(self, message: Message, name: object, address: str) -> None: ...


class Greeter(Protocol):
    """The handshake (handshake.Handshake) as the other parts use it."""

    out: OrderedDict[str, Any]
    contacts: dict[str, bytes | None]
    when_keyed: set[str]
    anchors: list[str]

    def choose_contacts(self) -> list[str]: ...
    def learn(self, address: str, public_key: bytes, from_its_owner: bool = True) -> None: ...
    def say_hello(self, address: str, wants_peers: bool = True) -> None: ...
    def hello_body(self, wants_peers: bool = True) -> dict[str, Any]: ...
    def awaits(self, address: str) -> bool: ...
    def again(self, now: float, grace: float) -> list[Greeting]: ...
    def give_up_on(self, address: str) -> None: ...
    def to_keep(self, address: str) -> bool: ...
    def link_answering(self, message: Message, name: object, address: str) -> bool: ...
    def refuse_twin(self, message: Message) -> None: ...


class Gate(Protocol):
    """Admission (admission.Admission) as the other parts use it."""

    def name_refused(self, key: bytes, name: object) -> bool: ...
    def meet_other_mesh(self, claim: SignedClaim) -> None: ...


class Pulse(Protocol):
    """Liveness (liveness.Liveness) as the worker uses it."""

    def tick(self) -> None: ...
    def note_new_reached(self) -> None: ...


class Host(Protocol):
    """The endpoint (endpoint.Endpoint) as its parts use it."""

    identity: Identity
    mesh_id: bytes
    instance: bytes
    address: str
    round: int
    settings: EndpointSettings
    table: PeerTable
    lock: threading.RLock
    received: Counter[str]
    flow_rejections: Counter[str]
    transport: Transport | MemoryTransport
    decoder: Decoder
    blobs: BlobExchange
    inbox: DirectInbox

    # The other parts, read-only: each as the interface its users need.
    @property
    def overlay(self) -> Topology: ...
    @property
    def handshake(self) -> Greeter: ...
    @property
    def admission(self) -> Gate: ...
    @property
    def liveness(self) -> Pulse: ...

    finished: bool
    shuns: Callable[[str], bool]
    unlink_answers: RateLimit
    other_meshes: dict[bytes, OtherMesh]
    on_other_mesh: Callable[[OtherMesh], None]
    status_extra: Callable[[], dict[str, Any]] | None

    def send(
        self,
        address: str,
        kind: str,
        body: dict[str, Any],
        blob: Blob | None = None,
        once: bool = False,
        key: bytes | None = None,
    ) -> None: ...
    def release(self, address: str, drain: bool = False) -> None: ...
    def forget(self, entry: PeerEntry, drain: bool = False) -> None: ...
    def take_in(self, message: Message, name: object, address: str) -> bool: ...
    def is_peer(self, key: bytes) -> bool: ...
    def note_change(self) -> None: ...
    def wake_waiters(self) -> None: ...
    def on_refused_direct(self, message: Message, reason: str) -> None: ...
    def rejections(self) -> dict[str, int]: ...
