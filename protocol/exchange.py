"""The blob half of an endpoint (WIRE.md 7.4): the blobs a node holds and serves, the
offers its peers announced, and its fetches of theirs.

A node announces each blob it publishes; a peer that wants it sends `fetch` to a holder
(the origin while it is alive, else another that announced it) and gets the `blob`, or a
`miss` that sends it to the next holder at once. At most `max_inflight` fetches wait on
one holder; a fetch unanswered for `fetch_timeout` seconds frees its slot, so one lost
blob cannot block a holder for good. Only blobs this node asked for are kept, and a blob
whose signed record contradicts its announce is dropped with the announce.

The endpoint owns the exchange: it passes in its peer table, its way of sending, its
counters and its lock, and calls the `on_*` handlers from its worker thread with that
lock held. The node's thread calls the other methods through the endpoint.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from .identity import node_id
from .membership import ALIVE, PeerEntry, PeerTable
from .offers import BlobStore, Offer, OfferBook
from .wire import Blob, Message, announce_body

log = logging.getLogger("meshfl.endpoint")

# Rejected after decoding: a blob whose signed record is not what its announce said
# (WIRE.md 7.4). Counted beside the decoder's reasons.
OFFER_MISMATCH = "offer_mismatch"
# How many rounds a node's own blobs outlive their round: a neighbour one round behind
# still fetches them. Live neighbours are never further apart unless one let a round's
# deadline pass, and that one goes on with the models still served (a `miss` for the
# others). Each round kept is one more copy of the model in memory, in every node.
OWN_ROUNDS_KEPT = 1

# How the endpoint sends a message: to an address, of a kind, with a body and a blob.
Send = Callable[..., None]


@dataclass
class FetchRecord:
    """One blob fetched: kept so tests and metrics can say exactly what was pulled."""

    origin: str
    round: int
    kind: str
    size: int
    holder: str
    # When it came (monotonic, taken as it is kept): how long a round waited for it.
    arrived: float = field(default_factory=time.monotonic, compare=False)


@dataclass
class Fetches:
    """Fetch requests per holder, at most `cap` in flight each; the rest wait their turn.

    A request unanswered for `stale_after` seconds (the blob was lost or rejected)
    frees its slot, so one bad blob cannot block a holder for good.
    """

    cap: int
    stale_after: float
    in_flight: dict[bytes, dict[bytes, float]] = field(default_factory=lambda: defaultdict(dict))
    waiting: dict[bytes, deque[bytes]] = field(default_factory=lambda: defaultdict(deque))

    def request(self, holder: bytes, blob_id: bytes) -> bool:
        """Queue a fetch; True when it may be sent now."""
        slots = self.in_flight[holder]
        now = time.monotonic()
        for stale in [i for i, sent in slots.items() if now - sent > self.stale_after]:
            del slots[stale]
        if blob_id in slots or blob_id in self.waiting[holder]:
            return False
        if len(slots) < self.cap:
            slots[blob_id] = now
            return True
        self.waiting[holder].append(blob_id)
        return False

    def asked(self, holder: bytes) -> bool:
        """Whether a fetch to `holder` is in flight."""
        return bool(self.in_flight.get(holder))

    def requested(self, blob_id: bytes) -> bool:
        return any(blob_id in slots for slots in self.in_flight.values())

    def cancel(self, holder: bytes, blob_id: bytes) -> bool:
        """Take back a fetch in flight to `holder`; False when there was none."""
        return self.in_flight.get(holder, {}).pop(blob_id, None) is not None

    def release(self, holder: bytes) -> list[tuple[bytes, bytes]]:
        """The next waiting fetch to `holder`, now that a slot is free, if any."""
        if not self.waiting[holder] or len(self.in_flight[holder]) >= self.cap:
            return []
        follower = self.waiting[holder].popleft()
        self.in_flight[holder][follower] = time.monotonic()
        return [(holder, follower)]

    def done(self, blob_id: bytes) -> list[tuple[bytes, bytes]]:
        """Mark a blob answered; return the (holder, blob id) fetches now allowed out."""
        answered = [holder for holder in list(self.in_flight) if self.cancel(holder, blob_id)]
        return [fetch for holder in answered for fetch in self.release(holder)]


@dataclass
class Counts:
    """The endpoint's counters the exchange adds to: messages by what became of them
    (`received`), and refusals after decoding by reason (`flow_rejections`)."""

    received: Counter[str]
    flow_rejections: Counter[str]


class BlobExchange:
    """One node's blobs, offers and fetches (see the module's docstring)."""

    def __init__(
        self,
        name: str,
        own_key: bytes,
        table: PeerTable,
        send: Send,
        counts: Counts,
        lock: threading.RLock,
        round_now: Callable[[], int],
        store_bytes: int,
        max_inflight: int,
        fetch_timeout: float,
    ) -> None:
        self.name = name
        self.own_key = own_key
        self.table = table
        self.send = send
        self.counts = counts
        self.lock = lock
        self.round_now = round_now  # the endpoint's round: offers are kept near it
        self.store = BlobStore(store_bytes)
        self.offer_book = OfferBook()
        self.fetch_log: list[FetchRecord] = []
        self.latest: list[Blob] = []  # the last round's published blobs, re-announced
        self.fetches = Fetches(max_inflight, fetch_timeout)

    # --- the node's side: each takes the lock -----------------------------------------

    def forget_before(self, round_no: int) -> None:
        """Forget the offers and blobs of rounds before `round_no`; own blobs are kept
        OWN_ROUNDS_KEPT rounds longer, for peers one round behind."""
        with self.lock:
            self.offer_book.forget_before(round_no)
            self.store.forget_before(round_no, self.own_key, OWN_ROUNDS_KEPT)

    def hold(self, blob: Blob) -> None:
        """Keep a blob of ours for fetching, and among the latest to re-announce."""
        with self.lock:
            self.store.put(blob)
            if self.latest and self.latest[0].round < blob.round:
                self.latest.clear()
            if not self.latest or self.latest[0].round == blob.round:
                self.latest.append(blob)

    def offers(self, round_no: int, kind: str | None = None) -> list[Offer]:
        with self.lock:
            return list(self.offer_book.for_round(round_no, kind))

    def round_offers(
        self,
        round_no: int,
        kinds: set[str],
        origins: set[bytes],
        quorum: float,
        wait_for_laggards: bool = False,
    ) -> tuple[list[Offer], bool]:
        """The offers of round `round_no` of `kinds`, and whether a `quorum` share of the
        live peers among `origins` announced every kind of `kinds`; a peer that has not
        is waited for only while it can deliver (or, `wait_for_laggards`, always)."""
        with self.lock:
            known = self.table.entries
            offers = [o for o in self.offer_book.for_round(round_no) if o.kind in kinds]
            announced = {(offer.origin, offer.kind) for offer in offers}
            rounds = {key: entry.round for key, entry in known.items() if entry.state == ALIVE}
        delivered = {
            origin
            for origin in rounds.keys() & origins
            if all((origin, kind) in announced for kind in kinds)
        }
        # A live peer that did not deliver is waited for only while it can: not once it
        # is past this round, nor while it is two or more behind (it was frozen or cut
        # off, and would hold every round for round_timeout as it catches up).
        waiting = {
            origin
            for origin in rounds.keys() & origins - delivered
            if wait_for_laggards or round_no - 1 <= rounds[origin] <= round_no
        }
        # Rounded up, with a little slack for floating point: 0.7 of 10 peers is 7, not 8.
        needed = math.ceil(quorum * (len(delivered) + len(waiting)) - 1e-9)
        return offers, len(delivered) >= needed

    def fetch(self, offers: Sequence[Offer]) -> None:
        """Ask for these blobs, from their origin when it is alive, else another holder."""
        sends = []
        with self.lock:
            for offer in offers:
                if offer.id in self.store:
                    continue
                holder = self.pick_holder(offer)
                if holder is not None and self.fetches.request(holder.public_key, offer.id):
                    sends.append((holder.address, offer.id))
        for address, blob_id in sends:
            self.send(address, "fetch", {"id": blob_id})

    def held(self, blob_ids: Iterable[bytes]) -> dict[bytes, Blob]:
        """The blobs among `blob_ids` that are here now, by id."""
        with self.lock:
            return {i: blob for i in blob_ids if (blob := self.store.get(i)) is not None}

    def forget_fetched(self, blob_ids: Iterable[bytes]) -> None:
        """Forget these fetched blobs: the node took them in. A node serves others only
        the blobs it announced, its own, so a fetched one is of no use to keep."""
        with self.lock:
            fetched = [
                blob_id
                for blob_id in blob_ids
                if (blob := self.store.get(blob_id)) is not None and blob.origin != self.own_key
            ]
            self.store.drop(fetched)

    def fetches_since(self, start: int) -> list[FetchRecord]:
        with self.lock:
            return self.fetch_log[start:]

    # --- called with the lock held (the worker's handlers and their helpers) -----------

    def announce_latest(self, address: str) -> None:
        """Announce our latest blobs to the node at `address` (a newcomer)."""
        for blob in self.latest:
            self.send(address, "announce", announce_body(blob))

    def pick_holder(self, offer: Offer) -> PeerEntry | None:
        """A live peer to fetch `offer` from: its origin first, then the others that
        announced it, less those that answered `miss`."""
        candidates = [self.table.get(key) for key in offer.servers()]
        alive = [entry for entry in candidates if entry is not None and entry.state == ALIVE]
        return alive[0] if alive else None

    def awaits_blob_from(self, holder: bytes) -> bool:
        """Whether a fetch of ours to `holder` is in flight: only then may a blob of it
        wait for the worker (the transport's screen of big messages)."""
        return self.fetches.asked(holder)

    def on_announce(self, message: Message) -> None:
        # Offers are kept from known peers and for a window of rounds only, so an
        # announcing stranger cannot grow the offer book without bound.
        known = self.table.heard_from(message.sender, message.round) is not None
        body = message.body
        if not known or body["round"] > self.round_now() + self.offer_book.keep_rounds:
            self.counts.received["ignored_announce"] += 1
            return
        offer = Offer(
            body["id"], body["origin"], body["round"], body["kind"], body["digest"], body["size"]
        )
        self.offer_book.add(offer, message.sender)

    def on_fetch(self, message: Message) -> None:
        entry = self.table.heard_from(message.sender, message.round)
        blob = self.store.get(message.body["id"])
        if blob is None or entry is None:
            self.counts.received["fetch_miss"] += 1
        if entry is None:
            return  # a stranger gets nothing
        if blob is None:  # a known peer learns at once that it must look elsewhere
            self.send(entry.address, "miss", {"id": message.body["id"]})
        else:
            self.send(entry.address, "blob", {}, blob)

    def on_miss(self, message: Message) -> None:
        self.table.heard_from(message.sender, message.round)
        self.holder_failed(message.sender, message.body["id"])

    def holder_failed(self, holder_key: bytes, blob_id: bytes) -> None:
        """A holder we asked will not send the blob (it answered `miss`, or sent one that
        failed decoding): free its fetch slot, and ask the next holder at once (or, with
        none left, let the round go on without it)."""
        offer = self.offer_book.get(blob_id)
        if offer is None or not self.fetches.cancel(holder_key, blob_id):
            return  # we asked that holder nothing of the kind
        offer.missed_by.add(holder_key)
        self._send_fetches(self.fetches.release(holder_key))
        holder = self.pick_holder(offer)
        if holder is not None and self.fetches.request(holder.public_key, blob_id):
            self.send(holder.address, "fetch", {"id": blob_id})

    def on_blob(self, message: Message) -> None:
        entry = self.table.heard_from(message.sender, message.round)
        blob = message.blob
        assert blob is not None
        if not self.fetches.requested(blob.id):
            # Only what we asked for: unsolicited blobs must not push ours out of the store.
            self.counts.received["unrequested_blob"] += 1
            return
        offer = self.offer_book.get(blob.id)
        if offer is None or offer.describes(blob):
            self._keep_fetched(blob, entry.name if entry else node_id(message.sender))
        else:
            self._reject_offer(offer, blob)
        self._send_fetches(self.fetches.done(blob.id))

    def _send_fetches(self, fetches: list[tuple[bytes, bytes]]) -> None:
        """Send the (holder, blob id) fetches that just got a slot."""
        for holder_key, blob_id in fetches:
            target = self.table.get(holder_key)
            if target is not None:
                self.send(target.address, "fetch", {"id": blob_id})

    def _keep_fetched(self, blob: Blob, holder: str) -> None:
        self.store.put(blob)
        self.fetch_log.append(FetchRecord(blob.origin_id, blob.round, blob.kind, blob.size, holder))

    def _reject_offer(self, offer: Offer, blob: Blob) -> None:
        """The blob's signed record contradicts its announce: the announcer lied about
        whose blob it is (or its round or kind). Drop both, so the node neither credits
        the blob to the wrong peer nor asks for it again; a truthful announce re-adds it."""
        self.counts.flow_rejections[OFFER_MISMATCH] += 1
        self.offer_book.discard(offer.id)
        log.warning(
            "%s: dropped blob %s: announced as %s's %s of round %d, signed as %s's %s of round %d",
            self.name,
            blob.id.hex()[:16],
            offer.origin_id,
            offer.kind,
            offer.round,
            blob.origin_id,
            blob.kind,
            blob.round,
        )
