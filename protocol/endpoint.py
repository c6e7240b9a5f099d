"""A node's presence in the mesh: membership, gossip and blob exchange over one transport.

The endpoint runs a worker thread that decodes every incoming message, keeps the
peer table, answers `hello` and `fetch`, and sends heartbeats. The node talks to
it from its own thread: publish a blob, look at what peers announced, fetch the
blobs it chooses, wait for them until a deadline. The blobs, offers and fetches
themselves are the exchange's (exchange.py), whom it links with its
overlay's (overlay.py: a full mesh or a bounded view), its hellos, peer lists and the
keys it dials with its handshake's (handshake.py), who and what may enter its
admission's (admission.py), and heartbeats and down marks its liveness' (liveness.py);
the endpoint passes them the messages.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from .addresses import resolved
from .admission import Admission
from .decoder import Decoder
from .errors import UserError
from .exchange import BlobExchange, Counts, FetchRecord
from .handshake import Handshake
from .identity import Identity
from .inbox import DirectInbox
from .liveness import Liveness
from .membership import ALIVE, PeerEntry, PeerTable, liveness_stretch
from .memory import MemoryNetwork, MemoryTransport
from .offers import Offer
from .outbox import Outbox
from .overlay import BoundedView, FullMesh, Overlay
from .parts import EndpointSettings, OtherMesh, RateLimit
from .probe import StatusAnswers
from .transport import (
    Transport,
    contact,
)
from .views import ViewSettings
from .wire import (
    Blob,
    Message,
    announce_body,
    new_instance,
)
from .worker import Worker

log = logging.getLogger("meshfl.endpoint")

# Refused at the encrypted handshake, before any message: a client key a closed mesh
# does not list (WIRE.md 1.1). Counted beside the decoder's reasons.
REFUSED_HANDSHAKE = "refused_handshake"

# What strangers can make a node do is bounded (WIRE.md 7.1, 7.3); these flow reasons
# count what was refused for it, beside the decoder's.


class Refused(UserError):
    """The mesh refused this process (its key is already live elsewhere)."""


class Endpoint:
    worker: Worker  # made last, for it dispatches to every other part

    def __init__(
        self,
        identity: Identity,
        mesh_id: bytes,
        settings: EndpointSettings,
        schema: bytes | None = None,
        network: MemoryNetwork | None = None,
    ) -> None:
        """`network`: an in-process network to carry messages instead of sockets."""
        self.identity = identity
        self.mesh_id = mesh_id
        self.settings = settings
        self.instance = new_instance()
        # Where peers dial us: an IP address, as messages may name no other (WIRE.md 5).
        self.address = resolved(settings.address)
        self.round = 0
        # The peer table's clock: up to when the worker has read what arrived.
        self.table = PeerTable(
            settings.peer_timeout, clock=lambda: self.worker.read_up_to, crowd=settings.crowd
        )
        self.admission = Admission(self)
        self.decoder = Decoder(
            mesh_id,
            settings.limits,
            schema,
            self.admission.admit,
            self.admission.accept,
            kept=self.is_peer,
        )
        self.received: Counter[str] = Counter()  # messages delivered, by kind
        self.flow_rejections: Counter[str] = Counter()  # refusals after decoding, by reason
        self._changes = 0  # counts handled messages and heartbeat ticks: see wait_change
        # What the node adds to a status answer (accuracies...); called on the worker
        # thread, so it must be quick and thread-safe.
        self.status_extra: Callable[[], dict[str, Any]] | None = None
        self.unlink_answers = RateLimit(settings.status_per_second)
        self.inbox = DirectInbox(settings.direct_kinds)
        self.status_answers = StatusAnswers(self)
        self.lock = threading.RLock()
        self._changed = threading.Condition(self.lock)
        self.blobs = BlobExchange(
            settings.name,
            identity.public_key,
            self.table,
            self.send,
            Counts(self.received, self.flow_rejections),
            self.lock,
            lambda: self.round,
            settings.store_bytes,
            settings.max_inflight,
            settings.fetch_timeout,
        )
        self.liveness = Liveness(self)
        # Whom the node links with (overlay.py), and the hellos it links by (handshake.py).
        views = settings.views
        self.overlay: Overlay = BoundedView(self, views) if views else FullMesh(self)
        self.passive = self.overlay.passive
        self.handshake = Handshake(self)
        # Set once the node has done its last round: it keeps the neighbours it has, to
        # serve them its last blob, and takes in and looks for no others.
        self.finished = False
        # Whether the node wants no link with the peer of this name (its record shows
        # clear harm that repeats): called on the worker thread, so it must only read.
        self.shuns: Callable[[str], bool] = lambda name: False
        # Nodes of other meshes that said hello, by key, and what the node is told of each
        # as it is met (on the worker thread: it must be quick).
        self.other_meshes: dict[bytes, OtherMesh] = {}
        self.on_other_mesh: Callable[[OtherMesh], None] = lambda met: None
        # One handler per kind of WIRE.md section 4; the decoder lets no other kind through.
        handlers: dict[str, Callable[[Message], None]] = {
            "hello": self.handshake.on_hello,
            "peers": self.handshake.on_peers,
            "refuse": self.handshake.on_refuse,
            "heartbeat": self.liveness.on_heartbeat,
            "bye": self.liveness.on_bye,
            "announce": self.blobs.on_announce,
            "fetch": self.blobs.on_fetch,
            "miss": self.blobs.on_miss,
            "blob": self.blobs.on_blob,
            "status": self.status_answers.on_status,
            "status_reply": self.status_answers.on_status_reply,
            "upload": self.on_direct,
            "personal": self.on_direct,
            "shuffle": self.overlay.on_shuffle,
            "shuffle_reply": self.overlay.on_shuffle_reply,
            "unlink": self.overlay.on_unlink,
        }
        self.worker = Worker(self, handlers)
        # Peers are judged at most a tick late for a transport with nothing to read: a
        # tick stretched for a host's crowd of nodes, whose idle transports must not
        # each wake every second to take their turn at the GIL.
        tick = settings.heartbeat_interval * liveness_stretch(settings.crowd)
        options = replace(settings.transport, idle_check_s=tick)
        connect = network.transport if network is not None else Transport
        self.transport: Transport | MemoryTransport = connect(
            settings.listen,
            options,
            self.admission.encryption(),
            screen=self.admission.worth_holding,
        )
        self.outbox = Outbox(
            identity,
            mesh_id,
            self.instance,
            self.transport,
            lambda address: self.handshake.curve_keys.get(address),
            lambda: self.round,
        )

    @property
    def views(self) -> ViewSettings | None:
        """The bounded view's settings; None in a full mesh (the overlay's)."""
        return self.overlay.views

    def is_peer(self, key: bytes) -> bool:
        return self.table.get(key) is not None

    @property
    def id(self) -> str:
        return self.identity.id

    @property
    def contact(self) -> str:
        """How another node dials this one: KEY@ADDRESS (WIRE.md 1.1)."""
        return contact(self.address, self.identity.public_key)

    # --- the node's side --------------------------------------------------

    def start(
        self,
        bootstrap: Iterable[str] = (),
        anchors: Iterable[str] = (),
        dropped_machines: Mapping[str, int] | None = None,
    ) -> None:
        """Start serving and say hello to every bootstrap contact (any one is enough):
        KEY@tcp://HOST:PORT, or a bare address where the mesh does not encrypt; a
        bounded view greets its `anchors` (contacts alike) first, and keeps out the
        `dropped_machines` a checkpoint kept (machine -> the round its keep-out counts from)."""
        self.overlay.keep_out(dropped_machines or {})
        if self.settings.encrypt:
            log.info(
                "%s: listening encrypted; others dial it as %s", self.settings.name, self.contact
            )
        greet = self.handshake.begin(bootstrap, anchors)
        for index, address in enumerate(greet):
            # One peer list is enough: the others were named to us already (WIRE.md 7.1).
            self.handshake.say_hello(address, wants_peers=index == 0)
        # After the keys above are in place (it learns more) and our first hellos await
        # their answers: a worker started before them would greet candidates for the
        # places the first contacts (a resumed node's anchors) are greeted for.
        self.worker.thread.start()
        if not self.handshake.bootstrap:
            self.handshake.joined.set()

    def wait_joined(self, timeout: float, until_other_mesh: bool = False) -> bool:
        """True once a peer answered our hello; raises Refused if the mesh refused us.
        `until_other_mesh`: stop waiting, too, once a node of another mesh said hello
        while no peer has (a joiner that dialled the wrong mesh learns it at once)."""
        with self._changed:
            self._changed.wait_for(
                lambda: (
                    self.handshake.joined.is_set()
                    or (until_other_mesh and bool(self.other_meshes) and not self.table.alive())
                ),
                timeout,
            )
        if self.handshake.refusal:
            raise Refused(self.handshake.refusal)
        return self.handshake.joined.is_set()

    def set_round(self, round_no: int) -> None:
        with self.lock:  # the overlay is read on the worker thread
            self.overlay.pace(self.round, round_no)
        self.round = round_no
        self.blobs.forget_before(round_no)

    def peers(self) -> list[PeerEntry]:
        with self.lock:
            return [PeerEntry(**vars(entry)) for entry in self.table.entries.values()]

    def alive_peers(self) -> list[PeerEntry]:
        """The live peers: every member of a full mesh, the neighbours of a bounded one."""
        return [entry for entry in self.peers() if entry.state == ALIVE]

    def expected_peers(self, mesh_size: int) -> int:
        """How many live peers a node of a `mesh_size`-node mesh can expect to have."""
        others = max(mesh_size - 1, 0)
        return self.overlay.expected_peers(others)

    def unlink(self, public_keys: Iterable[bytes], vouched: Collection[bytes] = ()) -> None:
        """Drop neighbours of a bounded mesh: each is told (`unlink`), and other
        candidates are greeted in their places, first those the `vouched` neighbours
        (the ones that helped this node) named as their own."""
        with self.lock:
            self.overlay.vouch(vouched)
            entries = [self.table.get(key) for key in public_keys]
            self.overlay.unlink([entry for entry in entries if entry is not None])

    def dropped_machines(self, in_round: int) -> dict[str, int]:
        """The machines of dropped neighbours the view still keeps out in round
        `in_round`, each with the round its keep-out counts from (for the checkpoint)."""
        with self.lock:
            return self.overlay.dropped_machines(in_round)

    def greetable_candidates(self) -> int:
        """How many candidates the node could greet for a free place now (those on
        machines it keeps out not counted)."""
        with self.lock:
            return self.overlay.greetable()

    def finish(self) -> None:
        """The node has done its last round (`set_round` past it): every live peer hears
        so now, not a heartbeat period from now, so that none lingers for it; a bounded
        view keeps the neighbours it has and looks for no others (WIRE.md 7.7)."""
        with self.lock:
            self.finished = True
            targets = [entry.address for entry in self.table.alive()]
        self.liveness.heartbeat(targets, time.monotonic())

    def wait_for_peers(self, count: int, timeout: float) -> bool:
        """Whether `count` peers are live within `timeout`. A bounded view waits only
        while a candidate greeted for a place it lacks has yet to answer: when the mesh
        has no one more to give, waiting would only make the round late."""
        deadline = time.monotonic() + timeout
        with self._changed:
            self.overlay.fill()  # a place freed since the last tick: greeted for now
            while len(self.table.alive()) < count:
                left = deadline - time.monotonic()
                if left <= 0 or not self.overlay.may_wait():
                    return False
                self._changed.wait(left)
        return True

    def publish(self, blob: Blob) -> None:
        """Hold `blob` for fetching and announce it to every live peer."""
        self.blobs.hold(blob)
        with self.lock:
            targets = [entry.address for entry in self.table.alive()]
        for address in targets:
            self.send(address, "announce", announce_body(blob))

    def refresh_offers(self) -> None:
        """Say hello again to every live peer; each re-announces its latest blobs. A late
        joiner calls this once it took the mesh's round: announces that came with its
        first hellos were too far ahead of its round 0 to be kept."""
        for entry in self.alive_peers():
            self.handshake.say_hello(entry.address, wants_peers=False)

    def changes(self) -> int:
        """A counter that moves whenever the endpoint handled a message or checked
        liveness: pass it to `wait_change` to sleep until something may have changed."""
        with self.lock:
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
        with self.lock:
            entry = self.table.get(public_key)
        if entry is None:
            return False
        self.send(entry.address, kind, body or {}, blob)
        return True

    def next_message(self, kind: str, timeout: float) -> Message | None:
        """The next message of a direct kind (upload, personal), or None."""
        return self.inbox.next(kind, timeout)

    def rejections(self) -> dict[str, int]:
        """Messages dropped, by reason: the decoder's and the flows'."""
        with self.lock:
            refused = Counter({REFUSED_HANDSHAKE: self.transport.refused_handshakes})
            return dict(Counter(self.decoder.rejection_counts()) + self.flow_rejections + refused)

    def stats(self) -> dict[str, Any]:
        with self.lock:
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

    def thread_ids(self) -> list[int]:
        """The native ids of the threads that work for this endpoint alone: its worker's
        and its transport's (node/thread_cpu.py reads what they spend)."""
        worker = self.worker.thread.native_id
        return ([] if worker is None else [worker]) + self.transport.thread_ids()

    def fetches_since(self, start: int) -> list[FetchRecord]:
        """The blobs this endpoint pulled, from the `start`-th on (`stats()["fetched"]`
        counts them): the transport's own record, not what the caller asked for."""
        return self.blobs.fetches_since(start)

    def close(self) -> None:
        """Say bye to every live peer, then stop."""
        if self.worker.stopping.is_set():
            return
        for entry in self.alive_peers():
            self.send(entry.address, "bye", {})
        self.worker.stopping.set()
        self.transport.wake_reader()
        if self.worker.thread.is_alive():
            self.worker.thread.join(timeout=5)
        self.transport.close()

    # --- sending ----------------------------------------------------------

    def send(
        self,
        address: str,
        kind: str,
        body: dict[str, Any],
        blob: Blob | None = None,
        once: bool = False,
        key: bytes | None = None,
    ) -> None:
        """Number, sign and queue one message (outbox.py)."""
        self.outbox.send(address, kind, body, blob, once, key)

    def may_come(self, offer: Offer) -> bool:
        """Whether a live peer may still send the blob `offer` names: its origin or a
        holder that is alive and did not answer a fetch of it with `miss`."""
        with self.lock:
            return self.blobs.pick_holder(offer) is not None

    # --- the worker thread -----------------------------------------------------

    def forget(self, entry: PeerEntry, drain: bool = False) -> None:
        """Drop a peer and, unless another peer is there, its address."""
        self.table.forget(entry.public_key)
        if not self.table.at(entry.address):
            self.release(entry.address, drain)

    def release(self, address: str, drain: bool = False) -> None:
        """Close what dialling `address` holds: the connection (after what is queued for
        it, with `drain`), the key it is dialled with, our hello to it."""
        self.transport.forget(address, drain)
        self.handshake.drop(address)
        self.liveness.last_beat.pop(address, None)

    def note_change(self) -> None:
        """A message was handled or liveness checked (`wait_change`); under the lock."""
        self._changes += 1
        self.wake_waiters()

    def wake_waiters(self) -> None:
        """Wake the node's waits to look again; under the lock."""
        self._changed.notify_all()

    # --- one handler per kind ----------------------------------------------

    def take_in(self, message: Message, name: object, address: str) -> bool:
        """Add or refresh the sender as a peer at `address`, if it may enter the table;
        from now on it is dialled there with the CURVE twin of its key."""
        if not self.admission.may_enter(message.sender, name, address):
            return False
        assert isinstance(name, str)  # any other name is refused
        known = self.table.get(message.sender)
        old_address = known.address if known is not None else address
        self.handshake.learn(address, message.sender)
        came_back = self.table.upsert(message.sender, name, address, message.instance)
        self.passive.discard(message.sender)  # a neighbour now, no longer a candidate
        if old_address != address and not self.table.at(old_address):
            self.release(old_address)  # moved: nothing of ours dials the old address
        entry = self.table.heard_from(message.sender, message.round)
        if came_back and entry is not None and entry.reached:
            log.info("%s: %s is back at %s", self.settings.name, name, address)
        if entry is not None:
            # Our connection there may have finished its handshake before the peer
            # entered: noted now, not at the next tick.
            self.liveness.mark_if_reached(entry)
        return True

    def on_refused_direct(self, message: Message, reason: str) -> None:
        """A direct message of a peer whose frames the decoder refused (`reason`, counted
        there): queued without them, marked `refused`, so that the node reading it stops
        waiting for it (a coordinator for a client's upload)."""
        if self.table.get(message.sender) is not None:
            self.on_direct(replace(message, blob=None, refused=reason))

    def on_direct(self, message: Message) -> None:
        """Queue an `upload` or `personal` for `next_message`, if this node reads that kind
        and its sender has room in the inbox (inbox.py)."""
        self.table.heard_from(message.sender, message.round)
        refusal = self.inbox.put(message)
        if refusal is not None:
            self.flow_rejections[refusal] += 1
