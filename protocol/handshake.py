"""A node's handshake: the hellos it sends and answers, the peer lists that answer them,
whom it greeted and awaits an answer from, the contacts it started with, and the CURVE
key it dials each address with (WIRE.md 7.1).

Only the answer to a hello of ours may tell this node peers, and it must come from the
node we dialled: the key an address is dialled with is learned from that address's own
node where it can be, and a third party's word never replaces it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .identity import BadPublicKey, curve_public_key, node_id
from .parts import Host
from .transport import split_contact
from .wire import Message

log = logging.getLogger("meshfl.endpoint")

UNSOLICITED_PEERS = "unsolicited_peers"  # a peer list that answers no hello of ours
# Hellos of ours still waiting for their `peers` answer; the oldest are given up first.
MAX_HELLOS_OUT = 1024


@dataclass(frozen=True)
class _HelloOut:
    """A hello of ours awaiting its `peers` answer: only that may tell us peers."""

    wants_peers: bool
    sent: float  # monotonic


class Handshake:
    """The handshake of one endpoint (`endpoint`), with the keys and contacts it needs."""

    def __init__(self, endpoint: Host) -> None:
        self.endpoint = endpoint
        self.joined = threading.Event()  # a peer answered our hello, or we were refused
        self.refusal = ""  # why the mesh refused us (our key is live elsewhere)
        # Our hellos still unanswered, by address: whether each asked for a peer list.
        self.out: OrderedDict[str, _HelloOut] = OrderedDict()
        self.bootstrap: set[str] = set()  # the addresses we were told to dial at start
        self.contacts: dict[str, bytes | None] = {}  # all we were given, with known keys
        # The CURVE key of the node at each address we may dial, learned with the Ed25519
        # key that address came with (bootstrap contact, hello, heartbeat, peer list).
        self.curve_keys: dict[str, bytes] = {}
        # Bootstrap addresses given without a key: greeted once some message names it.
        self.when_keyed: set[str] = set()
        # Contacts a bounded view greets before the others: the neighbours of long
        # standing a resumed node had (node/neighbours.py, anchors).
        self.anchors: list[str] = []

    def begin(self, bootstrap: Iterable[str], anchors: Iterable[str] = ()) -> list[str]:
        """Take the bootstrap contacts (KEY@ADDRESS, or a bare address where the mesh does
        not encrypt), and the `anchors` among them (or besides) to greet first; return
        the ones to greet now."""
        endpoint = self.endpoint
        anchors = list(anchors)
        keys: dict[str, bytes | None] = {}  # each address once, with its key where given
        for address, key in map(split_contact, [*bootstrap, *anchors]):
            if keys.get(address) is None:
                keys[address] = key
        own = (endpoint.settings.address, endpoint.address)
        self.contacts = {address: key for address, key in keys.items() if address not in own}
        self.anchors = [split_contact(anchor)[0] for anchor in anchors]
        targets = self.choose_contacts()
        endpoint.table.most_known = len(targets)
        if self.when_keyed:
            # Nodes started together learn each other's keys from the first hellos; a
            # bare address with no such node behind it shows as nobody answering.
            log.info(
                "%s: will greet %s once the key of each is known (from its own hello or a "
                "peer list)",
                endpoint.settings.name,
                ", ".join(sorted(self.when_keyed)),
            )
        return [address for address in targets if address not in self.when_keyed]

    def choose_contacts(self) -> list[str]:
        """Of the contacts, the ones to greet until they answer (all of them in a full
        mesh, as many as it wants neighbours in a bounded one), each dialled with its key
        where known; one whose key is still unknown in an encrypted mesh waits for it."""
        targets = self.endpoint.overlay.first_contacts(list(self.contacts))
        for address in targets:
            if (key := self.contacts[address]) is not None:
                self.learn(address, key)
            elif self.endpoint.settings.encrypt and address not in self.curve_keys:
                self.when_keyed.add(address)
        self.bootstrap = set(targets)
        return targets

    def learn(self, address: str, public_key: bytes, from_its_owner: bool = True) -> None:
        """Dial `address` with the CURVE key of `public_key` from now on. A third party's
        word (a peer list) does not replace what the address's own node said."""
        # Nor does anyone's word replace the key of an address we await an answer from:
        # the answer must come from the node we dialled.
        awaited = address in self.out and address in self.curve_keys
        if (from_its_owner and not awaited) or address not in self.curve_keys:
            curve_key = curve_key_of(public_key)
            if curve_key:
                self.curve_keys[address] = curve_key
        if address in self.when_keyed and address in self.curve_keys:
            # A bootstrap peer we could not dial: it dialled us first (or someone named
            # its key). Our hello now gets the `peers` answer that makes us joined.
            self.when_keyed.discard(address)
            self.say_hello(address)

    def say_hello(self, address: str, wants_peers: bool = True) -> None:
        """Greet `address`, and take its node's answer as a peer list (WIRE.md 7.1)."""
        endpoint = self.endpoint
        with endpoint.lock:
            self.out.pop(address, None)
            self.out[address] = _HelloOut(wants_peers, time.monotonic())
            while len(self.out) > MAX_HELLOS_OUT:
                self.give_up_on(next(iter(self.out)))
        body = self.hello_body(wants_peers)
        body.update(endpoint.overlay.card_fields())
        endpoint.send(address, "hello", body)

    def hello_body(self, wants_peers: bool = True) -> dict[str, Any]:
        """What a hello (or a heartbeat) says of this node."""
        endpoint = self.endpoint
        body: dict[str, Any] = {"name": endpoint.settings.name, "addr": endpoint.address}
        if endpoint.settings.about is not None:
            body["about"] = endpoint.settings.about
        if not wants_peers:
            body["list"] = False  # answer with yourself only: we know the mesh (WIRE.md 7.1)
        return body

    def awaits(self, address: str) -> bool:
        """Whether a hello of ours to `address` awaits its answer."""
        return address in self.out

    def again(self, now: float, grace: float) -> list[tuple[str, bool]]:
        """Our hellos unanswered for `grace`: a bootstrap contact is greeted again (a node
        refused for want of room, or started before its contacts, must get in), any other
        address given up, its connection closed (WIRE.md 7.1)."""
        again = []
        for address, hello in list(self.out.items()):
            if now - hello.sent < grace:
                continue
            if self.to_keep(address):
                again.append((address, hello.wants_peers))
            else:
                self.give_up_on(address)
        return again

    def give_up_on(self, address: str) -> None:
        self.out.pop(address, None)
        if not self.endpoint.table.at(address) and not self.to_keep(address):
            self.endpoint.release(address)

    def to_keep(self, address: str) -> bool:
        """Whether `address` is a contact we started with that is greeted until it answers
        (overlay.keeps_contacts)."""
        return address in self.bootstrap and self.endpoint.overlay.keeps_contacts()

    def answered(self, message: Message) -> bool | None:
        """Whether our hello that `message`, a peer list, answers asked for a list; None
        when it answers no hello of ours. It must come from the key whose CURVE twin we
        dialled that address with, or (unencrypted, a bare address) list itself there."""
        curve_key = curve_key_of(message.sender)
        own = [e["addr"] for e in message.body["peers"] if e["key"] == message.sender]
        answered = next(
            (address for address in self.out if self.curve_keys.get(address) == curve_key),
            next((a for a in self.out if a not in self.curve_keys and a in own), None),
        )
        return None if answered is None else self.out.pop(answered).wants_peers

    # --- messages ----------------------------------------------------------------------

    def on_hello(self, message: Message) -> None:
        """Take in the greeter and answer with a peer list, or turn it away (overlay)."""
        endpoint = self.endpoint
        name, address = message.body["name"], message.body["addr"]
        wants_peers = message.body.get("list", True) is not False
        if endpoint.table.get(message.sender) is None and (
            reason := endpoint.overlay.turns_away(name, address)
        ):
            self._turn_away(message.sender, address, reason)
            return
        if not endpoint.take_in(message, name, address):
            return
        endpoint.overlay.took_greeter(message, address)
        listed = self._listed(message.sender) if wants_peers else []
        endpoint.send(address, "peers", self._peers_body(listed))
        # Whoever says hello may have missed our announces: a late joiner, or a node
        # asking again once it took the mesh's round (refresh_offers).
        endpoint.blobs.announce_latest(address)

    def link_answering(self, message: Message, name: object, address: str) -> bool:
        """Take in the node that answered our hello, as `take_in` does. It announced
        its latest blobs to us; it hears ours now: a peer in our round waits for our
        blob of it, which we may have announced before it knew us, until it hears that
        we are past that round (a heartbeat period, or more) (WIRE.md 7.1)."""
        if not self.endpoint.take_in(message, name, address):
            return False
        self.endpoint.blobs.announce_latest(address)
        return True

    def _peers_body(self, listed: list[dict[str, Any]], linked: bool = True) -> dict[str, Any]:
        endpoint = self.endpoint
        settings, identity = endpoint.settings, endpoint.identity
        me = {"name": settings.name, "addr": endpoint.address, "key": identity.public_key}
        return {"peers": [me, *listed], **endpoint.overlay.card_fields(linked)}

    def _listed(self, greeter: bytes) -> list[dict[str, Any]]:
        """The peers a `peers` answer to `greeter` names (overlay.listed)."""
        endpoint = self.endpoint
        listed = endpoint.overlay.listed(endpoint.table.alive(), greeter)
        return [entry.describe() for entry in listed]

    def _turn_away(self, key: bytes, address: str, reason: str) -> None:
        """Answer the hello of a node this view cannot take (`reason`): with some
        neighbours to try instead, and `linked: false` (WIRE.md 7.7). The answer goes
        over a connection of its own, so nothing stays open to the greeter."""
        self.endpoint.flow_rejections[reason] += 1
        body = self._peers_body(self._listed(key), linked=False)
        self.endpoint.send(address, "peers", body, once=True, key=key)

    def on_peers(self, message: Message) -> None:
        """Take a peer list only in answer to our own hello (WIRE.md 7.1); what it makes
        of the list is the overlay's. Entries were checked by the decoder."""
        wanted_list = self.answered(message)
        if wanted_list is None:
            self.endpoint.flow_rejections[UNSOLICITED_PEERS] += 1
            return
        self.endpoint.overlay.on_peers(message, wanted_list)
        self.joined.set()

    def on_refuse(self, message: Message) -> None:
        if not self.joined.is_set():
            self.refusal = str(message.body["reason"])
            self.joined.set()

    def refuse_twin(self, message: Message) -> None:
        """Tell the node whose hello carries a key live here (ours or a peer's) that the
        mesh refuses it (WIRE.md 7.1)."""
        endpoint = self.endpoint
        address = message.body.get("addr")
        if message.kind == "hello" and isinstance(address, str):
            live = endpoint.table.get(message.sender)
            where = live.address if live else endpoint.address
            reason = f"key {node_id(message.sender)} is already live at {where}"
            endpoint.send(address, "refuse", {"reason": reason}, key=message.sender)

    def drop(self, address: str) -> None:
        """Forget our hello to `address` and the key it is dialled with."""
        self.curve_keys.pop(address, None)
        self.out.pop(address, None)


@functools.lru_cache(maxsize=4096)
def curve_key_of(public_key: bytes) -> bytes:
    """The CURVE key bound to an Ed25519 public key; empty for bytes that are none."""
    try:
        return curve_public_key(public_key)
    except BadPublicKey:
        return b""
