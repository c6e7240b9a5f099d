"""What is on offer and what we hold: announced blobs and a bounded blob store.

Both are keyed by the blob id (the sha256 of the origin's signed record), never by the
tensors' digest alone: two origins may well publish bit-identical tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from .identity import node_id
from .wire import Blob


@dataclass
class Offer:
    """An announced blob: who made it, for which round, and who can serve it.

    Everything but `id` is the announcer's claim; the blob's own record decides.
    """

    id: bytes
    origin: bytes
    round: int
    kind: str
    digest: bytes
    size: int
    holders: list[bytes] = field(default_factory=list)
    # Keys that answered a fetch of it with `miss`: they no longer hold it (WIRE.md 7.4).
    missed_by: set[bytes] = field(default_factory=set)

    def servers(self) -> list[bytes]:
        """Who may still send it, the origin first."""
        return [key for key in [self.origin, *self.holders] if key not in self.missed_by]

    @property
    def origin_id(self) -> str:
        return node_id(self.origin)

    def describes(self, blob: Blob) -> bool:
        """True when the blob is what this offer said: same origin, round and kind."""
        return (self.origin, self.round, self.kind) == (blob.origin, blob.round, blob.kind)


class BlobStore:
    """Blobs by id, oldest evicted first once `max_bytes` is passed.

    It holds the node's own blobs, served to its peers, and those it fetched until the
    node has taken them in (BlobExchange.forget_fetched).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._blobs: OrderedDict[bytes, Blob] = OrderedDict()

    def __contains__(self, blob_id: bytes) -> bool:
        return blob_id in self._blobs

    def get(self, blob_id: bytes) -> Blob | None:
        blob = self._blobs.get(blob_id)
        if blob is not None:
            self._blobs.move_to_end(blob_id)
        return blob

    def put(self, blob: Blob) -> None:
        if blob.id in self._blobs:
            return
        self._blobs[blob.id] = blob
        self.bytes += blob.size
        while self.bytes > self.max_bytes and len(self._blobs) > 1:
            _, evicted = self._blobs.popitem(last=False)
            self.bytes -= evicted.size

    def drop(self, blob_ids: Iterable[bytes]) -> None:
        """Forget these blobs (those not here are no matter)."""
        for blob_id in blob_ids:
            if (blob := self._blobs.pop(blob_id, None)) is not None:
                self.bytes -= blob.size

    def forget_before(self, round_no: int, own_origin: bytes, own_rounds: int) -> None:
        """Drop the blobs of rounds before `round_no`, but keep those of `own_origin` (the
        node's own) for `own_rounds` rounds more: a peer that lags behind fetches them
        from their origin for as long as it keeps their offers. A node fetches every
        peer's blob every round, and publishes its own: kept for a whole run, they would
        fill its memory round after round."""
        gone = [
            blob_id
            for blob_id, blob in self._blobs.items()
            if blob.round < round_no - (own_rounds if blob.origin == own_origin else 0)
        ]
        for blob_id in gone:
            self.bytes -= self._blobs.pop(blob_id).size


class OfferBook:
    """Announced blobs by id; old rounds are forgotten to bound memory."""

    def __init__(self, keep_rounds: int = 4) -> None:
        self.keep_rounds = keep_rounds
        self._offers: dict[bytes, Offer] = {}

    def add(self, offer: Offer, holder: bytes) -> Offer:
        known = self._offers.setdefault(offer.id, offer)
        if holder not in known.holders:
            known.holders.append(holder)
        return known

    def get(self, blob_id: bytes) -> Offer | None:
        return self._offers.get(blob_id)

    def discard(self, blob_id: bytes) -> None:
        self._offers.pop(blob_id, None)

    def for_round(self, round_no: int, kind: str | None = None) -> list[Offer]:
        return [
            offer
            for offer in self._offers.values()
            if offer.round == round_no and (kind is None or offer.kind == kind)
        ]

    def forget_before(self, round_no: int) -> None:
        cutoff = round_no - self.keep_rounds
        self._offers = {i: o for i, o in self._offers.items() if o.round >= cutoff}
