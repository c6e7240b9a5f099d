"""Bounded views: whom a node of a big mesh talks to, and whom it could (WIRE.md 7.7).

In a full mesh every node's peer table holds every other node. In a bounded mesh the
peer table holds only the node's *neighbours*, its active view: the peers it exchanges
announces, blobs and heartbeats with, so everything the table drives (liveness,
announces, the peers a round waits for) costs O(view), not O(N). Beside it the node
keeps a *passive view* of candidates, refreshed by shuffles with a random neighbour,
from which it replaces a neighbour that died, left or was dropped (HyParView, Leitão,
Pereira and Rodrigues 2007).

A candidate learned from a shuffle comes with its owner's signed *card* (name,
address, key), so a node can pass on only what each owner said about itself: a
stranger cannot fill other nodes' views with addresses it invented (an eclipse).
Candidates the node was configured with, or named in a peer list answering its own
hello, carry no card: the node dials them (only a node holding the key answers the
encrypted handshake) but never passes them on.
"""

from __future__ import annotations

import functools
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgpack

from .addresses import is_wire_endpoint, machine_of, network_group
from .identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, is_usable_public_key, verify
from .membership import PEER_NAME, PeerEntry

CARD_CONTEXT = b"meshfl/3 card\n"
# The most cards one shuffle (or its answer) may carry; more is refused whole.
MAX_CARDS = 32
# A node starts at least this many shuffles a round (once it knows how long one takes),
# so that the candidates it replaces neighbours from after each round are fresh.
SHUFFLES_PER_ROUND = 4
BAD_CARD = "bad_card"
UNSOLICITED_CARDS = "unsolicited_cards"


@dataclass(frozen=True)
class Limits:
    """How many places of a node's views one group of addresses (`group_by`, see
    addresses.GROUPINGS) may hold, and how many candidates one source's word may fill:
    identities cost nothing, addresses and networks do, so an operator of many keys
    on few machines gets no more places than a few honest nodes would (WIRE.md 7.7).
    A node's active view holds at most `neighbours` peers of one group, its passive view
    at most `candidates` of one group and `per_source` that one node told it of; where a
    group is a network, one machine of it (an IP address) holds at most half its
    group's places (at least one; an IPv6 machine is its /64): many identities on one
    machine earn no more than a machine's share. Its own group (`own`: its machine, or
    its network) is not limited, nor are addresses grouped by port (a mesh on one
    machine)."""

    group_by: str = "auto"
    neighbours: int = 2
    candidates: int = 4
    per_source: int = 8
    own: str = ""

    def group(self, address: str) -> str | None:
        """The group `address` counts against; None where it is not limited."""
        group = network_group(address, self.group_by)
        return None if group in (address, self.own) else group

    def crowded(self, address: str, held: Iterable[str], most: int) -> bool:
        """Whether the addresses `held` fill `address`'s group to `most` places, or its
        machine, where the group is wider, to half of them (at least one)."""
        group = self.group(address)
        if group is None:
            return False
        held = list(held)
        if sum(self.group(other) == group for other in held) >= most:
            return True
        if group == network_group(address, "ip"):
            return False  # grouped by IP: the group is one machine already
        machine = machine_of(address)
        return sum(machine_of(other) == machine for other in held) >= max(1, most // 2)

    def of_node_at(self, address: str) -> Limits:
        """These limits as the node listening at `address` applies them."""
        return replace(self, own=network_group(address, self.group_by))


@dataclass(frozen=True)
class ViewSettings:
    """The sizes of a bounded mesh's views. A node greets candidates while it has fewer
    than `neighbours` neighbours, and takes in peers that greet it up to `most`: the
    slack lets newcomers in and keeps views symmetric without forcing anyone out."""

    neighbours: int = 8
    most: int = 10
    passive: int = 32
    shuffle_interval: float = 2.0  # seconds between two shuffles a node starts
    shuffle_length: int = 8  # cards a shuffle carries, the sender's own included
    # Greet first the candidates a neighbour named as its own neighbours; off, candidates
    # are drawn at random (gossip learning's peer sampling).
    friends_first: bool = True
    limits: Limits = Limits()

    @classmethod
    def keeping(
        cls, neighbours: int, friends_first: bool = True, group_by: str = "auto"
    ) -> ViewSettings:
        """The views of a node keeping `neighbours` neighbours: it takes in two more
        before turning greeters away (room for newcomers; each greeter past its own
        choice is one more stranger in its view), and keeps four times as many
        candidates (at least 32). One group of addresses holds at most a quarter of
        the neighbours and an eighth of the candidates (at least 2 places of each), and
        one source's word fills at most a quarter of the candidates."""
        passive = max(32, 4 * neighbours)
        limits = Limits(group_by, max(2, neighbours // 4), max(2, passive // 8), passive // 4)
        return cls(neighbours, neighbours + 2, passive, friends_first=friends_first, limits=limits)

    def shuffle_period(self, stretch: float, round_length: float | None) -> float:
        """Seconds between two shuffles a node starts: `shuffle_interval` stretched as
        heartbeats are (a crowded process must not spend its CPU shuffling), but short
        enough for SHUFFLES_PER_ROUND a round of `round_length` seconds, and never
        shorter than `shuffle_interval`. A round, not a clock, is what neighbours are
        chosen by: stretched alone, a host of 50 nodes doing 7-second rounds shuffled
        less than once a round, and benefit-chosen views found their clusters slowly."""
        period = self.shuffle_interval * stretch
        if round_length is None:
            return period
        return min(period, max(self.shuffle_interval, round_length / SHUFFLES_PER_ROUND))

    @property
    def greeter_places(self) -> int:
        """The places of a view that nodes greeting it may hold where addresses are
        grouped: half of the most it takes."""
        return self.most // 2

    def connections(self) -> int:
        """The most peers a node holds connections to at once: its fullest view, plus
        a greeting and an unlink on their way."""
        return self.most + 2


@dataclass(frozen=True)
class Card:
    """What a node says about itself, signed by its key: how to reach it."""

    key: bytes
    name: str
    addr: str
    issued: int  # wall-clock nanoseconds when signed: of two cards the later one counts
    sig: bytes

    def packed(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "name": self.name,
            "addr": self.addr,
            "issued": self.issued,
            "sig": self.sig,
        }


def _signed_part(mesh_id: bytes, key: bytes, name: str, addr: str, issued: int) -> bytes:
    # The mesh id is signed too: a card stays in the mesh it was made for.
    return CARD_CONTEXT + msgpack.packb([mesh_id, key, name, addr, issued])


def make_card(identity: Identity, mesh_id: bytes, name: str, addr: str) -> Card:
    issued = time.time_ns()
    key = identity.public_key
    return Card(
        key, name, addr, issued, identity.sign(_signed_part(mesh_id, key, name, addr, issued))
    )


def card_shape_fault(value: Any) -> str | None:
    """What is wrong with a card's fields as they arrived, or None: checked at decoding,
    before any signature (WIRE.md 9). The signature is checked by `checked_card`."""
    if not isinstance(value, dict):
        return "a card is not a map"
    key, name, addr, issued, sig = (value.get(f) for f in ("key", "name", "addr", "issued", "sig"))
    if not (isinstance(key, bytes) and len(key) == PUBLIC_KEY_BYTES):
        return "card key"
    if not (isinstance(sig, bytes) and len(sig) == SIGNATURE_BYTES):
        return "card sig"
    if not (isinstance(issued, int) and not isinstance(issued, bool) and issued >= 0):
        return "card issued"
    if not (isinstance(name, str) and PEER_NAME.fullmatch(name)):
        return "card name"
    if not is_wire_endpoint(addr):
        return "card addr"
    if not is_usable_public_key(key):
        return "card key is weak"
    return None


def checked_card(value: dict[str, Any], mesh_id: bytes) -> Card | None:
    """The card, if its owner signed it for this mesh; None otherwise. `value` passed
    `card_shape_fault` when its message was decoded."""
    card = Card(value["key"], value["name"], value["addr"], value["issued"], value["sig"])
    return card if _signed_by_owner(card, mesh_id) else None


@functools.lru_cache(maxsize=4096)
def _signed_by_owner(card: Card, mesh_id: bytes) -> bool:
    """A card goes round the mesh and comes back: each is checked once in a process,
    whose nodes (a host's) all hear it."""
    signed = _signed_part(mesh_id, card.key, card.name, card.addr, card.issued)
    return verify(card.key, card.sig, signed)


@dataclass(frozen=True)
class Candidate:
    """A node this one could greet: its key, where it listens, its card if it has one,
    its name where something named it (a contact given at start is nameless), the
    neighbour that named it as one of its own neighbours (`via`), if one did, and the
    node whose message told of it (`source`; none for a contact given at start)."""

    key: bytes
    addr: str
    card: Card | None = None
    name: str = ""
    via: bytes = b""
    source: bytes = b""


class PassiveView:
    """At most `size` candidates, one per key, and within `limits` (per group of
    addresses and per source): a newcomer past them is refused, and those already held
    keep their places. When full, a newcomer takes the place of an entry this node just
    sent away in a shuffle (it lives on at the partner's), else of a random one, so the
    view keeps turning over (HyParView); the limits count the view as it would be after
    that swap."""

    def __init__(self, size: int, rng: random.Random, limits: Limits = Limits()) -> None:
        self.size = size
        self.rng = rng
        self.limits = limits
        self.entries: dict[bytes, Candidate] = {}
        self.refused = 0  # newcomers past the limits, for the node's counts

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def add(self, candidate: Candidate, sent_away: Collection[bytes] = ()) -> bool:
        """Keep `candidate` (a card replaces an older or missing one); False when refused."""
        known = self.entries.get(candidate.key)
        if known is not None:
            newer = candidate.card is not None and (
                known.card is None or candidate.card.issued > known.card.issued
            )
            moving = newer and candidate.addr != known.addr
            if moving and self._crowded(candidate, besides=candidate.key):
                self.refused += 1
                return False  # not into a group, or from a source, with no place left
            card = candidate.card if newer else known.card
            via = candidate.via or known.via  # the latest word of a neighbour counts
            self.entries[candidate.key] = replace(candidate if newer else known, card=card, via=via)
            return True
        if self.size <= 0:
            return False
        leaving = self._leaving(sent_away) if len(self.entries) >= self.size else None
        if self._crowded(candidate, besides=leaving or b""):  # counted after the swap
            self.refused += 1
            return False
        if leaving is not None:
            del self.entries[leaving]
        self.entries[candidate.key] = candidate
        return True

    def _leaving(self, sent_away: Collection[bytes]) -> bytes:
        """The entry a newcomer takes the place of in a full view: one this node just sent
        away in a shuffle, else a random one."""
        away = [key for key in sent_away if key in self.entries]
        return away[0] if away else self.rng.choice(list(self.entries))

    def _crowded(self, candidate: Candidate, besides: bytes = b"") -> bool:
        """Whether `candidate`'s group, or its source, holds all the places it may (not
        counting the entry of key `besides`)."""
        if self.limits.group(candidate.addr) is None:
            return False
        held = [entry for key, entry in self.entries.items() if key != besides]
        if self.limits.crowded(candidate.addr, (e.addr for e in held), self.limits.candidates):
            return True
        told = sum(entry.source == candidate.source for entry in held)
        return bool(candidate.source) and told >= self.limits.per_source

    def discard(self, key: bytes) -> Candidate | None:
        return self.entries.pop(key, None)

    def take(
        self,
        count: int,
        exclude: Collection[bytes],
        friends: Collection[bytes] = (),
        linked: Iterable[str] = (),
    ) -> list[Candidate]:
        """Up to `count` random candidates not in `exclude`, removed from the view: first
        those a neighbour in `friends` named as its own neighbours (whom a node's chosen
        neighbours chose are likelier to help it too), then any; none of a group (or a
        machine) that the addresses `linked` to already (the neighbours' and those
        greeted) and the ones chosen before it fill (`Limits.crowded`)."""
        free = [key for key in self.entries if key not in exclude]
        vouched = [key for key in free if self.entries[key].via in friends]
        rest = [key for key in free if self.entries[key].via not in friends]
        held = list(linked)
        chosen: list[bytes] = []
        for key in self.rng.sample(vouched, len(vouched)) + self.rng.sample(rest, len(rest)):
            address = self.entries[key].addr
            if len(chosen) < count and not self.limits.crowded(
                address, held, self.limits.neighbours
            ):
                held.append(address)
                chosen.append(key)
        return [self.entries.pop(key) for key in chosen]

    def cards(self, count: int, exclude: Collection[bytes] = ()) -> list[Card]:
        """Up to `count` random cards of candidates not in `exclude`."""
        carded = [e.card for e in self.entries.values() if e.card and e.key not in exclude]
        return self.rng.sample(carded, min(count, len(carded)))


def cards_to_send(
    own: Card | None,
    members: Iterable[Card],
    passive: PassiveView,
    length: int,
    rng: random.Random,
    exclude: Collection[bytes] = (),
) -> tuple[list[Card], int]:
    """A shuffle's cards (or its answer's, `own` None): the sender's own, then up to half
    the rest of its neighbours' and candidates' at random, none of `exclude`; and how many
    neighbours' follow the sender's own."""
    head = [own] if own is not None else []
    room = length - len(head)
    members = [card for card in members if card.key not in exclude]
    from_members = rng.sample(members, min(len(members), room // 2))
    taken = {card.key for card in from_members}
    others = passive.cards(room - len(from_members), exclude=taken | set(exclude))
    return [*head, *from_members, *others], len(from_members)


class Shuffles:
    """A bounded view's shuffles (WIRE.md 7.7): the node's own card and its neighbours'
    own cards, which it passes on; when its next shuffle is due, paced by its rounds;
    the shuffles it awaits answers to; and the cards that come back, kept as candidates
    in the passive view unless `is_peer` (their key is a peer already). Refusals are
    counted in `rejections` (the endpoint's)."""

    def __init__(
        self,
        card: Card,
        mesh_id: bytes,
        settings: ViewSettings,
        passive: PassiveView,
        *,
        rng: random.Random,
        is_peer: Callable[[bytes], bool],
        rejections: Counter[str],
    ) -> None:
        self.card = card
        self.mesh_id = mesh_id
        self.settings = settings
        self.passive = passive
        self._rng = rng
        self._is_peer = is_peer
        self._rejections = rejections
        self._neighbours: dict[bytes, Card] = {}  # neighbours' own cards
        # Shuffles of ours awaiting an answer: partner -> the keys of the cards we sent.
        self._awaited: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()
        self._next_due = 0.0  # when the next shuffle of ours is due (monotonic)
        self._to_helper = False  # whether the last one went to a neighbour vouched for
        # When the current round began, and how long the last one took.
        self._round_began: float | None = None
        self._round_length: float | None = None

    def pace(self, old_round: int, new_round: int, now: float) -> None:
        """The node goes from `old_round` to `new_round` at `now`: the rounds set the
        pace of shuffles (`ViewSettings.shuffle_period`)."""
        if new_round == old_round + 1 and self._round_began is not None:
            self._round_length = now - self._round_began  # a skip ahead is no round's length
        if new_round != old_round:
            self._round_began = now

    def card_of(self, key: bytes, value: object, address: str) -> Card | None:
        """`value`, a card that came with a message of `key`, if it is that node's own
        for `address` and signed by it; None otherwise (counted, where there was one)."""
        if not isinstance(value, dict):
            return None
        card = checked_card(value, self.mesh_id)
        if card is None or card.key != key or card.addr != address:
            self._rejections[BAD_CARD] += 1
            return None
        return card

    def keep(self, key: bytes, value: object, address: str) -> None:
        """Keep a neighbour's own card, to pass on in shuffles."""
        card = self.card_of(key, value, address)
        if card is None:
            return
        known = self._neighbours.get(key)
        if known is None or card.issued >= known.issued:
            self._neighbours[key] = card

    def forget(self, key: bytes) -> None:
        """A neighbour no longer: its card is not passed on as a neighbour's."""
        self._neighbours.pop(key, None)

    def due(
        self,
        now: float,
        partners: Sequence[PeerEntry],
        stretch: float,
        vouched: Collection[bytes] = (),
    ) -> tuple[str, str, dict[str, Any]] | None:
        """The shuffle to send (address, kind, body), when one is due: to a random one of
        the reached neighbours `partners` (every other time, where there are any, one of
        those `vouched` for: the neighbours that helped the node, whose answer names
        their own neighbours), with our card and some of our neighbours' and
        candidates'. `stretch`: how much the node stretches its liveness waits
        (`PeerTable.stretch`), and its shuffles with them."""
        if now < self._next_due or not partners:
            return None
        self._next_due = now + self.settings.shuffle_period(stretch, self._round_length)
        helpers = [entry for entry in partners if entry.public_key in vouched]
        self._to_helper = bool(helpers) and not self._to_helper
        partner = self._rng.choice(helpers if self._to_helper else list(partners))
        members = [card for key, card in self._neighbours.items() if key != partner.public_key]
        cards, linked = cards_to_send(
            self.card, members, self.passive, self.settings.shuffle_length, self._rng
        )
        self._awaited.pop(partner.public_key, None)
        self._awaited[partner.public_key] = tuple(card.key for card in cards)
        while len(self._awaited) > self.settings.most:
            self._awaited.popitem(last=False)
        body = {"cards": [card.packed() for card in cards], "neighbours": linked}
        return partner.address, "shuffle", body

    def take_shuffle(self, sender: bytes, body: dict[str, Any]) -> dict[str, Any] | None:
        """A neighbour's shuffle: the cards it carried kept as candidates (those of its
        own neighbours as named by it), and the body of our answer, as many cards of our
        neighbours and candidates; None when a card is forged."""
        cards = self._checked(body)
        if cards is None:
            return None
        exclude = {card.key for card in cards} | {sender}
        answer, named = cards_to_send(
            None, self._neighbours.values(), self.passive, len(cards), self._rng, exclude
        )
        self._take(cards, [card.key for card in answer], sender, _named(cards[1:], body))
        return {"cards": [card.packed() for card in answer], "neighbours": named}

    def take_reply(self, sender: bytes, body: dict[str, Any]) -> None:
        """The answer to a shuffle of ours: its cards kept as candidates, in the place of
        those we sent away. An answer to no shuffle of ours is refused (counted)."""
        sent = self._awaited.pop(sender, None)
        if sent is None:
            self._rejections[UNSOLICITED_CARDS] += 1
            return
        cards = self._checked(body)
        if cards is not None:
            self._take(cards, sent, sender, _named(cards, body))

    def _checked(self, body: dict[str, Any]) -> list[Card] | None:
        """The cards of a message's `body` if every one is signed by its owner; else None
        (counted): one forged card, and nothing the message says is believed."""
        cards = [checked_card(value, self.mesh_id) for value in body["cards"]]
        if any(card is None for card in cards):
            self._rejections[BAD_CARD] += 1
            return None
        return [card for card in cards if card is not None]

    def _take(
        self,
        cards: list[Card],
        sent_away: Sequence[bytes],
        sender: bytes,
        vouched: Collection[bytes] = (),
    ) -> None:
        """Keep the cards the `sender` passed on, of nodes that are not peers yet, as
        candidates it told of; those of its own neighbours (`vouched`) as named by it."""
        for card in cards:
            if card.key != self.card.key and not self._is_peer(card.key):
                via = sender if card.key in vouched else b""
                candidate = Candidate(card.key, card.addr, card, card.name, via, source=sender)
                self.passive.add(candidate, sent_away)


def _named(cards: Sequence[Card], body: dict[str, Any]) -> set[bytes]:
    """The keys of the `cards` (those after a shuffle's own) that the `body`'s
    `neighbours` count says are the sender's neighbours: the first ones."""
    return {card.key for card in cards[: body.get("neighbours", 0)]}
