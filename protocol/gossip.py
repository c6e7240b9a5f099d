"""What is on offer and what we hold: announced blobs and a bounded blob store."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from .identity import node_id
from .wire import Blob


@dataclass
class Offer:
    """An announced blob: who made it, for which round, and who can serve it."""

    origin: bytes
    round: int
    kind: str
    digest: bytes
    size: int
    holders: list[bytes] = field(default_factory=list)

    @property
    def origin_id(self) -> str:
        return node_id(self.origin)


class BlobStore:
    """Blobs by digest, oldest evicted first once `max_bytes` is passed.

    It holds blobs of any origin, so a node can serve what it fetched to others.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._blobs: OrderedDict[bytes, Blob] = OrderedDict()

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._blobs

    def get(self, digest: bytes) -> Blob | None:
        blob = self._blobs.get(digest)
        if blob is not None:
            self._blobs.move_to_end(digest)
        return blob

    def put(self, blob: Blob) -> None:
        if blob.digest in self._blobs:
            return
        self._blobs[blob.digest] = blob
        self.bytes += blob.size
        while self.bytes > self.max_bytes and len(self._blobs) > 1:
            _, evicted = self._blobs.popitem(last=False)
            self.bytes -= evicted.size


class OfferBook:
    """Announced blobs by digest; old rounds are forgotten to bound memory."""

    def __init__(self, keep_rounds: int = 4) -> None:
        self.keep_rounds = keep_rounds
        self._offers: dict[bytes, Offer] = {}

    def add(self, offer: Offer, holder: bytes) -> Offer:
        known = self._offers.setdefault(offer.digest, offer)
        if holder not in known.holders:
            known.holders.append(holder)
        return known

    def for_round(self, round_no: int, kind: str | None = None) -> list[Offer]:
        return [
            offer for offer in self._offers.values()
            if offer.round == round_no and (kind is None or offer.kind == kind)
        ]

    def forget_before(self, round_no: int) -> None:
        cutoff = round_no - self.keep_rounds
        self._offers = {d: o for d, o in self._offers.items() if o.round >= cutoff}
