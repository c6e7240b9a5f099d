"""Whom a node links with: every member of the mesh, or a bounded view of it.

The endpoint leaves to its overlay everything that differs between the two: whom it
greets first and keeps greeting, whom it takes in or turns away, what its hellos and
peer lists carry, and what it makes of a peer list, a stranger's heartbeat, an unlink or
a shuffle. `FullMesh` makes every node a peer of every other (WIRE.md 7.1); `BoundedView`
keeps a few neighbours, and candidates for their places that shuffles refresh (7.7).
Both are called on the endpoint's worker thread or with its lock held.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Collection, Mapping
from typing import Any

from .addresses import machine_of
from .membership import LEFT, PeerEntry
from .parts import Greeting, Host
from .views import (
    UNSOLICITED_CARDS,
    Candidate,
    PassiveView,
    Shuffles,
    ViewSettings,
    make_card,
)
from .wire import Message

# Refusals an overlay counts beside the decoder's (WIRE.md 7.7): a greeting while the node
# has all the neighbours it takes, a shuffle from a node that is not a neighbour, a
# bounded view holding all the peers one network group may (views.py counts the rest).
VIEW_FULL, NOT_LINKED = "view_full", "not_linked"
GROUP_FULL = "group_full"
# A greeting from the machine of a neighbour the node dropped a few rounds ago.
MACHINE_DROPPED = "machine_dropped"
# A greeting from a grouped address while greeters hold all the places they may.
GREETERS_FULL = "greeters_full"

# A node keeps out the machine of a neighbour it dropped for the rest of the round of the
# drop and this many rounds after it, twice as many after a second drop of one of its
# identities, four times after a third, and so on: the machine's greeters are turned away
# and its candidates not greeted. Identities cost nothing, so without it a machine's
# dropped identity would give its place to the next one at once, and the machines of
# many identities would take turns (docs/defences.md, "Many identities on few
# machines"); an honest machine is mostly one node, out of one node's reach for a few
# rounds. Ungrouped addresses (a mesh on one machine, a LAN under `auto`) are never
# kept out.
DROPPED_MACHINE_ROUNDS = 3
MOST_DOUBLINGS = 8  # past this many, a machine's keep-out grows no longer


class Overlay:
    """What the endpoint asks of its topology; see the module's docstring. Where a method
    has a body here, it is what a full mesh does."""

    views: ViewSettings | None  # None for a full mesh
    passive: PassiveView  # candidates for a neighbour's place (none in a full mesh)

    def __init__(self, endpoint: Host) -> None:
        self.endpoint = endpoint

    def first_contacts(self, targets: list[str]) -> list[str]:
        """Of the contacts the node was given, those it greets at its start."""
        raise NotImplementedError

    def keeps_contacts(self) -> bool:
        """Whether a contact the node started with is greeted again until it answers."""
        raise NotImplementedError

    def expected_peers(self, others: int) -> int:
        """How many live peers a node can expect where `others` nodes besides it run."""
        raise NotImplementedError

    def unlink(self, entries: list[PeerEntry]) -> None:
        """Drop the peers `entries` at the node's wish (a full mesh drops nobody)."""

    def fill(self) -> None:
        """Greet now whoever takes the places a peer left (a full mesh has no places)."""

    def greetable(self) -> int:
        """How many candidates could take a free place now (a full mesh has none)."""
        return 0

    def dropped_machines(self, in_round: int) -> dict[str, int]:
        """The machines still kept out in round `in_round` (DROPPED_MACHINE_ROUNDS), each
        with the round its keep-out counts from: what a checkpoint keeps (a full mesh
        keeps none out)."""
        return {}

    def keep_out(self, machines: Mapping[str, int]) -> None:
        """Keep out the `machines` a checkpoint kept (as `dropped_machines` gave them)."""

    def may_wait(self) -> bool:
        """Whether waiting for more live peers may still be answered."""
        return True

    def card_fields(self, linked: bool | None = None) -> dict[str, Any]:
        """What a hello (`linked` None) or a peer list adds to its body."""
        return {}

    def note_unheard(self) -> None:
        """The transport found nobody at some address we dialled."""

    def on_down(self, entry: PeerEntry) -> None:
        """The peer `entry` was just marked down."""

    def beat(self, now: float, again: list[Greeting]) -> tuple[list[Greeting], tuple | None]:
        """At a heartbeat tick: the greetings to send (`again`, the hellos to repeat, and
        more), and a shuffle to send, if one is due (a `_send` argument tuple)."""
        return again, None

    def refusal(self, name: str, address: str) -> str | None:
        """Why a new peer may not enter at `address`, or None."""
        return None

    def turns_away(self, name: str, address: str) -> str | None:
        """Why the hello of a new peer at `address` is answered with other nodes to try
        instead of a link, or None."""
        return None

    def took_greeter(self, message: Message, address: str) -> None:
        """The node at `address` that said hello (`message`) is now a peer."""

    def listed(self, alive: list[PeerEntry], greeter: bytes) -> list[PeerEntry]:
        """Which of the live peers `alive` a peer list to `greeter` names."""
        return alive

    def on_peers(self, message: Message, wanted_list: bool) -> None:
        """The peer list `message` answers our hello (which asked for one: `wanted_list`)."""
        raise NotImplementedError

    def on_stranger_heartbeat(self, message: Message, name: object, address: str) -> None:
        """A heartbeat from a node that is not a peer, at `address`."""
        raise NotImplementedError

    def on_unlink(self, message: Message) -> None:
        """A peer dropped us."""

    def on_shuffle(self, message: Message) -> None:
        self.endpoint.flow_rejections[NOT_LINKED] += 1

    def on_shuffle_reply(self, message: Message) -> None:
        self.endpoint.flow_rejections[UNSOLICITED_CARDS] += 1

    def pace(self, old_round: int, new_round: int) -> None:
        """The node moved from round `old_round` to `new_round`."""

    def vouch(self, public_keys: Collection[bytes]) -> None:
        """The neighbours that helped the node: whom they named is greeted first."""


class FullMesh(Overlay):
    """Every node a peer of every other: a node greets all it is told of (WIRE.md 7.1)."""

    views = None

    def __init__(self, endpoint: Host) -> None:
        super().__init__(endpoint)
        self.passive = PassiveView(0, random.Random(endpoint.instance))

    def first_contacts(self, targets: list[str]) -> list[str]:
        return targets

    def keeps_contacts(self) -> bool:
        return True  # its members are its peer list

    def expected_peers(self, others: int) -> int:
        return others

    def on_peers(self, message: Message, wanted_list: bool) -> None:
        """Take in the node that answered, and greet at most `max_peers` of the others the
        list names: nobody can aim this node at addresses of their choosing (7.1)."""
        endpoint = self.endpoint
        introduced = 0
        for item in message.body["peers"]:
            key, name, address = item["key"], item["name"], item["addr"]
            if key == message.sender:
                endpoint.handshake.link_answering(message, name, address)
            elif not wanted_list or key == endpoint.identity.public_key:
                continue  # a list we did not ask for, or ourselves
            elif endpoint.table.get(key) is None and not endpoint.handshake.awaits(address):
                # No more than the table can take: a list comes only from a node we
                # greeted, yet it must not make us dial without end.
                limit = endpoint.settings.max_peers
                if introduced == limit or endpoint.admission.name_refused(key, name):
                    continue
                introduced += 1
                endpoint.handshake.learn(address, key, from_its_owner=False)
                endpoint.handshake.say_hello(address, wants_peers=False)

    def on_stranger_heartbeat(self, message: Message, name: object, address: str) -> None:
        self.endpoint.take_in(message, name, address)  # a full mesh learns members so (7.1)


class BoundedView(Overlay):
    """A few neighbours, links made by hello alone, and a passive view of candidates for
    their places, refreshed by shuffles with the neighbours (WIRE.md 7.7)."""

    views: ViewSettings

    def __init__(self, endpoint: Host, views: ViewSettings) -> None:
        super().__init__(endpoint)
        self.views = views
        self.rng = random.Random(endpoint.instance)
        address = endpoint.address
        self.passive = PassiveView(views.passive, self.rng, views.limits.of_node_at(address))
        self.shuffles = Shuffles(
            make_card(endpoint.identity, endpoint.mesh_id, endpoint.settings.name, address),
            endpoint.mesh_id,
            views,
            self.passive,
            rng=self.rng,
            is_peer=endpoint.is_peer,
            rejections=endpoint.flow_rejections,
        )
        self._unheard_seen = 0  # transport.unheard_count when we last looked
        self._round = 0
        # The machines of neighbours dropped in this round or the DROPPED_MACHINE_ROUNDS
        # before it, each with the round its keep-out counts from (`_keep_out_dropped`);
        # `pace` forgets older ones.
        self._dropped_machines: dict[str, int] = {}
        self._machine_drops: Counter[str] = Counter()  # drops of each machine's identities
        self._vouched: set[bytes] = set()  # neighbours that helped the node (`vouch`)

    # --- joining and keeping the view full -------------------------------------------

    def first_contacts(self, targets: list[str]) -> list[str]:
        """As many of the contacts as the node wants neighbours, its anchors first; the
        others, with their keys where known, become candidates."""
        contacts = list(targets)
        self.rng.shuffle(contacts)
        anchors = self.endpoint.handshake.anchors
        contacts.sort(key=lambda address: address not in anchors)  # stable: the rest shuffled
        first, rest = contacts[: self.views.neighbours], contacts[self.views.neighbours :]
        keys = self.endpoint.handshake.contacts
        for address in rest:
            key = keys.get(address)
            if key is not None:
                self.passive.add(Candidate(key, address))
        return first

    def keeps_contacts(self) -> bool:
        """Only while the node has no neighbour. Once in, a contact is a candidate like
        any other: one that died must not hold a place of the view for good, greeted
        again every grace (a contact of a fifth of the nodes killed at once did, for the
        rest of the run)."""
        return not self.has_neighbour()

    def expected_peers(self, others: int) -> int:
        return min(others, self.views.neighbours)

    def has_neighbour(self) -> bool:
        """Whether the view holds a live neighbour that answered at its address (a
        stranger's hello alone does not make one)."""
        return any(entry.reached for entry in self.endpoint.table.alive())

    def unlink(self, entries: list[PeerEntry]) -> None:
        """Each neighbour is told (`unlink`) and its machine kept out (where its address
        is grouped), and other candidates are greeted in their places."""
        for entry in entries:
            if self.passive.limits.group(entry.address) is not None:
                self._keep_out_dropped(machine_of(entry.address))
        for entry in entries:
            self.endpoint.send(entry.address, "unlink", {})
            self.forget_neighbour(entry, drain=True)
            self.passive.discard(entry.public_key)  # not a candidate greeted in its place
        self.fill()  # now, not at the next tick: the next round may wait for it

    def _keep_out_dropped(self, machine: str) -> None:
        """Keep out `machine`, one of whose identities the node dropped now, for
        DROPPED_MACHINE_ROUNDS, doubled for each of its drops before: noted as the round
        the keep-out counts from, which a checkpoint keeps as it is."""
        self._machine_drops[machine] += 1
        longer = 2 ** min(self._machine_drops[machine] - 1, MOST_DOUBLINGS) - 1
        self._dropped_machines[machine] = self._round + longer * DROPPED_MACHINE_ROUNDS

    def dropped_machines(self, in_round: int) -> dict[str, int]:
        since = in_round - DROPPED_MACHINE_ROUNDS
        return {machine: r for machine, r in self._dropped_machines.items() if r >= since}

    def keep_out(self, machines: Mapping[str, int]) -> None:
        self._dropped_machines.update(machines)

    def greetable(self) -> int:
        """The candidates on machines the node does not keep out."""
        return len(self.passive) - len(self._kept_out_candidates())

    def _kept_out_candidates(self) -> set[bytes]:
        if not self._dropped_machines:  # a local mesh's always: its addresses are ungrouped
            return set()
        return {key for key, entry in self.passive.entries.items() if self.keeps_out(entry.addr)}

    def may_wait(self) -> bool:
        """Only while a candidate greeted for a place the view lacks has yet to answer:
        when the mesh has no one more to give, waiting would only make the round late."""
        return self.greeting() > 0

    def fill(self) -> None:
        """Greet now the candidates the view lacks (`_candidates_to_greet`)."""
        for address, wants_peers in self._candidates_to_greet():
            self.endpoint.handshake.say_hello(address, wants_peers)

    def _candidates_to_greet(self) -> list[Greeting]:
        """As many candidates as the view lacks neighbours, less the ones greeted already
        and not answered yet."""
        endpoint = self.endpoint
        if endpoint.finished:
            return []
        short = self.views.neighbours - self.links() - self.greeting()
        if short <= 0:
            return []
        for candidate in list(self.passive.entries.values()):
            if candidate.name and endpoint.shuns(candidate.name):
                self.passive.discard(candidate.key)  # the node wants no link with it
        table = endpoint.table
        exclude = set(table.entries) | {endpoint.identity.public_key}
        exclude |= self._kept_out_candidates()
        friends = self._friends() if self.views.friends_first else ()
        greeted = [address for address in endpoint.handshake.out if not table.at(address)]
        chosen = self.passive.take(short, exclude, friends, self.linked_addresses() + greeted)
        for candidate in chosen:
            endpoint.handshake.learn(candidate.addr, candidate.key, from_its_owner=False)
        return [(candidate.addr, False) for candidate in chosen]

    def vouch(self, public_keys: Collection[bytes]) -> None:
        if self.views.friends_first:  # else candidates and partners are drawn at random
            self._vouched = set(public_keys)

    def _friends(self) -> Collection[bytes]:
        """The neighbours whose own neighbours are greeted first: those that helped the
        node (whom a helpful neighbour chose is likelier to help it too than whom any
        neighbour chose), or all of them before it vouched for any."""
        neighbours = self.endpoint.table.entries.keys()
        return (self._vouched & neighbours) or neighbours

    def greeting(self, besides: str | None = None) -> int:
        """How many nodes our hellos await that are not peers yet (but the one at
        `besides`)."""
        table = self.endpoint.table
        out = self.endpoint.handshake.out
        return sum(not table.at(address) for address in out if address != besides)

    def _rejoin(self) -> list[Greeting]:
        """Greetings for a node left with no neighbour, no candidate it may greet and no
        greeting (every node it knew died or left, or its candidates are kept out): its
        contacts, chosen and greeted again as at its start (7.1) until one answers; a
        contact that was not up when the node joined may be now."""
        endpoint = self.endpoint
        if endpoint.finished or self.greeting() or self.greetable() or self.has_neighbour():
            return []
        handshake = endpoint.handshake
        chosen = handshake.choose_contacts()
        return [(address, True) for address in chosen if address not in handshake.when_keyed]

    def note_unheard(self) -> None:
        transport = self.endpoint.transport
        if transport.unheard_count == self._unheard_seen:
            return
        with self.endpoint.lock:
            if self._give_up_on_unheard():
                self.fill()

    def _give_up_on_unheard(self) -> bool:
        """Give up at once the candidates we greeted where nobody listens (the connection
        was refused); whether any was, for others to be greeted in their place. A dead
        candidate must not hold a place of the view until the handshake grace runs out
        (20 s in a host of 10 nodes, 200 s in one of 200). Bootstrap contacts are greeted
        again while we have no neighbour (`keeps_contacts`)."""
        endpoint, handshake = self.endpoint, self.endpoint.handshake
        self._unheard_seen = endpoint.transport.unheard_count
        unheard = [
            address
            for address in list(endpoint.transport.unheard)
            if address in handshake.out
            and not handshake.to_keep(address)
            and not endpoint.table.at(address)
        ]
        for address in unheard:
            handshake.give_up_on(address)
        return bool(unheard)

    def on_down(self, entry: PeerEntry) -> None:
        self.forget_neighbour(entry)  # replaced from the passive view

    def beat(self, now: float, again: list[Greeting]) -> tuple[list[Greeting], tuple | None]:
        self._give_up_on_unheard()  # a contact refused before we had a neighbour
        again = again + self._candidates_to_greet()
        again = again or self._rejoin()
        table = self.endpoint.table
        partners = [entry for entry in table.alive() if entry.reached]
        return again, self.shuffles.due(now, partners, table.stretch(), self._vouched)

    def forget_neighbour(self, entry: PeerEntry, drain: bool = False) -> None:
        """A neighbour no longer: forgotten, its card not passed on."""
        self.shuffles.forget(entry.public_key)
        self.endpoint.forget(entry, drain)

    def pace(self, old_round: int, new_round: int) -> None:
        self.shuffles.pace(old_round, new_round, time.monotonic())
        self._round = new_round
        self._dropped_machines = self.dropped_machines(new_round)

    def keeps_out(self, address: str) -> bool:
        """Whether the node dropped a neighbour on `address`'s machine in this round or
        the DROPPED_MACHINE_ROUNDS before it (an ungrouped address never)."""
        if self.passive.limits.group(address) is None:
            return False
        return machine_of(address) in self._dropped_machines

    # --- who may link ------------------------------------------------------------------

    def links(self) -> int:
        """The view's neighbours: peers not yet reached count, left ones do not."""
        return sum(entry.state != LEFT for entry in self.endpoint.table.entries.values())

    def is_full(self, greeter: str | None = None) -> bool:
        """Whether the view has as many neighbours as it takes. For the hello of a
        `greeter` at that address, the places our own hellos await count as taken, less
        the greeter's own: greeters must not fill a view that is greeting, or it would
        hold more connections than places."""
        held = self.links() + (self.greeting(besides=greeter) if greeter is not None else 0)
        return held >= self.views.most

    def linked_addresses(self) -> list[str]:
        """The addresses of the neighbours (those that left not counted)."""
        entries = self.endpoint.table.entries.values()
        return [entry.address for entry in entries if entry.state != LEFT]

    def group_is_full(self, address: str) -> bool:
        """Whether the view holds as many peers of `address`'s network group as one group
        may hold (views.Limits)."""
        limits = self.passive.limits
        return limits.crowded(address, self.linked_addresses(), limits.neighbours)

    def refusal(self, name: str, address: str) -> str | None:
        """No room, or none for a peer the node shuns, or for anyone once it is done."""
        if self.is_full() or self.endpoint.finished or self.endpoint.shuns(name):
            return VIEW_FULL
        return GROUP_FULL if self.group_is_full(address) else None

    def turns_away(self, name: str, address: str) -> str | None:
        """As `refusal`, and a greeter on a grouped address while greeters hold all
        the places they may, or on a machine the node keeps out (a node it greeted
        itself, an anchor say, is not refused so)."""
        if self.is_full(address) or self.endpoint.shuns(name):
            return VIEW_FULL
        if self.group_is_full(address):
            return GROUP_FULL
        if self.greeters_full(address):
            return GREETERS_FULL
        return MACHINE_DROPPED if self.keeps_out(address) else None

    def greeters_full(self, address: str) -> bool:
        """Whether greeters on grouped addresses hold all the places they may: the rest
        of the view is the node's own choice, which identities that greet everyone
        cannot take (WIRE.md 7.7)."""
        if self.passive.limits.group(address) is None:
            return False
        entries = self.endpoint.table.entries.values()
        greeters = sum(entry.greeted and entry.state != LEFT for entry in entries)
        return greeters >= self.views.greeter_places

    def took_greeter(self, message: Message, address: str) -> None:
        self.shuffles.keep(message.sender, message.body.get("card"), address)
        entry = self.endpoint.table.get(message.sender)
        if entry is not None and self.passive.limits.group(address) is not None:
            entry.greeted = True

    def card_fields(self, linked: bool | None = None) -> dict[str, Any]:
        fields: dict[str, Any] = {"card": self.shuffles.card.packed()}
        if linked is not None:
            fields["linked"] = linked
        return fields

    def listed(self, alive: list[PeerEntry], greeter: bytes) -> list[PeerEntry]:
        """At most a shuffle's worth of neighbours, the greeter included."""
        others = [entry for entry in alive if entry.public_key != greeter]
        picked = self.rng.sample(others, min(len(others), self.views.shuffle_length - 1))
        return [entry for entry in alive if entry.public_key == greeter] + picked

    # --- messages ----------------------------------------------------------------------

    def on_peers(self, message: Message, wanted_list: bool) -> None:
        """Every peer the answer names becomes a candidate, and the sender our neighbour
        if it took us (WIRE.md 7.7)."""
        endpoint = self.endpoint
        own = endpoint.identity.public_key
        answering = None
        for item in message.body["peers"]:
            key, name, address = item["key"], item["name"], item["addr"]
            if key == message.sender:
                answering = item
            elif key != own and endpoint.table.get(key) is None:
                # The answering node's neighbours, as it named them.
                sender = message.sender
                self.passive.add(Candidate(key, address, name=name, via=sender, source=sender))
        if answering is not None:
            self._answered_by(message, answering["name"], answering["addr"])

    def _answered_by(self, message: Message, name: str, address: str) -> None:
        """The node that answered our hello, at `address`: our neighbour if it took us
        (`linked`), else a candidate for later."""
        endpoint = self.endpoint
        key = message.sender
        if message.body.get("linked", True):
            if endpoint.handshake.link_answering(message, name, address):
                self.shuffles.keep(key, message.body.get("card"), address)
                return
            # It linked us, but we cannot take it (no room left, none for its network
            # group, or a node we shun by name, known before by address alone): it must
            # hear so.
            endpoint.send(address, "unlink", {}, once=True, key=key)
            if not endpoint.table.at(address):
                # The connection our hello opened, once the unlink is out over it.
                endpoint.release(address, drain=True)
            if not endpoint.shuns(name):
                self.passive.add(Candidate(key, address, name=name))
        elif endpoint.table.get(key) is None:
            endpoint.release(address)
            # Turned away: the candidates it named are greeted now, not a tick from now
            # (a mesh starting together fills its views in a few round trips); the node
            # that has no room for us becomes a candidate only after.
            self.fill()
            card = self.shuffles.card_of(key, message.body.get("card"), address)
            self.passive.add(Candidate(key, address, card, name))

    def on_stranger_heartbeat(self, message: Message, name: object, address: str) -> None:
        """A bounded view links by hello alone. This node takes us for its neighbour: our
        unlink crossed its heartbeat or was lost, or we took it for dead. It must hear
        that we are not, or it would wait on us every round (WIRE.md 7.7)."""
        endpoint = self.endpoint
        endpoint.flow_rejections[NOT_LINKED] += 1
        if endpoint.unlink_answers.allow():  # each costs a connection to a named address
            endpoint.send(address, "unlink", {}, once=True, key=message.sender)

    def on_unlink(self, message: Message) -> None:
        """A neighbour dropped us: forgotten, and not kept as a candidate (it did not want
        us; greeting it back would undo its choice). Its place is filled from the passive
        view now, not at the next tick (WIRE.md 7.7): neighbours drop one another as their
        rounds end, nearly together, and a place left empty until the next tick is one
        the next round may begin without."""
        entry = self.endpoint.table.get(message.sender)
        if entry is None:
            return
        self.forget_neighbour(entry)
        self.fill()

    def on_shuffle(self, message: Message) -> None:
        """A neighbour's shuffle: the cards it carried kept as candidates, and answered
        with as many of ours (views.Shuffles). Only neighbours shuffle with us
        (`not_linked`)."""
        entry = self.endpoint.table.get(message.sender)
        if entry is None:
            super().on_shuffle(message)
            return
        answer = self.shuffles.take_shuffle(message.sender, message.body)
        if answer is not None:
            self.endpoint.send(entry.address, "shuffle_reply", answer)

    def on_shuffle_reply(self, message: Message) -> None:
        self.shuffles.take_reply(message.sender, message.body)
