"""Bounded views on real sockets: joins, shuffles, replacement and hostile cards.

Each test runs a small mesh of live Endpoints on loopback with views far smaller than
the mesh, so that every path of WIRE.md 7.7 is taken: greetings turned away, candidates
learned from answers and shuffles, neighbours replaced after deaths and unlinks.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import replace

import msgpack
import numpy as np
import pytest
import zmq

from meshfl.node.config import MeshConfig
from meshfl.protocol.endpoint import Endpoint, EndpointSettings
from meshfl.protocol.identity import Identity
from meshfl.protocol.membership import PeerEntry
from meshfl.protocol.memory import MemoryNetwork
from meshfl.protocol.overlay import DROPPED_MACHINE_ROUNDS
from meshfl.protocol.ports import free_ports
from meshfl.protocol.transport import TransportError, contact
from meshfl.protocol.views import (
    MAX_CARDS,
    Candidate,
    Limits,
    PassiveView,
    Shuffles,
    ViewSettings,
    checked_card,
    make_card,
)
from meshfl.protocol.wire import make_blob
from tests.nodes import node_from
from tests.protocol.endpoints import MESH, RawPeer, memory_address

SMALL_VIEWS = ViewSettings(neighbours=3, most=5, passive=12, shuffle_interval=0.3, shuffle_length=4)
FAST = {"heartbeat_interval": 0.2, "peer_timeout": 1.0}
WAIT = 20.0


def poll_until(condition: Callable[[], bool], timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class Mesh:
    """Bounded-view endpoints started on one in-process network (memory.py), or on
    loopback sockets (`network` None)."""

    def __init__(self, network: MemoryNetwork | None) -> None:
        self.network = network
        self.made: list[Endpoint] = []

    def __call__(
        self, count: int, contacts: Callable[[list[Endpoint]], list[str]], **extra
    ) -> list[Endpoint]:
        """Start `count` more, each greeting the `contacts` named of those before it."""
        for _ in range(count):
            name = f"n{len(self.made)}"
            self.made.append(_endpoint(name, network=self.network, **{**FAST, **extra}))
            self.made[-1].start(contacts(self.made[:-1]))
        return self.made


@pytest.fixture
def mesh(request: pytest.FixtureRequest):
    """A `Mesh`, on sockets for a test marked `sockets`; every endpoint is closed after
    the test."""
    sockets = request.node.get_closest_marker("sockets") is not None
    started = Mesh(None if sockets else MemoryNetwork())
    yield started
    for endpoint in reversed(started.made):
        endpoint.close()
    if started.network is not None:
        started.network.close()


def _endpoint(
    name: str,
    identity: Identity | None = None,
    host: str = "127.0.0.1",
    network: MemoryNetwork | None = None,
    **settings,
) -> Endpoint:
    """A bounded-view endpoint: on `network`, else on a free loopback port."""
    settings.setdefault("views", SMALL_VIEWS)
    identity = identity or Identity.generate()
    if network is not None:
        listen = memory_address(host)
        return Endpoint(identity, MESH, EndpointSettings(name, listen, **settings), network=network)
    for _ in range(5):  # a port found free can be taken before we bind it
        listen = f"tcp://{host}:{free_ports(1)[0]}"
        try:
            return Endpoint(identity, MESH, EndpointSettings(name, listen, **settings))
        except TransportError:
            continue
    raise RuntimeError("no free port")


def through_first(started: list[Endpoint]) -> list[str]:
    """Every node joins through the first one, as `meshfl join` does."""
    return [started[0].contact] if started else []


def neighbours(endpoint: Endpoint) -> set[bytes]:
    return {entry.public_key for entry in endpoint.alive_peers() if entry.reached}


def connected(endpoints: list[Endpoint]) -> bool:
    """Whether the neighbour graph over `endpoints` links every one to every other."""
    keys = {endpoint.identity.public_key: endpoint for endpoint in endpoints}
    seen, todo = set(), deque([endpoints[0].identity.public_key])
    while todo:
        key = todo.popleft()
        if key in seen:
            continue
        seen.add(key)
        todo.extend(k for k in neighbours(keys[key]) if k in keys)
    return len(seen) == len(endpoints)


def views_settled(endpoints: list[Endpoint]) -> bool:
    wanted = SMALL_VIEWS.neighbours
    return all(wanted <= len(neighbours(e)) <= SMALL_VIEWS.most for e in endpoints) and connected(
        endpoints
    )


def test_nodes_joining_through_one_contact_get_bounded_connected_views(mesh):
    endpoints = mesh(12, through_first)
    assert poll_until(lambda: views_settled(endpoints)), [len(neighbours(e)) for e in endpoints]
    # The first node took newcomers only while it had room: the others were sent on.
    assert len(endpoints[0].table.entries) <= SMALL_VIEWS.most
    assert endpoints[0].flow_rejections["view_full"] > 0
    # Links are symmetric once settled: a neighbour of mine has me as its neighbour.
    time.sleep(1.0)
    by_key = {e.identity.public_key: e for e in endpoints}
    for endpoint in endpoints:
        for key in neighbours(endpoint):
            assert endpoint.identity.public_key in by_key[key].table.entries


def test_shuffles_fill_passive_views_with_signed_cards_of_live_nodes(mesh):
    endpoints = mesh(12, through_first)
    assert poll_until(lambda: views_settled(endpoints))
    assert poll_until(lambda: all(len(e.passive) >= 5 for e in endpoints))
    live = {e.identity.public_key: e.address for e in endpoints}
    for endpoint in endpoints:
        for candidate in endpoint.passive.entries.values():
            assert live.get(candidate.key) == candidate.addr
            assert candidate.key != endpoint.identity.public_key
            assert candidate.key not in endpoint.table.entries  # a neighbour is no candidate
            if candidate.card is not None:
                assert checked_card(candidate.card.packed(), MESH) == candidate.card


def test_a_dead_neighbour_is_replaced_and_views_survive_a_fifth_dying_at_once(mesh):
    endpoints = mesh(15, through_first)
    assert poll_until(lambda: views_settled(endpoints))
    assert poll_until(lambda: all(len(e.passive) >= 4 for e in endpoints))
    dying = random.Random(3).sample(endpoints[1:], 3)
    for endpoint in dying:
        endpoint.transport.close()  # dies without a word: no bye
        endpoint.worker.stopping.set()
    dead = {endpoint.identity.public_key for endpoint in dying}
    survivors = [endpoint for endpoint in endpoints if endpoint not in dying]
    started = time.monotonic()
    assert poll_until(
        lambda: views_settled(survivors) and not any(neighbours(e) & dead for e in survivors)
    ), [len(neighbours(e)) for e in survivors]
    # Marked down after peer_timeout (1 s), replaced at the next ticks.
    assert time.monotonic() - started < 10 * FAST["peer_timeout"]


def test_a_crowded_node_still_shuffles_several_times_a_round(mesh):
    # In a host of 50 a node shuffles as seldom as it beats, every 0.3 s x 5; once it
    # has done a round of 0.4 s it shuffles four times a round: every 0.3 s, the
    # interval, and no more often. Shuffles leave on beats: 0.05 s apart here, so that
    # the pace is not rounded up to the next beat (0.4 s for beats 0.2 s apart).
    crowded, partner = mesh(2, through_first, crowd=50, heartbeat_interval=0.05)
    assert poll_until(lambda: neighbours(crowded) and neighbours(partner))

    def shuffles_heard(seconds: float) -> int:
        before = partner.stats()["received"].get("shuffle", 0)
        time.sleep(seconds)
        return partner.stats()["received"].get("shuffle", 0) - before

    assert shuffles_heard(3.0) <= 3
    crowded.set_round(1)
    time.sleep(0.4)
    crowded.set_round(2)
    time.sleep(1.6)  # the shuffle due at the stretched pace goes first
    assert shuffles_heard(3.0) >= 6
    assert ViewSettings(shuffle_interval=2.0).shuffle_period(5, round_length=100) == 10


class TcpListener:
    """A bare TCP port: it takes connections (so a dialler counts one as made) and never
    speaks ZeroMQ. `hang_up`: each connection is closed as it comes, the port kept."""

    def __init__(self, hang_up: bool = False):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        self.taken: list[socket.socket] = []
        self.hang_up = hang_up
        threading.Thread(target=self._take, daemon=True).start()

    def _take(self) -> None:
        with contextlib.suppress(OSError):  # closed
            while True:
                connection, _ = self.server.accept()
                if self.hang_up:
                    connection.close()
                self.taken.append(connection)

    def close(self) -> None:
        # Shut down first: a socket closed while a thread waits in accept() on it would
        # go on taking connections until that accept() returns.
        for connection in [self.server, *self.taken]:
            with contextlib.suppress(OSError):  # closed by its far end already
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()


def lonely_and_other(mesh) -> tuple[Endpoint, Endpoint]:
    """A node whose view has one place (its handshake grace 20 s), and a live node."""
    other = mesh(1, lambda started: [])[-1]
    one_place = replace(SMALL_VIEWS, neighbours=1, most=1)
    lonely = mesh(1, lambda started: [], views=one_place, peer_timeout=10.0)[-1]
    return lonely, other


def test_a_candidate_where_nobody_listens_is_given_up_at_once(mesh):
    # A view of one: the greeting that awaits the dead candidate holds its only place,
    # for the handshake grace (2 x peer_timeout, 20 s) unless the refused connection
    # gives it up.
    lonely, other = lonely_and_other(mesh)
    gone = Identity.generate().public_key
    lonely.passive.add(Candidate(gone, f"tcp://127.0.0.1:{free_ports(1)[0]}"))
    assert poll_until(lambda: gone not in lonely.passive, 5)  # greeted
    lonely.passive.add(Candidate(other.identity.public_key, other.address))
    assert poll_until(lambda: neighbours(lonely) == {other.identity.public_key}, 5)


@pytest.mark.sockets  # a TCP listener that dies
def test_a_candidate_that_dies_once_dialled_is_given_up_at_once(mesh):
    # Connected before it died: the tries since are refused, so nobody listens there.
    lonely, other = lonely_and_other(mesh)
    doomed = TcpListener()
    lonely.passive.add(Candidate(Identity.generate().public_key, doomed.address))
    assert poll_until(lambda: doomed.taken, 5)  # greeted, and a connection made
    doomed.close()
    lonely.passive.add(Candidate(other.identity.public_key, other.address))
    assert poll_until(lambda: neighbours(lonely) == {other.identity.public_key}, 5)


@pytest.mark.sockets  # a TCP listener that hangs up
def test_a_candidate_that_breaks_off_handshakes_is_not_given_up_before_its_grace(mesh):
    # Someone listens there (each try connects, then is cut): as a peer slow to finish
    # its handshake on a starved machine, it keeps its place for the grace (20 s).
    lonely, other = lonely_and_other(mesh)
    rude = TcpListener(hang_up=True)
    lonely.passive.add(Candidate(Identity.generate().public_key, rude.address))
    try:
        assert poll_until(lambda: len(rude.taken) >= 3, 5)  # tried again and again
        lonely.passive.add(Candidate(other.identity.public_key, other.address))
        time.sleep(2.0)
        assert not neighbours(lonely)
    finally:
        rude.close()


def test_a_dead_contact_holds_no_place_once_the_node_is_in(mesh):
    # Started with a live contact and one where nobody listens: the dead one is greeted
    # again every grace until the node has a neighbour, and given up once it has (it
    # held a place of the view for good).
    dead = contact(f"tcp://127.0.0.1:{free_ports(1)[0]}", Identity.generate().public_key)
    first, spare = mesh(2, lambda started: [])
    lonely = mesh(
        1,
        lambda _: [first.contact, dead],
        views=replace(SMALL_VIEWS, neighbours=2, most=2),
        peer_timeout=10.0,
    )[-1]
    assert poll_until(lambda: neighbours(lonely) == {first.identity.public_key}, 5)
    lonely.passive.add(Candidate(spare.identity.public_key, spare.address))
    wanted = {first.identity.public_key, spare.identity.public_key}
    assert poll_until(lambda: neighbours(lonely) == wanted, 5)


def test_a_node_whose_neighbours_all_died_rejoins_through_its_contacts(mesh):
    # Started with a live contact and one not up yet, it joins through the first and gives
    # the other up; once the first dies and no candidate is left, it greets its contacts
    # again, and the one up by then takes it in.
    late_identity = Identity.generate()
    late_address = memory_address()
    first = mesh(1, lambda started: [])[-1]
    node = mesh(
        1,
        lambda _: [first.contact, contact(late_address, late_identity.public_key)],
        views=replace(SMALL_VIEWS, neighbours=2, most=2),
    )[-1]
    assert poll_until(lambda: neighbours(node) == {first.identity.public_key}, 5)
    settings = EndpointSettings("late", late_address, views=SMALL_VIEWS, **FAST)
    late = Endpoint(late_identity, MESH, settings, network=mesh.network)
    try:
        late.start([])
        first.close()
        assert poll_until(lambda: neighbours(node) == {late_identity.public_key}, 10)
    finally:
        late.close()


def test_a_node_its_neighbour_dropped_greets_for_the_place_at_once(mesh):
    # Ticks 10 s apart: a greeting within 1.5 s of the unlink was not the tick's.
    slow = {"heartbeat_interval": 10.0, "peer_timeout": 50.0}
    dropper, spare = mesh(2, lambda started: [], **slow)
    one_place = replace(SMALL_VIEWS, neighbours=1, most=1)
    dropped = mesh(1, lambda _: [dropper.contact], views=one_place, **slow)[-1]
    assert poll_until(lambda: neighbours(dropped) == {dropper.identity.public_key}, 5)
    dropped.passive.add(Candidate(spare.identity.public_key, spare.address))
    dropper.unlink([dropped.identity.public_key])
    assert poll_until(lambda: neighbours(dropped) == {spare.identity.public_key}, 1.5)


def test_an_unlinked_neighbour_is_replaced_and_told(mesh):
    endpoints = mesh(8, through_first)
    assert poll_until(lambda: views_settled(endpoints))
    node = endpoints[3]
    dropped = next(iter(neighbours(node)))
    other = next(e for e in endpoints if e.identity.public_key == dropped)
    unlinked_at = time.monotonic()
    node.unlink([dropped])
    assert dropped not in node.table.entries

    def told() -> bool:
        # It forgot us; it may have taken us back since, afresh (cards of the mesh's
        # eight nodes come back in shuffles, and either side may greet the other again).
        entry = other.table.get(node.identity.public_key)
        return entry is None or entry.entered > unlinked_at

    assert poll_until(told, 5)
    assert other.stats()["received"].get("unlink", 0) >= 1
    assert poll_until(lambda: len(neighbours(node)) >= SMALL_VIEWS.neighbours, 10)


def test_a_finished_node_is_heard_at_once_and_keeps_the_neighbours_it_has(mesh):
    # Heartbeats 1 s apart, one shuffle in 0.3 s: a round every neighbour heard within
    # 0.2 s was told by finish.
    endpoints = mesh(8, through_first, heartbeat_interval=1.0, peer_timeout=5.0)
    assert poll_until(lambda: views_settled(endpoints))
    node = endpoints[3]
    kept = set(node.table.entries)  # its neighbours, and any it is still dialling
    others = [e for e in endpoints if e.identity.public_key in neighbours(node)]
    node.set_round(7)
    node.finish()
    me = node.identity.public_key
    assert poll_until(lambda: all(e.table.get(me).round == 7 for e in others), 0.2)
    # Its neighbours stay (it serves them its last blob); it looks for no others, and
    # turns newcomers away.
    node.unlink([next(iter(kept))])
    late = mesh(1, lambda _: [node.contact])[-1]
    time.sleep(1.0)
    assert late.identity.public_key not in node.table.entries
    assert set(node.table.entries) <= kept and len(node.table.entries) == len(kept) - 1
    assert node.flow_rejections["view_full"] > 0


@pytest.mark.parametrize("views", [SMALL_VIEWS, None], ids=["bounded", "full mesh"])
def test_a_node_that_links_a_greeter_hears_what_the_greeter_announced_before(mesh, views):
    # The greeter published its round's blob before it had this peer; the new peer
    # waits for that blob, and must hear of it now, not once the greeter is past the
    # round (a heartbeat period, stretched in a crowded host).
    host = mesh(1, through_first, views=views)[0]
    host.set_round(1)
    greeter = _endpoint("greeter", views=views, network=mesh.network, **FAST)
    try:
        greeter.set_round(1)
        arrays = {"w": np.arange(4, dtype=np.float32)}
        greeter.publish(make_blob(greeter.identity, 1, "model", arrays))
        greeter.start([host.contact])

        def heard() -> bool:
            return any(offer.origin == greeter.identity.public_key for offer in host.offers(1))

        assert poll_until(heard, 5)
    finally:
        greeter.close()


def silent_peers(context: zmq.Context, endpoint: Endpoint, count: int) -> list[RawPeer]:
    """`count` peers that take `endpoint`'s connections and never answer its hellos. The
    caller holds them: a RawPeer nobody holds is closed, and then nobody listens."""
    return [RawPeer(context, endpoint.contact) for _ in range(count)]


def contacts_of(peers: list[RawPeer]) -> list[str]:
    return [contact(peer.address, peer.public_key) for peer in peers]


def test_greeters_never_fill_a_view_that_is_greeting_for_its_places(context):
    # Its three hellos hold three of the five places: of three greeters two are taken,
    # so that when its hellos are answered it holds no more connections than places.
    node = _endpoint("node")
    try:
        silent = silent_peers(context, node, SMALL_VIEWS.neighbours)
        node.start(contacts_of(silent))
        greeters = [RawPeer(context, node.contact) for _ in range(3)]
        for greeter in greeters:
            greeter.send(
                greeter.frames(
                    "hello",
                    {
                        "name": greeter.name + greeter.address[-5:],
                        "addr": greeter.address,
                        "list": False,
                    },
                )
            )
        assert poll_until(lambda: node.flow_rejections["view_full"] == 1, 5)
        taken = [g for g in greeters if g.public_key in node.table.entries]
        assert len(taken) == SMALL_VIEWS.most - SMALL_VIEWS.neighbours
        assert node.transport.connections() <= SMALL_VIEWS.most
    finally:
        node.close()


def test_a_turned_away_greeter_greets_the_next_candidate_at_once(context):
    # Heartbeat ticks 5 s apart: a greeting within a second was not the tick's.
    node = _endpoint("node", heartbeat_interval=5.0, peer_timeout=25.0)
    try:
        full = RawPeer(context, node.contact, name="full")
        named = RawPeer(context, node.contact, name="named")
        node.start([contact(full.address, full.public_key)])
        full.expect("hello", 5)
        entries = [
            {"name": "full", "addr": full.address, "key": full.public_key},
            {"name": "named", "addr": named.address, "key": named.public_key},
        ]
        full.send(full.frames("peers", {"peers": entries, "linked": False}))
        clock = time.monotonic()
        named.expect("hello", 3)
        assert time.monotonic() - clock < 1.0
        assert full.public_key not in node.table.entries
    finally:
        node.close()


def test_a_short_view_waits_for_its_peers_only_while_it_greets_for_them(context, node):
    # Nobody to greet: the round must not wait for a view the mesh cannot fill.
    clock = time.monotonic()
    assert not node.wait_for_peers(SMALL_VIEWS.neighbours, 5.0)
    assert time.monotonic() - clock < 1.0
    greeting = _endpoint("greeting")
    try:
        silent = silent_peers(context, greeting, 1)
        greeting.start(contacts_of(silent))
        clock = time.monotonic()
        assert not greeting.wait_for_peers(SMALL_VIEWS.neighbours, 1.5)
        assert time.monotonic() - clock >= 1.4  # its hello is out: that place may come
    finally:
        greeting.close()


def test_a_round_waits_three_heartbeats_for_a_place_two_round_trips_away(context):
    """In a crowded mesh half the answers to a hello turn the greeter away with others
    to greet: a bounded node's round waits for a place that takes two round trips to
    fill, each longer than half a heartbeat period (one period was too short)."""
    beat = 1.0
    endpoint = _endpoint("node", heartbeat_interval=beat, peer_timeout=5 * beat)
    node = node_from(endpoint=endpoint, config=MeshConfig(heartbeat_interval=beat))
    full = RawPeer(context, endpoint.contact, name="full")
    named = RawPeer(context, endpoint.contact, name="named")
    answering = threading.Thread(target=_turn_away_then_link, args=(full, named, 0.6 * beat))
    try:
        endpoint.start([contact(full.address, full.public_key)])
        answering.start()
        node.wait_for_neighbours()  # 1 of 3 places can be filled: it waits its patience
        # Linked 1.2 periods after the start: past one period's wait, within three.
        assert named.public_key in endpoint.table.entries
    finally:
        if answering.is_alive():
            answering.join()
        endpoint.close()


def _turn_away_then_link(full: RawPeer, named: RawPeer, delay: float) -> None:
    """`full` answers the node's hello after `delay`, turning it away and naming `named`,
    which answers its own hello after `delay` again, taking the node as a neighbour."""
    entries = [
        {"name": peer.name, "addr": peer.address, "key": peer.public_key} for peer in (full, named)
    ]
    full.expect("hello", 5)
    time.sleep(delay)
    full.send(full.frames("peers", {"peers": entries, "linked": False}))
    named.expect("hello", 5)
    time.sleep(delay)
    named.send(named.frames("peers", {"peers": entries[1:], "linked": True}))


# --- hostile cards and shuffles ---------------------------------------------------


def shuffle_from(peer: RawPeer, cards: list[dict], kind: str = "shuffle") -> None:
    peer.send(peer.frames(kind, {"cards": cards}))


def linked_raw_peer(context: zmq.Context, endpoint: Endpoint, name: str = "raw") -> RawPeer:
    """A hand-driven node that greets `endpoint` and is taken as its neighbour."""
    peer = RawPeer(context, endpoint.contact, name=name)
    peer.send(peer.frames("hello", {"name": peer.name, "addr": peer.address, "list": False}))
    assert poll_until(lambda: peer.identity.public_key in endpoint.table.entries, 5)
    return peer


def linked_on_hello(peer: RawPeer) -> bool:
    """Whether the node `peer` greets takes it as a neighbour, by the peers list it answers."""
    peer.send(peer.hello())
    return peer.expect("peers", 5).body["linked"] is not False


def greeted_by(endpoint: Endpoint, peer: RawPeer) -> None:
    """`peer` made a candidate of `endpoint`'s, which greets it to fill a free place."""
    with endpoint.lock:
        endpoint.passive.add(Candidate(peer.public_key, peer.address))
        endpoint.overlay.fill()
    peer.expect("hello", 5)


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def node():
    """One bounded-view endpoint, serving, with nobody to greet."""
    endpoint = _endpoint("node")
    endpoint.start()
    yield endpoint
    endpoint.close()


def test_a_forged_card_spoils_its_whole_shuffle(context, node):
    peer = linked_raw_peer(context, node)
    victim = Identity.generate()
    honest = make_card(Identity.generate(), MESH, "honest", "tcp://127.0.0.1:5")
    forged = {**make_card(victim, MESH, "victim", "tcp://127.0.0.1:6").packed()}
    forged["addr"] = "tcp://10.9.9.9:6"  # the victim never said it listens there
    shuffle_from(peer, [honest.packed(), forged])
    assert poll_until(lambda: node.flow_rejections["bad_card"] == 1, 5)
    assert honest.key not in node.passive and victim.public_key not in node.passive


def test_a_card_made_for_another_mesh_is_refused(context, node):
    peer = linked_raw_peer(context, node)
    elsewhere = make_card(Identity.generate(), b"\x01" * 16, "far", "tcp://127.0.0.1:7")
    shuffle_from(peer, [elsewhere.packed()])
    assert poll_until(lambda: node.flow_rejections["bad_card"] == 1, 5)
    assert len(node.passive) == 0


def test_shuffles_from_strangers_and_answers_nobody_asked_for_are_dropped(context, node):
    stranger = RawPeer(context, node.contact)
    card = make_card(Identity.generate(), MESH, "x", "tcp://127.0.0.1:8").packed()
    shuffle_from(stranger, [card])
    shuffle_from(stranger, [card], kind="shuffle_reply")
    assert poll_until(
        lambda: (
            node.flow_rejections["not_linked"] == 1
            and node.flow_rejections["unsolicited_cards"] == 1
        ),
        5,
    )
    assert len(node.passive) == 0


def test_a_heartbeat_never_links_and_a_dropped_neighbours_is_answered_with_unlink(context, node):
    # The node has room, yet a heartbeat is not a hello: a neighbour just dropped whose
    # heartbeat crossed our unlink must not come back by it, nor a stranger get in so.
    peer = linked_raw_peer(context, node)
    node.unlink([peer.public_key])
    peer.expect("unlink", 5)
    peer.send(peer.frames("heartbeat", {"name": peer.name, "addr": peer.address}))
    peer.expect("unlink", 5)
    assert peer.public_key not in node.table.entries
    assert node.flow_rejections["not_linked"] == 1


def test_a_dropped_neighbours_place_is_greeted_for_at_once(context):
    # Heartbeat ticks 5 s apart: a greeting within a second was unlink's, not a tick's.
    node = _endpoint("node", heartbeat_interval=5.0, peer_timeout=25.0)
    node.start()
    try:
        dropped = linked_raw_peer(context, node)
        candidate = RawPeer(context, node.contact, name="candidate")
        node.passive.add(Candidate(candidate.public_key, candidate.address, name="candidate"))
        node.unlink([dropped.public_key])
        clock = time.monotonic()
        candidate.expect("hello", 3)
        assert time.monotonic() - clock < 1.0
    finally:
        node.close()


def test_the_candidates_a_helpful_neighbour_named_are_greeted_first(context):
    # Of five candidates, one was named by the neighbour the node found helpful, four by
    # another neighbour: the place a drop frees goes to the helpful one's.
    node = _endpoint("node", heartbeat_interval=5.0, peer_timeout=25.0)
    node.start()
    try:
        helper, other, dropped = (linked_raw_peer(context, node, name) for name in "hod")
        vouched = RawPeer(context, node.contact, name="vouched")
        others = [RawPeer(context, node.contact, name=f"x{i}") for i in range(4)]
        with node.lock:
            node.passive.add(Candidate(vouched.public_key, vouched.address, via=helper.public_key))
            for peer in others:
                node.passive.add(Candidate(peer.public_key, peer.address, via=other.public_key))
        node.unlink([dropped.public_key], vouched=[helper.public_key])
        vouched.expect("hello", 3)
        assert not any(peer.collect("hello", 0.3) for peer in others)
    finally:
        node.close()


def test_a_shuffles_answer_names_the_answering_nodes_neighbours(context, node):
    # The answer carries the node's neighbours' cards and says how many: the asker
    # greets those first when it vouches for the node.
    neighbour = linked_raw_peer(context, node, "neighbour")
    asker = linked_raw_peer(context, node, "asker")
    for peer in (neighbour, asker):
        node.overlay.shuffles.keep(
            peer.public_key,
            make_card(peer.identity, MESH, peer.name, peer.address).packed(),
            peer.address,
        )
    candidates = [
        make_card(Identity.generate(), MESH, f"c{i}", f"tcp://127.0.0.1:{300 + i}").packed()
        for i in range(3)
    ]
    own = make_card(asker.identity, MESH, asker.name, asker.address).packed()
    shuffle_from(asker, [own, *candidates])
    answer = asker.expect("shuffle_reply", 5).body
    assert answer["neighbours"] == 1
    assert answer["cards"][0]["key"] == neighbour.public_key  # not the asker's own


def test_every_other_shuffle_goes_to_a_neighbour_vouched_for():
    passive = PassiveView(8, random.Random(0))
    own = make_card(Identity.generate(), MESH, "me", "tcp://127.0.0.1:1")
    shuffles = Shuffles(
        own,
        MESH,
        SMALL_VIEWS,
        passive,
        rng=random.Random(0),
        is_peer=lambda key: False,
        rejections=Counter(),
    )
    partners = [
        PeerEntry(Identity.generate().public_key, f"p{i}", f"tcp://127.0.0.1:{10 + i}", b"i")
        for i in range(6)
    ]
    helper = partners[3]
    sent = [
        shuffles.due(100.0 * turn, partners, 1.0, vouched={helper.public_key})
        for turn in range(1, 41)
    ]
    to_helper = sum(shuffle is not None and shuffle[0] == helper.address for shuffle in sent)
    assert 20 <= to_helper <= 26  # every other one, and a sixth of the rest
    alone = shuffles.due(10_000.0, partners, 1.0)
    assert alone is not None  # vouching for none, any neighbour


def test_a_malformed_neighbour_count_in_a_shuffle_answer_is_refused(context, node):
    peer = linked_raw_peer(context, node)
    card = make_card(Identity.generate(), MESH, "c", "tcp://127.0.0.1:400").packed()
    peer.send(peer.frames("shuffle_reply", {"cards": [card], "neighbours": -1}))
    assert poll_until(lambda: node.rejections().get("bad_header") == 1, 5)


def test_an_oversized_shuffle_is_refused_at_decoding(context, node):
    peer = linked_raw_peer(context, node)
    cards = [
        make_card(Identity.generate(), MESH, f"c{i}", f"tcp://127.0.0.1:{100 + i}").packed()
        for i in range(MAX_CARDS + 1)
    ]
    shuffle_from(peer, cards)
    assert poll_until(lambda: node.rejections().get("too_many_cards") == 1, 5)
    assert len(node.passive) == 0


def test_a_neighbour_answering_every_shuffle_with_itself_holds_one_place(context, node):
    peer = linked_raw_peer(context, node)
    own = make_card(peer.identity, MESH, peer.name, peer.address).packed()
    for _ in range(5):
        shuffle_from(peer, [own, own, own])
    assert poll_until(lambda: node.received["shuffle"] == 5, 5)
    # It is a neighbour already, so it is no candidate; and never more than one place.
    assert len(node.passive) <= 1


def test_a_replayed_older_card_does_not_undo_a_newer_one():
    view = PassiveView(4, random.Random(0))
    owner = Identity.generate()
    old = make_card(owner, MESH, "n", "tcp://127.0.0.1:9")
    new = make_card(owner, MESH, "n", "tcp://127.0.0.1:10")
    view.add(Candidate(owner.public_key, new.addr, new))
    view.add(Candidate(owner.public_key, old.addr, old))
    assert view.entries[owner.public_key].card == new


def test_a_full_passive_view_makes_room_with_what_it_sent_away_first():
    view = PassiveView(3, random.Random(0))
    keys = [Identity.generate().public_key for _ in range(4)]
    for key in keys[:3]:
        view.add(Candidate(key, "tcp://127.0.0.1:1"))
    view.add(Candidate(keys[3], "tcp://127.0.0.1:2"), sent_away=[keys[1]])
    assert set(view.entries) == {keys[0], keys[2], keys[3]}


def test_candidates_named_by_a_neighbour_are_greeted_first():
    view = PassiveView(8, random.Random(0))
    friend, stranger = b"F" * 32, b"S" * 32
    keys = [Identity.generate().public_key for _ in range(6)]
    for index, key in enumerate(keys):
        view.add(
            Candidate(key, f"tcp://127.0.0.1:{index + 1}", via=friend if index < 2 else stranger)
        )
    taken = view.take(2, exclude=(), friends={friend})
    assert {candidate.key for candidate in taken} == set(keys[:2])
    assert len(view.take(10, exclude=(), friends={friend})) == 4  # then any


def test_cards_pack_to_plain_msgpack():
    card = make_card(Identity.generate(), MESH, "n", "tcp://127.0.0.1:9")
    assert checked_card(msgpack.unpackb(msgpack.packb(card.packed())), MESH) == card


# --- what one group of addresses, and one source, may hold ------------------------------


def test_the_default_views_give_one_group_a_quarter_of_the_neighbours():
    limits = ViewSettings.keeping(8).limits
    assert (limits.group_by, limits.neighbours, limits.candidates, limits.per_source) == (
        "auto",
        2,
        4,
        8,
    )


ONE_MACHINE = Limits(group_by="ip", neighbours=2, candidates=3, per_source=3)
OTHER_ADDRESS = "127.0.0.2"
LIMITED = replace(SMALL_VIEWS, limits=ONE_MACHINE)


def test_greeters_from_one_address_get_only_its_groups_places(context):
    # The node listens at another address of the loopback: its own group is not limited.
    node = _endpoint("node", host=OTHER_ADDRESS, views=LIMITED)
    try:
        node.start()
        greeters = [RawPeer(context, node.contact, name=f"g{index}") for index in range(4)]
        for greeter in greeters:
            greeter.send(greeter.frames("hello", {"name": greeter.name, "addr": greeter.address}))
        assert poll_until(lambda: node.flow_rejections["group_full"] == 2, 5)
        assert len(node.table.entries) == ONE_MACHINE.neighbours
        turned_away = [g for g in greeters if g.public_key not in node.table.entries]
        for greeter in turned_away:  # told so, with others to try instead
            assert greeter.expect("peers", 5).body["linked"] is False
    finally:
        node.close()


def cards_at(hosts: list[str]) -> list[dict]:
    return [
        make_card(Identity.generate(), MESH, f"c{index}", f"tcp://{host}:{7000 + index}").packed()
        for index, host in enumerate(hosts)
    ]


@pytest.mark.parametrize(
    "hosts",
    [["127.0.0.1"] * 6, [f"127.0.0.{10 + index}" for index in range(6)]],
    ids=["one address", "one source"],
)
def test_one_shuffle_fills_no_more_candidates_than_its_group_and_its_source_may(context, hosts):
    # Six at one address share one group's 3 places; six at six addresses, told of by
    # one neighbour, fill their source's 3. A view of one neighbour: full, it greets none.
    views = replace(LIMITED, neighbours=1, most=2)
    node = _endpoint("node", host=OTHER_ADDRESS, views=views)
    try:
        node.start()
        peer = linked_raw_peer(context, node)
        shuffle_from(peer, cards_at(hosts))
        assert poll_until(lambda: node.received["shuffle"] == 1, 5)
        assert len(node.passive) == 3
        assert node.stats()["candidates_refused"] == 3
    finally:
        node.close()


def test_a_dropped_neighbours_machine_is_kept_out_for_a_few_rounds(context):
    # Identities cost nothing: another key on the machine of a neighbour the node dropped
    # gets the place neither by greeting nor as a candidate, until the rounds it is kept
    # out are over. A view of one neighbour; addresses grouped by machine (`ip`).
    node = _endpoint("node", host=OTHER_ADDRESS, views=replace(LIMITED, neighbours=1, most=2))
    try:
        node.start()
        node.set_round(1)
        dropped = linked_raw_peer(context, node, name="dropped")
        same_machine = RawPeer(context, node.contact, name="same")
        with node.lock:
            node.passive.add(Candidate(same_machine.public_key, same_machine.address))
        node.unlink([dropped.public_key])
        dropped.expect("unlink", 5)
        assert same_machine.collect("hello", 0.5) == []
        assert node.greetable_candidates() == 0 and len(node.passive) == 1  # none to explore
        elsewhere = RawPeer(context, node.contact, name="elsewhere", host="127.0.0.3")
        greeted_by(node, elsewhere)  # the place goes to a candidate of another machine
        newcomer = RawPeer(context, node.contact, name="newcomer")
        for round_no, rejected in [(1, 1), (1 + DROPPED_MACHINE_ROUNDS, 2)]:
            node.set_round(round_no)
            assert not linked_on_hello(newcomer)
            assert node.flow_rejections["machine_dropped"] == rejected
        node.set_round(2 + DROPPED_MACHINE_ROUNDS)
        assert linked_on_hello(newcomer)
    finally:
        node.close()


def test_a_machine_dropped_again_is_kept_out_twice_as_long(context):
    # A machine of many identities must not take turns with others: each drop of one of
    # its identities doubles the rounds it is kept out after the drop (3, then 6).
    node = _endpoint("node", host=OTHER_ADDRESS, views=replace(LIMITED, neighbours=1, most=2))
    try:
        node.start()
        node.set_round(1)
        node.unlink([linked_raw_peer(context, node, name="first").public_key])
        again = 2 + DROPPED_MACHINE_ROUNDS  # the first keep-out is over
        node.set_round(again)
        node.unlink([linked_raw_peer(context, node, name="second").public_key])
        newcomer = RawPeer(context, node.contact, name="newcomer")
        last_out = again + 2 * DROPPED_MACHINE_ROUNDS
        for round_no, linked in [(last_out, False), (last_out + 1, True)]:
            node.set_round(round_no)
            assert linked_on_hello(newcomer) is linked
        assert node.flow_rejections["machine_dropped"] == 1
    finally:
        node.close()


def test_a_restarted_node_keeps_out_the_machines_its_checkpoint_kept_out(context):
    views = replace(LIMITED, neighbours=1, most=2)
    node = _endpoint("node", host=OTHER_ADDRESS, views=views)
    try:
        node.start()
        node.set_round(2)
        node.unlink([linked_raw_peer(context, node, name="dropped").public_key])
        assert node.dropped_machines(2 + DROPPED_MACHINE_ROUNDS + 1) == {}  # over by then
        kept = node.dropped_machines(3)  # what the node's checkpoint of round 2 keeps
        assert kept == {"127.0.0.1/32": 2}
    finally:
        node.close()
    again = _endpoint("node", host=OTHER_ADDRESS, views=views)
    try:
        again.start(dropped_machines=kept)
        greeter = RawPeer(context, again.contact, name="greeter")
        assert not linked_on_hello(greeter)
        assert again.flow_rejections["machine_dropped"] == 1
    finally:
        again.close()


def test_a_mesh_on_one_machine_keeps_no_dropped_machine_out(context):
    # Loopback addresses are grouped by port under `auto`: each node is a group of its own.
    node = _endpoint("node", host=OTHER_ADDRESS, views=replace(SMALL_VIEWS, neighbours=1, most=2))
    try:
        node.start()
        node.unlink([linked_raw_peer(context, node, name="dropped").public_key])
        linked_raw_peer(context, node, name="next")  # at the same address, at once
        assert node.flow_rejections["machine_dropped"] == 0
    finally:
        node.close()


def test_greeters_hold_only_half_the_places_where_addresses_are_grouped(context):
    # Half of a view (of the most it takes) is the node's own choice: identities that
    # greet every node cannot fill it. Four greeters, each on a machine of its own.
    views = replace(LIMITED, neighbours=4, most=4)
    node = _endpoint("node", host=OTHER_ADDRESS, views=views)
    try:
        node.start()
        greeters = [
            RawPeer(context, node.contact, name=f"g{index}", host=f"127.0.0.{10 + index}")
            for index in range(4)
        ]
        for greeter in greeters:
            greeter.send(greeter.hello())
        assert poll_until(lambda: node.flow_rejections["greeters_full"] == 2, 5)
        assert len(node.table.entries) == views.greeter_places == 2
        chosen = RawPeer(context, node.contact, name="chosen", host="127.0.0.20")
        greeted_by(node, chosen)  # a candidate the node greets itself still takes a place
        itself = {"name": chosen.name, "addr": chosen.address, "key": chosen.public_key}
        chosen.send(chosen.frames("peers", {"peers": [itself]}))
        assert poll_until(lambda: chosen.public_key in node.table.entries, 5)
        linked = greeters[0] if greeters[0].public_key in node.table.entries else greeters[1]
        node.unlink([linked.public_key])  # a greeter gone frees a greeter's place
        late = RawPeer(context, node.contact, name="late", host="127.0.0.21")
        assert linked_on_hello(late)
    finally:
        node.close()


def test_greeters_on_one_machine_are_not_limited(context):
    # A mesh on one machine: its addresses are grouped by port, each a group of its own.
    node = _endpoint("node", host=OTHER_ADDRESS, views=replace(SMALL_VIEWS, neighbours=4, most=4))
    try:
        node.start()
        for index in range(4):
            linked_raw_peer(context, node, name=f"g{index}")
        assert node.flow_rejections["greeters_full"] == 0
    finally:
        node.close()


def test_a_nodes_own_group_is_not_limited(context):
    node = _endpoint("node", views=LIMITED)  # at 127.0.0.1, as its greeters are
    try:
        node.start()
        for index in range(4):
            linked_raw_peer(context, node, name=f"g{index}")
        assert node.flow_rejections["group_full"] == node.flow_rejections["greeters_full"] == 0
    finally:
        node.close()


def test_a_candidate_cannot_move_into_a_group_that_is_full():
    view = PassiveView(8, random.Random(0), ONE_MACHINE)
    cards = [make_card(Identity.generate(), MESH, "c", "tcp://10.0.0.1:7") for _ in range(3)]
    for card in cards:
        view.add(Candidate(card.key, card.addr, card))
    mover = Identity.generate()
    old = make_card(mover, MESH, "m", "tcp://10.0.0.2:7")
    view.add(Candidate(mover.public_key, old.addr, old))
    time.sleep(0.001)  # a later card
    new = make_card(mover, MESH, "m", "tcp://10.0.0.1:8")
    assert not view.add(Candidate(mover.public_key, new.addr, new))
    assert view.entries[mover.public_key].addr == old.addr


def test_a_newcomer_may_take_the_place_of_one_of_its_own_group_in_a_full_view():
    view = PassiveView(4, random.Random(0), Limits("network", candidates=2))
    group = [Identity.generate().public_key for _ in range(2)]
    for index, key in enumerate(group):
        view.add(Candidate(key, f"tcp://203.0.113.{index + 1}:7"))
    others = [Identity.generate().public_key for _ in range(2)]
    for index, key in enumerate(others):
        view.add(Candidate(key, f"tcp://198.51.{index}.1:7"))
    newcomer = Candidate(Identity.generate().public_key, "tcp://203.0.113.9:7")
    assert not view.add(newcomer, sent_away=[others[0]]), "its group would hold three"
    assert others[0] in view and view.refused == 1
    assert view.add(newcomer, sent_away=[group[0]]), "it takes the place of one of its group"
    assert newcomer.key in view and group[0] not in view and len(view) == 4


def test_a_mesh_on_one_machine_is_not_limited():
    view = PassiveView(8, random.Random(0), ViewSettings.keeping(8).limits)
    source = Identity.generate().public_key
    for index in range(8):
        view.add(
            Candidate(
                Identity.generate().public_key, f"tcp://127.0.0.1:{7000 + index}", source=source
            )
        )
    assert len(view) == 8 and view.refused == 0
    assert len(view.take(8, exclude=(), linked=["tcp://127.0.0.1:6999"] * 3)) == 8


def test_a_view_greets_no_more_candidates_of_one_group_than_it_may_hold():
    view = PassiveView(8, random.Random(0), Limits("network", neighbours=2, candidates=8))
    crowd = [Identity.generate().public_key for _ in range(5)]
    for index, key in enumerate(crowd):
        view.add(Candidate(key, f"tcp://203.0.113.{index + 1}:7"))
    loner = Identity.generate().public_key
    view.add(Candidate(loner, "tcp://198.51.100.1:7"))
    linked = ["tcp://203.0.113.200:7"]  # a neighbour of that network already
    taken = view.take(4, exclude=(), linked=linked)
    assert {candidate.key for candidate in taken} - {loner} <= set(crowd)
    assert len(taken) == 2 and loner in {candidate.key for candidate in taken}


def test_one_machine_of_a_network_holds_half_its_groups_places():
    """Many identities on one address earn a machine's share, not a network's: one of
    the two neighbour places of a /24, two of its four candidate places."""
    limits = Limits("network", neighbours=2, candidates=4)
    machine, other = "tcp://203.0.113.5:7", "tcp://203.0.113.6:7"
    assert limits.crowded("tcp://203.0.113.5:8", [machine], limits.neighbours)
    assert not limits.crowded(other, [machine], limits.neighbours)
    assert limits.crowded("tcp://203.0.113.7:7", [machine, other], limits.neighbours)
    assert not limits.crowded("tcp://203.0.113.5:9", [machine], limits.candidates)
    assert limits.crowded("tcp://203.0.113.5:9", [machine, machine], limits.candidates)
    six = ["tcp://[2001:db8:1:2::9]:7"]
    assert limits.crowded("tcp://[2001:db8:1:2::5]:7", six, 2), "an IPv6 machine is its /64"
    assert not limits.crowded("tcp://[2001:db8:1:3::5]:7", six, 2)
    by_machine = Limits("ip", neighbours=2)
    assert not by_machine.crowded("tcp://203.0.113.5:8", [machine], 2), "the group is a machine"
    view = PassiveView(8, random.Random(0), limits)
    sybils = [
        Candidate(Identity.generate().public_key, f"tcp://203.0.113.5:{7 + i}") for i in range(3)
    ]
    for sybil in sybils:
        view.add(sybil)
    assert len(view) == 2 and view.refused == 1
    assert len(view.take(2, exclude=())) == 1, "one neighbour place for the machine"


@pytest.mark.sockets
def test_a_node_greets_its_anchors_before_its_other_contacts(mesh):
    """A resumed node's anchors (its neighbours of long standing, node/neighbours.py)
    take the places of its view first, whatever else it was told of."""
    others = mesh(8, through_first)  # views full before the node comes: none greets it
    # Settled, and no hello of theirs outstanding: no other greeter takes the room left.
    assert poll_until(
        lambda: views_settled(others) and not any(peer.overlay.greeting() for peer in others), 10
    )
    # Two with room left (a view at `most` would turn the node away).
    chosen = sorted(others[1:], key=lambda peer: len(neighbours(peer)))[:2]
    node = _endpoint("resumed", network=mesh.network, **FAST)
    mesh.made.append(node)
    # The worker greets candidates for the places no hello awaits: when it starts, the
    # anchors' hellos must be awaited already, or candidates take their places.
    awaited_at_start: list[str] = []
    start_worker = node.worker.thread.start

    def note_hellos_and_start() -> None:
        awaited_at_start.extend(node.handshake.out)
        start_worker()

    node.worker.thread.start = note_hellos_and_start  # type: ignore[method-assign]
    node.start([peer.contact for peer in others], anchors=[peer.contact for peer in chosen])
    # In the order greeted: the anchors first, then one of the other contacts.
    assert set(awaited_at_start[:2]) == {peer.address for peer in chosen}, "greeted first"
    wanted = {peer.identity.public_key for peer in chosen}
    assert poll_until(lambda: wanted <= neighbours(node))


def test_one_machine_of_a_network_gets_one_place_of_a_view_on_sockets(context):
    """Greeters of one /24 (network grouping): two identities of one machine get one
    place, another machine of that network the second, a third machine none."""
    limits = Limits("network", neighbours=2, candidates=3, per_source=3)
    node = _endpoint("node", host="127.0.1.1", views=replace(SMALL_VIEWS, limits=limits))
    try:
        node.start()

        def greet(name: str, host: str) -> RawPeer:
            greeter = RawPeer(context, node.contact, name=name, host=host)
            greeter.send(greeter.frames("hello", {"name": name, "addr": greeter.address}))
            return greeter

        first = greet("first", "127.0.0.3")
        assert poll_until(lambda: first.public_key in node.table.entries, 5)
        twin = greet("twin", "127.0.0.3")  # another identity of the same machine
        assert twin.expect("peers", 5).body["linked"] is False
        other = greet("other", "127.0.0.4")
        assert poll_until(lambda: other.public_key in node.table.entries, 5)
        third = greet("third", "127.0.0.5")  # the network holds its two places
        assert third.expect("peers", 5).body["linked"] is False
        assert node.flow_rejections["group_full"] == 2 and len(node.table.entries) == 2
    finally:
        node.close()
