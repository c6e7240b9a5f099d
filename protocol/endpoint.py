"""A node's presence in the mesh: membership, gossip and blob exchange over one transport.

The endpoint runs a worker thread that decodes every incoming message, keeps the
peer table, answers `hello` and `fetch`, and sends heartbeats. The node talks to
it from its own thread: publish a blob, look at what peers announced, fetch the
blobs it chooses, wait for them until a deadline. The blobs, offers and fetches
themselves are the exchange's (exchange.py), and a bounded view's shuffles the
view's (views.Shuffles); the endpoint passes them the messages.
"""

from __future__ import annotations

import functools
import logging
import queue
import random
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .addresses import resolved
from .decoder import Decoder
from .errors import UserError
from .exchange import BlobExchange, Counts, FetchRecord
from .identity import BadPublicKey, Identity, curve_public_key, node_id
from .inbox import INBOX_FULL, DirectInbox
from .membership import ALIVE, LEFT, PeerEntry, PeerTable, liveness_stretch
from .offers import Offer
from .transport import (
    Encryption,
    LogOnce,
    Received,
    Transport,
    TransportOptions,
    contact,
    split_contact,
)
from .views import (
    UNSOLICITED_CARDS,
    Candidate,
    PassiveView,
    Shuffles,
    ViewSettings,
    make_card,
)
from .wire import (
    BLOB_KINDS,
    KINDS,
    PROTOCOL_VERSION,
    Blob,
    Limits,
    Message,
    Rejected,
    SignedClaim,
    announce_body,
    encode,
    new_instance,
)
from .wire import blob_id as id_of_record

log = logging.getLogger("meshfl.endpoint")

# What a receiver does not count as a sign of life (WIRE.md 7.3): a message of any other
# kind to a peer stands in for a heartbeat to it.
NO_PROOF_OF_LIFE = frozenset({"refuse", "bye", "status", "status_reply"})
# A peer that was sent other messages still gets a heartbeat this many periods apart.
BEAT_ANYWAY_PERIODS = 5

# Refused at the encrypted handshake, before any message: a client key a closed mesh
# does not list (WIRE.md 1.1). Counted beside the decoder's reasons.
REFUSED_HANDSHAKE = "refused_handshake"

# What strangers can make a node do is bounded (WIRE.md 7.1, 7.3); these flow reasons
# count what was refused for it, beside the decoder's.
UNSOLICITED_PEERS = "unsolicited_peers"  # a peer list that answers no hello of ours
ADDRESS_TAKEN = "address_taken"  # another key claims the address of a reached peer
TABLE_FULL = "table_full"  # no room for a new peer (or for one more not yet reached)
WORKER_ERROR = "worker_error"  # the worker raised: a bug, contained and logged
# Bounded views (WIRE.md 7.7): a greeting while the node has all the neighbours it takes,
# a shuffle from a node that is not a neighbour (views.py counts the rest).
VIEW_FULL, NOT_LINKED = "view_full", "not_linked"
GROUP_FULL = "group_full"  # a bounded view holds all the peers one network group may
# Hellos of ours still waiting for their `peers` answer; the oldest are given up first.
MAX_HELLOS_OUT = 1024
# Nodes of other meshes noted (and answered) at most: strangers cannot grow it for good.
MAX_OTHER_MESHES = 64


@dataclass(frozen=True)
class OtherMesh:
    """A node of another mesh that said hello, and what it says its mesh is (its
    `about`, WIRE.md 7.8): enough for a human to see how the two meshes differ."""

    name: str
    address: str
    about: dict[str, str | int]


@dataclass(frozen=True)
class _HelloOut:
    """A hello of ours awaiting its `peers` answer: only that may tell us peers."""

    wants_peers: bool
    sent: float  # monotonic


class Refused(UserError):
    """The mesh refused this process (its key is already live elsewhere)."""


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


class _RateLimit:
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


class Endpoint:
    def __init__(
        self,
        identity: Identity,
        mesh_id: bytes,
        settings: EndpointSettings,
        schema: bytes | None = None,
    ) -> None:
        self.identity = identity
        self.mesh_id = mesh_id
        self.settings = settings
        self.instance = new_instance()
        # Where peers dial us: an IP address, as messages may name no other (WIRE.md 5).
        self.address = resolved(settings.address)
        self.round = 0
        # Up to when the worker has read what arrived (monotonic): the arrival time of
        # the message it handles, or, with the inbox empty, when the transport last
        # found nothing more to read. The peer table's clock.
        self._read_up_to = time.monotonic()
        self.table = PeerTable(
            settings.peer_timeout, clock=lambda: self._read_up_to, crowd=settings.crowd
        )
        self.decoder = Decoder(
            mesh_id,
            settings.limits,
            schema,
            self._admit,
            self._accept,
            kept=self._is_peer,
        )
        self.received: Counter[str] = Counter()  # messages delivered, by kind
        self.flow_rejections: Counter[str] = Counter()  # refusals after decoding, by reason
        self._last_beat: dict[str, float] = {}  # address -> when we last heartbeat it
        self._changes = 0  # counts handled messages and heartbeat ticks: see wait_change
        # What the node adds to a status answer (accuracies...); called on the worker
        # thread, so it must be quick and thread-safe.
        self.status_extra: Callable[[], dict[str, Any]] | None = None
        self._status_answers = _RateLimit(settings.status_per_second)
        self._unlink_answers = _RateLimit(settings.status_per_second)
        self._about_checks = _RateLimit(settings.status_per_second)
        self._started = time.monotonic()
        self.inbox = DirectInbox(settings.direct_kinds)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._send_lock = threading.Lock()
        self.blobs = BlobExchange(
            settings.name,
            identity.public_key,
            self.table,
            self._send,
            Counts(self.received, self.flow_rejections),
            self._lock,
            lambda: self.round,
            settings.store_bytes,
            settings.max_inflight,
            settings.fetch_timeout,
        )
        # Start from wall-clock nanoseconds so a restarted node's numbers keep rising.
        self._seq = time.time_ns()
        self._log_once = LogOnce(log)
        # Our hellos still unanswered, by address: whether each asked for a peer list.
        # Only their answers may tell this node peers (WIRE.md 7.1).
        self._hellos_out: OrderedDict[str, _HelloOut] = OrderedDict()
        self._bootstrap: set[str] = set()  # the addresses we were told to dial at start
        self._contacts: dict[str, bytes | None] = {}  # all we were given, with known keys
        self._reached_seen = 0  # transport.reached_count when we last looked
        self._unheard_seen = 0  # transport.unheard_count when we last looked
        self._joined = threading.Event()
        self._refusal = ""
        self._stopping = threading.Event()
        # The CURVE key of the node at each address we may dial, learned with the Ed25519
        # key that address came with (bootstrap contact, hello, heartbeat, peer list).
        self._curve_keys: dict[str, bytes] = {}
        # Bootstrap addresses given without a key: greeted once some message names it.
        self._greet_when_keyed: set[str] = set()
        # Bounded views (views.py): the peer table is the active view, these the rest.
        self.views = settings.views
        self._rng = random.Random(self.instance)
        self.passive = (
            PassiveView(self.views.passive, self._rng, self.views.limits.of_node_at(self.address))
            if self.views
            else PassiveView(0, self._rng)
        )
        self.shuffles = (
            Shuffles(
                make_card(identity, mesh_id, settings.name, self.address),
                mesh_id,
                self.views,
                self.passive,
                rng=self._rng,
                is_peer=self._is_peer,
                rejections=self.flow_rejections,
            )
            if self.views is not None
            else None
        )
        # Set once the node has done its last round: it keeps the neighbours it has, to
        # serve them its last blob, and takes in and looks for no others.
        self._finished = False
        # Whether the node wants no link with the peer of this name (its record shows
        # clear harm): called on the worker thread, so it must only read.
        self.shuns: Callable[[str], bool] = lambda name: False
        # Nodes of other meshes that said hello, by key, and what the node is told of each
        # as it is met (on the worker thread: it must be quick).
        self.other_meshes: dict[bytes, OtherMesh] = {}
        self.on_other_mesh: Callable[[OtherMesh], None] = lambda met: None
        # One handler per kind of WIRE.md section 4; the decoder lets no other kind through.
        self._handlers: dict[str, Callable[[Message], None]] = {
            "hello": self._on_hello,
            "peers": self._on_peers,
            "refuse": self._on_refuse,
            "heartbeat": self._on_heartbeat,
            "bye": self._on_bye,
            "announce": self.blobs.on_announce,
            "fetch": self.blobs.on_fetch,
            "miss": self.blobs.on_miss,
            "blob": self.blobs.on_blob,
            "status": self._on_status,
            "status_reply": self._on_status_reply,
            "upload": self._on_direct,
            "personal": self._on_direct,
            "shuffle": self._on_shuffle,
            "shuffle_reply": self._on_shuffle_reply,
            "unlink": self._on_unlink,
        }
        missing = set(KINDS) ^ set(self._handlers)
        assert not missing, f"kinds without a handler, or handlers without a kind: {missing}"
        # Peers are judged at most a tick late for a transport with nothing to read: a
        # tick stretched for a host's crowd of nodes, whose idle transports must not
        # each wake every second to take their turn at the GIL.
        tick = settings.heartbeat_interval * liveness_stretch(settings.crowd)
        options = replace(settings.transport, idle_check_s=tick)
        self.transport = Transport(
            settings.listen, options, self._encryption(), screen=self._worth_holding
        )
        self._worker = threading.Thread(
            target=self._work, name=f"mesh {settings.name}", daemon=True
        )

    def _is_peer(self, key: bytes) -> bool:
        return self.table.get(key) is not None

    @property
    def id(self) -> str:
        return self.identity.id

    @property
    def contact(self) -> str:
        """How another node dials this one: KEY@ADDRESS (WIRE.md 1.1)."""
        return contact(self.address, self.identity.public_key)

    def _encryption(self) -> Encryption | None:
        if not self.settings.encrypt:
            return None
        admit = None
        if self.settings.allowlist is not None:
            listed = {
                _curve_key(key) for key in [*self.settings.allowlist, self.identity.public_key]
            }
            admit = listed.__contains__
        return Encryption(self.identity.curve_public_key, self.identity.curve_secret_key, admit)

    def _learn(self, address: str, public_key: bytes, from_its_owner: bool = True) -> None:
        """Dial `address` with the CURVE key of `public_key` from now on. A third party's
        word (a peer list) does not replace what the address's own node said."""
        # Nor does anyone's word replace the key of an address we await an answer from:
        # the answer must come from the node we dialled.
        awaited = address in self._hellos_out and address in self._curve_keys
        if (from_its_owner and not awaited) or address not in self._curve_keys:
            curve_key = _curve_key(public_key)
            if curve_key:
                self._curve_keys[address] = curve_key
        if address in self._greet_when_keyed and address in self._curve_keys:
            # A bootstrap peer we could not dial: it dialled us first (or someone named
            # its key). Our hello now gets the `peers` answer that makes us joined.
            self._greet_when_keyed.discard(address)
            self._say_hello(address)

    # --- the node's side --------------------------------------------------

    def start(self, bootstrap: Iterable[str] = ()) -> None:
        """Start serving and say hello to every bootstrap contact (any one is enough):
        KEY@tcp://HOST:PORT, or a bare address where the mesh does not encrypt."""
        if self.settings.encrypt:
            log.info(
                "%s: listening encrypted; others dial it as %s", self.settings.name, self.contact
            )
        keys: dict[str, bytes | None] = {}  # each address once, with its key where given
        for address, key in map(split_contact, bootstrap):
            if keys.get(address) is None:
                keys[address] = key
        own = (self.settings.address, self.address)
        self._contacts = {address: key for address, key in keys.items() if address not in own}
        targets = self._choose_contacts(list(self._contacts))
        self.table.most_known = len(targets)
        waiting = sorted(self._greet_when_keyed)
        if waiting:
            # Nodes started together learn each other's keys from the first hellos; a
            # bare address with no such node behind it shows as nobody answering.
            log.info(
                "%s: will greet %s once the key of each is known (from its own hello or a "
                "peer list)",
                self.settings.name,
                ", ".join(waiting),
            )
        self._worker.start()  # after the keys above are in place: it learns more
        greet = [address for address in targets if address not in self._greet_when_keyed]
        for index, address in enumerate(greet):
            # One peer list is enough: the others were named to us already (WIRE.md 7.1).
            self._say_hello(address, wants_peers=index == 0)
        if not targets:
            self._joined.set()

    def _choose_contacts(self, targets: list[str]) -> list[str]:
        """Of the contacts `targets`, the ones to greet until they answer (the bootstrap:
        all of them in a full mesh, as many as it wants neighbours in a bounded one), each
        dialled with its key where known; one whose key is still unknown in an encrypted
        mesh waits for it (`_greet_when_keyed`)."""
        if self.views is not None:
            targets = self._first_neighbours(self._contacts, targets)
        for address in targets:
            if (key := self._contacts[address]) is not None:
                self._learn(address, key)
            elif self.settings.encrypt and address not in self._curve_keys:
                self._greet_when_keyed.add(address)
        self._bootstrap = set(targets)
        return targets

    def _first_neighbours(self, keys: dict[str, bytes | None], targets: list[str]) -> list[str]:
        """Of the contacts a node of a bounded mesh starts with (`keys`: their keys, where
        known), the ones it greets (as many as it wants neighbours); the others, with
        their keys, become candidates."""
        contacts = list(targets)
        self._rng.shuffle(contacts)
        assert self.views is not None
        first, rest = contacts[: self.views.neighbours], contacts[self.views.neighbours :]
        for address in rest:
            key = keys.get(address)
            if key is not None:
                self.passive.add(Candidate(key, address))
        return first

    def wait_joined(self, timeout: float, until_other_mesh: bool = False) -> bool:
        """True once a peer answered our hello; raises Refused if the mesh refused us.
        `until_other_mesh`: stop waiting, too, once a node of another mesh said hello
        while no peer has (a joiner that dialled the wrong mesh learns it at once)."""
        with self._changed:
            self._changed.wait_for(
                lambda: (
                    self._joined.is_set()
                    or (until_other_mesh and bool(self.other_meshes) and not self.table.alive())
                ),
                timeout,
            )
        if self._refusal:
            raise Refused(self._refusal)
        return self._joined.is_set()

    def set_round(self, round_no: int) -> None:
        if self.shuffles is not None:
            self.shuffles.pace(self.round, round_no, time.monotonic())
        self.round = round_no
        self.blobs.forget_before(round_no)

    def peers(self) -> list[PeerEntry]:
        with self._lock:
            return [PeerEntry(**vars(entry)) for entry in self.table.entries.values()]

    def alive_peers(self) -> list[PeerEntry]:
        """The live peers: every member of a full mesh, the neighbours of a bounded one."""
        return [entry for entry in self.peers() if entry.state == ALIVE]

    def expected_peers(self, mesh_size: int) -> int:
        """How many live peers a node of a `mesh_size`-node mesh can expect to have."""
        others = max(mesh_size - 1, 0)
        return others if self.views is None else min(others, self.views.neighbours)

    def unlink(self, public_key: bytes) -> None:
        """Drop a neighbour of a bounded mesh: it is told (`unlink`), and another
        candidate is greeted in its place."""
        with self._lock:
            entry = self.table.get(public_key)
            if self.views is None or entry is None:
                return
            self._send(entry.address, "unlink", {})
            self._forget_neighbour(entry, drain=True)
            self.passive.discard(public_key)  # not the candidate greeted in its place
            self._fill_view()  # now, not at the next tick: the next round may wait for it

    def passive_size(self) -> int:
        with self._lock:
            return len(self.passive)

    def finish(self) -> None:
        """The node has done its last round (`set_round` past it): every live peer hears
        so now, not a heartbeat period from now, so that none lingers for it; a bounded
        view keeps the neighbours it has and looks for no others (WIRE.md 7.7)."""
        with self._lock:
            self._finished = True
            targets = [entry.address for entry in self.table.alive()]
        self._heartbeat(targets, time.monotonic())

    def wait_for_peers(self, count: int, timeout: float) -> bool:
        """Whether `count` peers are live within `timeout`. A bounded view waits only
        while a candidate greeted for a place it lacks has yet to answer: when the mesh
        has no one more to give, waiting would only make the round late."""
        deadline = time.monotonic() + timeout
        with self._changed:
            if self.views is not None:
                self._fill_view()  # a place freed since the last tick: greeted for now
            while len(self.table.alive()) < count:
                left = deadline - time.monotonic()
                if left <= 0 or (self.views is not None and not self._greeting()):
                    return False
                self._changed.wait(left)
        return True

    def publish(self, blob: Blob) -> None:
        """Hold `blob` for fetching and announce it to every live peer."""
        self.blobs.hold(blob)
        with self._lock:
            targets = [entry.address for entry in self.table.alive()]
        for address in targets:
            self._send(address, "announce", announce_body(blob))

    def refresh_offers(self) -> None:
        """Say hello again to every live peer; each re-announces its latest blobs. A late
        joiner calls this once it took the mesh's round: announces that came with its
        first hellos were too far ahead of its round 0 to be kept."""
        for entry in self.alive_peers():
            self._say_hello(entry.address, wants_peers=False)

    def changes(self) -> int:
        """A counter that moves whenever the endpoint handled a message or checked
        liveness: pass it to `wait_change` to sleep until something may have changed."""
        with self._lock:
            return self._changes

    def wait_change(self, seen: int, deadline: float) -> None:
        """Wait until `changes()` moves past `seen` or the monotonic `deadline` passes."""
        with self._changed:
            while self._changes == seen and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)

    def offers(self, round_no: int, kind: str | None = None) -> list[Offer]:
        return self.blobs.offers(round_no, kind)

    def round_offers(
        self, round_no: int, kinds: set[str], origins: set[bytes], quorum: float = 1.0
    ) -> tuple[list[Offer], bool]:
        """The offers of round `round_no` of `kinds`, and whether they are complete: a
        `quorum` share (1.0: every one) of the live peers among `origins` announced every
        kind of `kinds`."""
        return self.blobs.round_offers(round_no, kinds, origins, quorum)

    def wait_offers(
        self, round_no: int, kinds: set[str], origins: set[bytes], deadline: float
    ) -> list[Offer]:
        """The offers of `round_offers`, once every live peer among `origins` announced
        every kind (however far behind it is) or the monotonic `deadline` passed."""
        with self._changed:
            while True:
                offers, complete = self.blobs.round_offers(round_no, kinds, origins, 1.0, True)
                left = deadline - time.monotonic()
                if complete or left <= 0:
                    return offers
                self._changed.wait(min(left, 0.5))

    def fetch(self, offers: Sequence[Offer]) -> None:
        """Ask for these blobs, from their origin when it is alive, else another holder."""
        self.blobs.fetch(offers)

    def held(self, blob_ids: Iterable[bytes]) -> dict[bytes, Blob]:
        """The blobs among `blob_ids` that are here now, by id."""
        return self.blobs.held(blob_ids)

    def forget_fetched(self, blob_ids: Iterable[bytes]) -> None:
        """Forget fetched blobs the node has taken in (its own stay, to be served)."""
        self.blobs.forget_fetched(blob_ids)

    def wait_blobs(self, blob_ids: Iterable[bytes], deadline: float) -> dict[bytes, Blob]:
        """The blobs among `blob_ids` that arrived by the monotonic `deadline`, by id."""
        wanted = set(blob_ids)
        with self._changed:
            while True:
                have = self.held(wanted)
                left = deadline - time.monotonic()
                if len(have) == len(wanted) or left <= 0:
                    return have
                self._changed.wait(min(left, 0.5))

    def send_blob(self, public_key: bytes, kind: str, blob: Blob, body: dict | None = None) -> bool:
        """Send a blob straight to one peer (the coordinator's upload / personal)."""
        with self._lock:
            entry = self.table.get(public_key)
        if entry is None:
            return False
        self._send(entry.address, kind, body or {}, blob)
        return True

    def next_message(self, kind: str, timeout: float) -> Message | None:
        """The next message of a direct kind (upload, personal), or None."""
        return self.inbox.next(kind, timeout)

    def rejections(self) -> dict[str, int]:
        """Messages dropped, by reason: the decoder's and the flows'."""
        with self._lock:
            refused = Counter({REFUSED_HANDSHAKE: self.transport.refused_handshakes})
            return dict(Counter(self.decoder.rejection_counts()) + self.flow_rejections + refused)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "bytes_in": self.transport.bytes_in,
                "bytes_out": self.transport.bytes_out,
                "bytes_sent_by_kind": self.transport.sent_by_kind(),  # what left
                "rejections": self.rejections(),
                "candidates_refused": self.passive.refused,  # past views.Limits
                "received": dict(self.received),
                "dropped": self.transport.dropped,
                "fetched": len(self.blobs.fetch_log),
                "connections": self.transport.connections(),
            }

    def fetches_since(self, start: int) -> list[FetchRecord]:
        """The blobs this endpoint pulled, from the `start`-th on (`stats()["fetched"]`
        counts them): the transport's own record, not what the caller asked for."""
        return self.blobs.fetches_since(start)

    def close(self) -> None:
        """Say bye to every live peer, then stop."""
        if self._stopping.is_set():
            return
        for entry in self.alive_peers():
            self._send(entry.address, "bye", {})
        self._stopping.set()
        self.transport.wake_reader()
        if self._worker.is_alive():
            self._worker.join(timeout=5)
        self.transport.close()

    # --- sending ----------------------------------------------------------

    def _say_hello(self, address: str, wants_peers: bool = True) -> None:
        """Greet `address`, and take its node's answer as a peer list (WIRE.md 7.1)."""
        with self._lock:
            self._hellos_out.pop(address, None)
            self._hellos_out[address] = _HelloOut(wants_peers, time.monotonic())
            while len(self._hellos_out) > MAX_HELLOS_OUT:
                self._give_up_on(next(iter(self._hellos_out)))
        body = self._hello_body(wants_peers)
        if self.shuffles is not None:
            body["card"] = self.shuffles.card.packed()
        self._send(address, "hello", body)

    def _greet_again(self, now: float, grace: float) -> list[tuple[str, bool]]:
        """Our hellos unanswered for `grace`: a bootstrap contact is greeted again (a node
        refused for want of room, or started before its contacts, must get in), any other
        address given up, its connection closed (WIRE.md 7.1)."""
        again = []
        for address, hello in list(self._hellos_out.items()):
            if now - hello.sent < grace:
                continue
            if self._contact_to_keep(address):
                again.append((address, hello.wants_peers))
            else:
                self._give_up_on(address)
        return again

    def _give_up_on_unheard(self) -> bool:
        """Give up at once the candidates we greeted where nobody listens (the connection
        was refused); whether any was, for others to be greeted in their place. A dead
        candidate must not hold a place of the view until the handshake grace runs out
        (20 s in a host of 10 nodes, 200 s in one of 200). Bootstrap contacts are greeted
        again while we have no neighbour (`_contact_to_keep`)."""
        self._unheard_seen = self.transport.unheard_count
        unheard = [
            address
            for address in list(self.transport.unheard)
            if address in self._hellos_out
            and not self._contact_to_keep(address)
            and not self.table.at(address)
        ]
        for address in unheard:
            self._give_up_on(address)
        return bool(unheard)

    def _give_up_on(self, address: str) -> None:
        self._hellos_out.pop(address, None)
        if not self.table.at(address) and not self._contact_to_keep(address):
            self._release(address)

    def _contact_to_keep(self, address: str) -> bool:
        """Whether `address` is a contact we started with that is greeted until it
        answers: in a full mesh, always (its members are its peer list); in a bounded
        view, only while we have no neighbour. Once in, a contact is a candidate like any
        other: one that died must not hold a place of the view for good, greeted again
        every grace (a contact of a fifth of the nodes killed at once did, for the rest
        of the run)."""
        return address in self._bootstrap and (self.views is None or not self._has_neighbour())

    def _has_neighbour(self) -> bool:
        """Whether a bounded view holds a live neighbour that answered at its address (a
        stranger's hello alone does not make one)."""
        return any(entry.reached for entry in self.table.alive())

    def _rejoin(self) -> list[tuple[str, bool]]:
        """Greetings for a node of a bounded mesh left with no neighbour, no candidate and
        no greeting (every node it knew died or left): its contacts, chosen and greeted
        again as at its start (7.1) until one answers; a contact that was not up when the
        node joined may be now."""
        assert self.views is not None
        if self._finished or self._greeting() or self.passive.entries or self._has_neighbour():
            return []
        chosen = self._choose_contacts(list(self._contacts))
        return [(address, True) for address in chosen if address not in self._greet_when_keyed]

    def _hello_body(self, wants_peers: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {"name": self.settings.name, "addr": self.address}
        if self.settings.about is not None:
            body["about"] = self.settings.about
        if not wants_peers:
            body["list"] = False  # answer with yourself only: we know the mesh (WIRE.md 7.1)
        return body

    def _send(
        self,
        address: str,
        kind: str,
        body: dict[str, Any],
        blob: Blob | None = None,
        once: bool = False,
        key: bytes | None = None,
    ) -> None:
        """`key`: the Ed25519 key of the node at `address`, when it is not the one learned
        for that address (an answer to a status probe or a twin)."""
        server_key = _curve_key(key) if key is not None else self._curve_keys.get(address)
        # Numbering and queueing under one lock: messages leave in sequence order.
        with self._send_lock:
            self._seq += 1
            frames = encode(
                self.identity,
                self.mesh_id,
                kind,
                self._seq,
                self.round,
                body,
                instance=self.instance,
                blob=blob,
            )
            if once:
                self.transport.send_once(address, frames, server_key, kind=kind)
            else:
                proves_life = kind not in NO_PROOF_OF_LIFE
                self.transport.send(address, frames, server_key, kind=kind, proves_life=proves_life)

    def may_come(self, offer: Offer) -> bool:
        """Whether a live peer may still send the blob `offer` names: its origin or a
        holder that is alive and did not answer a fetch of it with `miss`."""
        with self._lock:
            return self.blobs.pick_holder(offer) is not None

    # --- the worker thread -----------------------------------------------------

    def _work(self) -> None:
        next_beat = time.monotonic()
        while not self._stopping.is_set():
            try:
                next_beat = self._work_once(next_beat)
            except Exception:
                # A bug: logged with its traceback, and the worker goes on, for without
                # it the node would answer nobody and beat to nobody, silently.
                self.flow_rejections[WORKER_ERROR] += 1
                if self.flow_rejections[WORKER_ERROR] <= 3:  # the first few, with traceback
                    log.exception("%s: unexpected error in the mesh worker", self.settings.name)

    def _work_once(self, next_beat: float) -> float:
        """Handle what arrived, and beat when it is time; returns when to beat next. It
        sleeps until a message, a wake-up or the beat: a host's hundreds of idle workers
        must not each poll for the GIL."""
        try:
            received = self.transport.inbox.get(timeout=max(next_beat - time.monotonic(), 0))
        except queue.Empty:
            received = None
        if received is None:
            # Read up to when the transport last found its socket empty (read before
            # looking at the inbox: what it read by then is in it, or handled).
            caught_up = self.transport.caught_up_at
            if self.transport.inbox.empty():
                self._read_up_to = max(self._read_up_to, caught_up)
        else:
            self._read_up_to = received.arrived
            self._handle_frames(received)
        if self.transport.reached_count != self._reached_seen:
            with self._lock:
                self._note_reached()
        if self.transport.unheard_count != self._unheard_seen and self.views is not None:
            with self._lock:
                if self._give_up_on_unheard():
                    self._fill_view()
        if time.monotonic() >= next_beat:
            next_beat = time.monotonic() + self.settings.heartbeat_interval
            self._beat()
        return next_beat

    def _beat(self) -> None:
        """Mark silent peers down, and heartbeat each peer we told nothing for a while.
        In a mesh of more than HEARTBEAT_FANOUT peers both waits stretch with its size
        (membership.liveness_stretch); any other message is as good as a heartbeat, but
        every BEAT_ANYWAY_PERIODS a heartbeat goes anyway: only it (or a hello) makes us
        known to a peer that lost us, say one restarted since."""
        now = time.monotonic()
        last_sent = self.transport.last_proof_of_life
        shuffle = None
        with self._lock:
            self._note_reached()
            grace = self._unreached_grace()
            self._forget_stale(now, grace)
            again = self._greet_again(now, grace)
            for entry in self.table.expire():
                if entry.reached:  # one never reached is a stranger's word: forgotten soon
                    log.warning(
                        "%s: peer %s (%s) is down", self.settings.name, entry.name, entry.address
                    )
                if self.views is not None:  # a neighbour: replaced from the passive view
                    self._forget_neighbour(entry)
            if self.shuffles is not None:
                self._give_up_on_unheard()  # a contact refused before we had a neighbour
                again += self._greet_candidates()
                again = again or self._rejoin()
                partners = [entry for entry in self.table.alive() if entry.reached]
                shuffle = self.shuffles.due(now, partners, self.table.stretch())
            period = self.settings.heartbeat_interval * self.table.stretch()
            # Silent for a period, give or take half a tick: the last tick's heartbeat
            # left (and was timed) a moment after that tick.
            quiet = period - self.settings.heartbeat_interval / 2
            anyway = BEAT_ANYWAY_PERIODS
            targets = [
                entry.address
                for entry in self.table.entries.values()
                if entry.state != LEFT
                and (
                    now - last_sent.get(entry.address, -period) >= quiet
                    or now - self._last_beat.get(entry.address, -period) >= anyway * period
                )
            ]
            self._changes += 1
            self._changed.notify_all()
        self._heartbeat(targets, now)
        for address, wants_peers in again:
            self._say_hello(address, wants_peers)
        if shuffle is not None:
            self._send(*shuffle)

    def _heartbeat(self, addresses: list[str], now: float) -> None:
        body = self._hello_body()
        for address in addresses:
            self._last_beat[address] = now
            self._send(address, "heartbeat", body)

    def _fill_view(self) -> None:
        """Greet now the candidates a bounded view lacks (`_greet_candidates`)."""
        for address, wants_peers in self._greet_candidates():
            self._say_hello(address, wants_peers)

    def _greet_candidates(self) -> list[tuple[str, bool]]:
        """Candidates to greet now: as many as the view lacks neighbours, less the ones
        greeted already and not answered yet."""
        assert self.views is not None
        if self._finished:
            return []
        short = self.views.neighbours - self._links() - self._greeting()
        if short <= 0:
            return []
        for candidate in list(self.passive.entries.values()):
            if candidate.name and self.shuns(candidate.name):
                self.passive.discard(candidate.key)  # the node wants no link with it
        exclude = set(self.table.entries) | {self.identity.public_key}
        friends = self.table.entries.keys() if self.views.friends_first else ()
        greeted = [address for address in self._hellos_out if not self.table.at(address)]
        chosen = self.passive.take(short, exclude, friends, self._linked_addresses() + greeted)
        for candidate in chosen:
            self._learn(candidate.addr, candidate.key, from_its_owner=False)
        return [(candidate.addr, False) for candidate in chosen]

    def _greeting(self, besides: str | None = None) -> int:
        """How many nodes our hellos await that are not peers yet (but the one at
        `besides`)."""
        return sum(not self.table.at(address) for address in self._hellos_out if address != besides)

    def _note_reached(self) -> None:
        """Mark the peers whose address answered a handshake with their own key
        (transport.reached: the CURVE key dialled, None unencrypted)."""
        self._reached_seen = self.transport.reached_count
        for entry in list(self.table.entries.values()):
            self._mark_if_reached(entry)

    def _mark_if_reached(self, entry: PeerEntry) -> None:
        reached = self.transport.reached
        if entry.reached or entry.address not in reached:
            return
        dialled = reached[entry.address]
        if dialled is None or dialled == _curve_key(entry.public_key):
            self.table.mark_reached(entry.public_key)
            log.info("%s: %s joined from %s", self.settings.name, entry.name, entry.address)

    def _unreached_grace(self) -> float:
        """How long an address may take to answer a handshake: twice the (stretched) down
        timeout, for a handshake on a starved machine can take a while."""
        return 2 * self.settings.peer_timeout * self.table.stretch()

    def _forget_stale(self, now: float, grace: float) -> None:
        """Forget peers no node answered for within `grace` of their coming at their
        address, and peers left for `forget_after`: what strangers can make this node
        hold and dial is bounded in time as well as in number (WIRE.md 7.1). A reached
        peer that is down is kept (and greeted: a partition heals) until room is needed."""
        stale = [
            entry
            for entry in self.table.entries.values()
            if (not entry.reached and now - entry.entered > grace)
            or (entry.state == LEFT and now - entry.since > self.settings.forget_after)
        ]
        for entry in stale:
            self._forget(entry)
        if stale:
            log.info(
                "%s: forgot %d peer(s) gone or never reached (latest: %s at %s)",
                self.settings.name,
                len(stale),
                stale[-1].name,
                stale[-1].address,
            )

    def _forget(self, entry: PeerEntry, drain: bool = False) -> None:
        """Drop a peer and, unless another peer is there, its address."""
        self.table.forget(entry.public_key)
        if not self.table.at(entry.address):
            self._release(entry.address, drain)

    def _forget_neighbour(self, entry: PeerEntry, drain: bool = False) -> None:
        """A neighbour of a bounded view no longer: forgotten, its card not passed on."""
        assert self.shuffles is not None, "a full mesh has no neighbours to forget"
        self.shuffles.forget(entry.public_key)
        self._forget(entry, drain)

    def _release(self, address: str, drain: bool = False) -> None:
        """Close what dialling `address` holds: the connection (after what is queued for
        it, with `drain`), the key it is dialled with, our hello to it."""
        self.transport.forget(address, drain)
        self._curve_keys.pop(address, None)
        self._last_beat.pop(address, None)
        self._hellos_out.pop(address, None)

    def _may_enter(self, public_key: bytes, name: object, address: str) -> bool:
        """Whether a peer may enter the table at `address`, new or moved there: a name and
        an address no other live key holds, and room. Counted when refused."""
        if self._name_refused(public_key, name):
            return False
        holder = self.table.holder_of(address)
        if holder is not None and holder.public_key != public_key:
            self.flow_rejections[ADDRESS_TAKEN] += 1
            return False
        known = self.table.get(public_key)
        if known is not None and known.address == address:
            return True
        if known is None and (
            self._view_is_full()
            or (self.views is not None and (self._finished or self.shuns(str(name))))
        ):
            # No room, or none for a peer it shuns, or for anyone once it is done.
            self.flow_rejections[VIEW_FULL] += 1
            return False
        if known is None and self._group_is_full(address):
            self.flow_rejections[GROUP_FULL] += 1
            return False
        # New here: it will be dialled, so it counts as unreached, whoever it is.
        self._make_room(public_key)
        entries = self.table.entries.values()
        unreached = sum(not entry.reached for entry in entries if entry is not known)
        full = len(entries) - (known is not None) >= self.settings.max_peers
        if full or unreached >= self.settings.max_unreached:
            self.flow_rejections[TABLE_FULL] += 1
            return False
        return True

    def _make_room(self, newcomer: bytes) -> None:
        """Before `newcomer` enters: with `max_unreached` unreached peers, forget the one
        that came first (an honest peer is reached within moments, a stranger's address
        never); with `max_peers` in all, the one unreached, left or down longest. A
        reached, alive peer never makes room."""
        others = [e for e in self.table.entries.values() if e.public_key != newcomer]
        unreached = [entry for entry in others if not entry.reached]
        if len(unreached) >= self.settings.max_unreached:
            self._forget(min(unreached, key=lambda entry: entry.entered))
        elif len(others) >= self.settings.max_peers:
            gone = [entry for entry in others if entry.state != ALIVE or not entry.reached]
            if gone:
                self._forget(min(gone, key=lambda entry: (entry.reached, entry.since)))

    def _worth_holding(self, frames: list[Any]) -> bool:
        """Whether a big message that just arrived may wait for the worker: authentic (its
        header signature checks), and a blob this node asked its sender for or a direct
        message it reads from a peer with room for it. Anything else is dropped as it
        arrives, counted as the worker would, so nobody can queue big messages here
        (WIRE.md 10). Runs on the transport's I/O thread."""
        try:
            message = self.decoder.screen(frames)
        except Rejected:
            return False
        sender, kind = message.sender, message.kind
        with self._lock:
            if kind == "blob":
                if self.blobs.awaits_blob_from(sender):
                    return True
                self.received["unrequested_blob"] += 1
            elif kind not in BLOB_KINDS:
                self.flow_rejections["bad_header"] += 1
            else:
                refusal = self.inbox.refusal(kind, sender)
                if refusal is None and self.table.get(sender) is None:
                    refusal = INBOX_FULL  # a stranger has no room in it
                if refusal is None:
                    return True
                self.flow_rejections[refusal] += 1
        return False

    def _handle_frames(self, received: Received) -> None:
        # Decoding hashes every byte of a blob and checks two signatures: it runs without
        # the lock, so the node's thread is not held up behind a big message. Only this
        # worker thread decodes, and only it changes the peer table the checks read.
        try:
            message = self.decoder.decode(received.frames)
        except Rejected as rejection:
            refused = rejection.message
            if rejection.claim is None:
                self._log_rejection(received.routing_id, rejection)  # else the node says more
            if rejection.reason == "duplicate_key" and refused is not None:
                with self._lock:
                    self._refuse(refused)
            elif refused is not None and refused.kind == "blob":
                with self._lock:  # the holder will not send that blob: look elsewhere now
                    self.blobs.holder_failed(refused.sender, id_of_record(refused.body["record"]))
            elif rejection.claim is not None:
                with self._lock:
                    self._meet_other_mesh(rejection.claim)
                    self._changed.notify_all()
            return
        with self._lock:
            if message.sender == self.identity.public_key and message.instance == self.instance:
                return  # sent to ourselves (some hello or peer list gave out our address)
            self.received[message.kind] += 1
            self._handlers[message.kind](message)
            self._changes += 1
            self._changed.notify_all()

    def _log_rejection(self, routing_id: bytes, rejection: Rejected) -> None:
        # Once per peer connection and reason: a flood must not flood the log too.
        self._log_once(
            rejection.reason,
            routing_id,
            "%s: dropped a message (%s) from connection %s; further ones are only counted%s",
            self.settings.name,
            rejection,
            routing_id.hex(),
            _version_hint(rejection),
        )

    def _admit(self, message: Message) -> str | None:
        allowlist = self.settings.allowlist
        if (
            allowlist is not None
            and message.sender not in allowlist
            and message.sender != self.identity.public_key
        ):
            return "unknown_sender"
        return None

    def _accept(self, message: Message) -> str | None:
        if message.kind == "status":
            return None  # asking takes no part in the mesh: a probe may borrow a live key
        if message.sender == self.identity.public_key:
            # Our twin's `refuse` is signed with our own key: it is the answer we wait for.
            if message.instance == self.instance or message.kind == "refuse":
                return None
            return "duplicate_key"
        address = message.body.get("addr") if message.kind in ("hello", "heartbeat") else None
        with self._lock:
            if self.table.conflicting_instance(message.sender, message.instance, address):
                return "duplicate_key"
        return None

    def _meet_other_mesh(self, claim: SignedClaim) -> None:
        """A signed hello of another mesh that says what that mesh is: noted once per key,
        told to the node, and answered with our own hello unless it answers ours, so that its
        node can say how the two differ too (WIRE.md 7.8). Neither joins the other. Its
        signature is checked only for a new key, room left and at most status_per_second
        a second: another mesh's hellos must not buy a flood of signature checks."""
        message = claim.message
        if message.sender in self.other_meshes or len(self.other_meshes) >= MAX_OTHER_MESHES:
            return
        if not self._about_checks.allow() or not claim.authentic():
            return
        body = message.body
        met = OtherMesh(body["name"], body["addr"], dict(body["about"]))
        self.other_meshes[message.sender] = met
        if self.settings.about is not None and met.address not in self._hellos_out:
            # (a node we greeted has our `about` already: its answer is not answered)
            self._send(met.address, "hello", self._hello_body(False), once=True, key=message.sender)
        self.on_other_mesh(met)

    def _refuse(self, message: Message) -> None:
        address = message.body.get("addr")
        if message.kind == "hello" and isinstance(address, str):
            live = self.table.get(message.sender)
            where = live.address if live else self.address
            self._send(
                address,
                "refuse",
                {"reason": f"key {node_id(message.sender)} is already live at {where}"},
                key=message.sender,
            )

    # --- one handler per kind ----------------------------------------------

    def _name_refused(self, key: bytes, name: object) -> bool:
        """True (and counted) when `key` may not go by `name` (membership.name_refusal):
        names are how rules and metrics tell peers apart, so two live keys never share one
        and nobody takes this node's own."""
        refusal = self.table.name_refusal(key, name, self.settings.name)
        if refusal is not None:
            self.flow_rejections[refusal] += 1
        return refusal is not None

    def _take_in(self, message: Message, name: object, address: str) -> bool:
        """Add or refresh the sender as a peer at `address`, if it may enter the table;
        from now on it is dialled there with the CURVE twin of its key."""
        if not self._may_enter(message.sender, name, address):
            return False
        assert isinstance(name, str)  # any other name is refused
        known = self.table.get(message.sender)
        old_address = known.address if known is not None else address
        self._learn(address, message.sender)
        came_back = self.table.upsert(message.sender, name, address, message.instance)
        self.passive.discard(message.sender)  # a neighbour now, no longer a candidate
        if old_address != address and not self.table.at(old_address):
            self._release(old_address)  # moved: nothing of ours dials the old address
        entry = self.table.heard_from(message.sender, message.round)
        if came_back and entry is not None and entry.reached:
            log.info("%s: %s is back at %s", self.settings.name, name, address)
        if entry is not None:
            # Our connection there may have finished its handshake before the peer
            # entered: noted now, not at the next tick.
            self._mark_if_reached(entry)
        return True

    def _on_hello(self, message: Message) -> None:
        name, address = message.body["name"], message.body["addr"]
        wants_peers = message.body.get("list", True) is not False
        if self.table.get(message.sender) is None and (
            self._view_is_full(address) or (self.views is not None and self.shuns(name))
        ):
            self._turn_away(message.sender, address)
            return
        if self.table.get(message.sender) is None and self._group_is_full(address):
            self._turn_away(message.sender, address, GROUP_FULL)
            return
        if not self._take_in(message, name, address):
            return
        if self.shuffles is not None:
            self.shuffles.keep(message.sender, message.body.get("card"), address)
        listed = self._listed(message.sender) if wants_peers else []
        self._send(address, "peers", self._peers_body(listed))
        # Whoever says hello may have missed our announces: a late joiner, or a node
        # asking again once it took the mesh's round (refresh_offers).
        self.blobs.announce_latest(address)

    def _link_answering(self, message: Message, name: object, address: str) -> bool:
        """Take in the node that answered our hello, as `_take_in` does. It announced
        its latest blobs to us; it hears ours now: a peer in our round waits for our
        blob of it, which we may have announced before it knew us, until it hears that
        we are past that round (a heartbeat period, or more) (WIRE.md 7.1)."""
        if not self._take_in(message, name, address):
            return False
        self.blobs.announce_latest(address)
        return True

    def _me(self) -> dict[str, Any]:
        return {"name": self.settings.name, "addr": self.address, "key": self.identity.public_key}

    def _peers_body(self, listed: list[dict[str, Any]], linked: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {"peers": [self._me(), *listed]}
        if self.shuffles is not None:
            body["card"] = self.shuffles.card.packed()
            body["linked"] = linked
        return body

    def _listed(self, greeter: bytes) -> list[dict[str, Any]]:
        """The peers a `peers` answer names: every live one in a full mesh; in a bounded
        one, at most a shuffle's worth of neighbours, the greeter included."""
        alive = self.table.alive()
        if self.views is not None:
            others = [entry for entry in alive if entry.public_key != greeter]
            picked = self._rng.sample(others, min(len(others), self.views.shuffle_length - 1))
            alive = [entry for entry in alive if entry.public_key == greeter] + picked
        return [entry.describe() for entry in alive]

    def _links(self) -> int:
        """A bounded view's neighbours: peers not yet reached count, left ones do not."""
        return sum(entry.state != LEFT for entry in self.table.entries.values())

    def _view_is_full(self, greeter: str | None = None) -> bool:
        """Whether a bounded view has as many neighbours as it takes (never, in a full
        mesh). For the hello of a `greeter` at that address, the places our own hellos
        await count as taken, less the greeter's own: greeters must not fill a view
        that is greeting, or it would hold more connections than places."""
        if self.views is None:
            return False
        held = self._links() + (self._greeting(besides=greeter) if greeter is not None else 0)
        return held >= self.views.most

    def _linked_addresses(self) -> list[str]:
        """The addresses of a bounded view's neighbours (those that left not counted)."""
        return [entry.address for entry in self.table.entries.values() if entry.state != LEFT]

    def _group_is_full(self, address: str) -> bool:
        """Whether a bounded view holds as many peers of `address`'s network group as one
        group may hold (views.Limits; never in a full mesh)."""
        if self.views is None:
            return False
        limits = self.passive.limits
        return limits.crowded(address, self._linked_addresses(), limits.neighbours)

    def _turn_away(self, key: bytes, address: str, reason: str = VIEW_FULL) -> None:
        """Answer the hello of a node this view cannot take (`reason`): with some
        neighbours to try instead, and `linked: false` (WIRE.md 7.7). The answer goes
        over a connection of its own, so nothing stays open to the greeter."""
        self.flow_rejections[reason] += 1
        body = self._peers_body(self._listed(key), linked=False)
        self._send(address, "peers", body, once=True, key=key)

    def _answered_hello(self, message: Message) -> bool | None:
        """Whether our hello that `message`, a peer list, answers asked for a list; None
        when it answers no hello of ours. It must come from the key whose CURVE twin we
        dialled that address with, or (unencrypted, a bare address) list itself there."""
        curve_key = _curve_key(message.sender)
        own = [e["addr"] for e in message.body["peers"] if e["key"] == message.sender]
        answered = next(
            (address for address in self._hellos_out if self._curve_keys.get(address) == curve_key),
            next(
                (a for a in self._hellos_out if a not in self._curve_keys and a in own),
                None,
            ),
        )
        return None if answered is None else self._hellos_out.pop(answered).wants_peers

    def _on_peers(self, message: Message) -> None:
        """Take a peer list only in answer to our own hello, and greet at most
        `max_peers` of the addresses it names: nobody can aim this node at
        addresses of their choosing (WIRE.md 7.1). Entries were checked by the decoder."""
        wanted_list = self._answered_hello(message)
        if wanted_list is None:
            self.flow_rejections[UNSOLICITED_PEERS] += 1
            return
        if self.views is not None:
            self._on_view_answer(message)
            return
        introduced = 0
        for item in message.body["peers"]:
            key, name, address = item["key"], item["name"], item["addr"]
            if key == message.sender:
                self._link_answering(message, name, address)
            elif not wanted_list or key == self.identity.public_key:
                continue  # a list we did not ask for, or ourselves
            elif self.table.get(key) is None and address not in self._hellos_out:
                # No more than the table can take: a list comes only from a node we
                # greeted, yet it must not make us dial without end.
                if introduced == self.settings.max_peers or self._name_refused(key, name):
                    continue
                introduced += 1
                self._learn(address, key, from_its_owner=False)
                self._say_hello(address, wants_peers=False)
        self._joined.set()

    def _on_view_answer(self, message: Message) -> None:
        """A bounded mesh's answer to our hello: every peer it names becomes a candidate,
        and the sender our neighbour if it took us (WIRE.md 7.7)."""
        own = self.identity.public_key
        answering = None
        for item in message.body["peers"]:
            key, name, address = item["key"], item["name"], item["addr"]
            if key == message.sender:
                answering = item
            elif key != own and self.table.get(key) is None:
                # The answering node's neighbours, as it named them.
                sender = message.sender
                self.passive.add(Candidate(key, address, name=name, via=sender, source=sender))
        if answering is not None:
            self._answered_by(message, answering["name"], answering["addr"])
        self._joined.set()

    def _answered_by(self, message: Message, name: str, address: str) -> None:
        """The node that answered our hello, at `address`: our neighbour if it took us
        (`linked`), else a candidate for later."""
        assert self.shuffles is not None, "only a bounded view's hellos are answered so"
        key = message.sender
        if message.body.get("linked", True):
            if self._link_answering(message, name, address):
                self.shuffles.keep(key, message.body.get("card"), address)
                return
            # It linked us, but we cannot take it (no room left, none for its network
            # group, or a node we shun by name, known before by address alone): it must
            # hear so.
            self._send(address, "unlink", {}, once=True, key=key)
            if not self.table.at(address):
                # The connection our hello opened, once the unlink is out over it.
                self._release(address, drain=True)
            if not self.shuns(name):
                self.passive.add(Candidate(key, address, name=name))
        elif self.table.get(key) is None:
            self._release(address)
            # Turned away: the candidates it named are greeted now, not a tick from now
            # (a mesh starting together fills its views in a few round trips); the node
            # that has no room for us becomes a candidate only after.
            self._fill_view()
            card = self.shuffles.card_of(key, message.body.get("card"), address)
            self.passive.add(Candidate(key, address, card, name))

    def _on_refuse(self, message: Message) -> None:
        if not self._joined.is_set():
            self._refusal = str(message.body["reason"])
            self._joined.set()

    def _on_heartbeat(self, message: Message) -> None:
        if self.table.heard_from(message.sender, message.round) is not None:
            return
        name, address = message.body.get("name"), message.body.get("addr")
        if not isinstance(address, str):  # the decoder checked any address it carries
            return
        if self.views is None:
            self._take_in(message, name, address)  # a full mesh learns members so (7.1)
            return
        # A bounded view links by hello alone. This node takes us for its neighbour: our
        # unlink crossed its heartbeat or was lost, or we took it for dead. It must hear
        # that we are not, or it would wait on us every round (WIRE.md 7.7).
        self.flow_rejections[NOT_LINKED] += 1
        if self._unlink_answers.allow():  # each costs a connection to a named address
            self._send(address, "unlink", {}, once=True, key=message.sender)

    def _on_bye(self, message: Message) -> None:
        entry = self.table.mark_left(message.sender)
        if entry is not None:
            log.info("%s: %s left", self.settings.name, entry.name)
            self.transport.forget(entry.address)

    def _on_unlink(self, message: Message) -> None:
        """A neighbour dropped us: forgotten, and not kept as a candidate (it did not want
        us; greeting it back would undo its choice). Its place is filled from the passive
        view now, not at the next tick (WIRE.md 7.7): neighbours drop one another as their
        rounds end, nearly together, and a place left empty until the next tick is one
        the next round may begin without."""
        entry = self.table.get(message.sender)
        if self.views is None or entry is None:
            return
        self._forget_neighbour(entry)
        self._fill_view()

    def _on_shuffle(self, message: Message) -> None:
        """A neighbour's shuffle: the cards it carried kept as candidates, and answered
        with as many of ours (views.Shuffles). Only neighbours shuffle with us
        (`not_linked`)."""
        entry = self.table.get(message.sender)
        if self.shuffles is None or entry is None:
            self.flow_rejections[NOT_LINKED] += 1
            return
        answer = self.shuffles.take_shuffle(message.sender, message.body)
        if answer is not None:
            self._send(entry.address, "shuffle_reply", answer)

    def _on_shuffle_reply(self, message: Message) -> None:
        if self.shuffles is None:
            self.flow_rejections[UNSOLICITED_CARDS] += 1
            return
        self.shuffles.take_reply(message.sender, message.body)

    def _on_status(self, message: Message) -> None:
        # Not `heard_from`: the asker may be a probe holding a peer's key, and it says
        # nothing about whether that peer is alive.
        if not self._status_answers.allow():
            self.received["status_unanswered"] += 1
            return
        address = message.body["addr"]
        is_peer = any(entry.address == address for entry in self.table.entries.values())
        self._send(
            address,
            "status_reply",
            {"status": self._status()},
            once=not is_peer,
            key=message.sender,
        )

    def _status(self) -> dict[str, Any]:
        """This node as a status answer tells it (WIRE.md 7.6)."""
        now = time.monotonic()
        peers = [
            {
                "name": entry.name,
                "id": entry.id,
                "addr": entry.address,
                "state": entry.state,
                "round": entry.round,
                "last_seen_s": round(now - entry.last_seen, 3),
            }
            for entry in self.table.entries.values()
        ]
        status = {
            "name": self.settings.name,
            "addr": self.address,
            "round": self.round,
            "uptime_s": round(now - self._started, 3),
            "peers": peers,
            "rejections": self.rejections(),
            "received": dict(self.received),
        }
        if self.status_extra is not None:
            status.update(self.status_extra())
        return status

    def _on_status_reply(self, message: Message) -> None:
        pass  # a node never asks, so an answer is unsolicited: counted in `received` only

    def _on_direct(self, message: Message) -> None:
        """Queue an `upload` or `personal` for `next_message`, if this node reads that kind
        and its sender has room in the inbox (inbox.py)."""
        self.table.heard_from(message.sender, message.round)
        refusal = self.inbox.put(message)
        if refusal is not None:
            self.flow_rejections[refusal] += 1


@functools.lru_cache(maxsize=4096)
def _curve_key(public_key: bytes) -> bytes:
    """The CURVE key bound to an Ed25519 public key; empty for bytes that are none."""
    try:
        return curve_public_key(public_key)
    except BadPublicKey:
        return b""


def _version_hint(rejection: Rejected) -> str:
    """A word for the operator when a message came from a node of another version."""
    if rejection.reason == "bad_header" and rejection.detail.startswith("version "):
        return (
            f"; the sender speaks meshfl protocol {rejection.detail.split()[1]}, this "
            f"node {PROTOCOL_VERSION}: run the same meshfl version on every node"
        )
    return ""
