"""Who is alive (protocol/liveness.py, and membership.py's stretch): silent peers marked
down in time and not for a node's own lateness, waits that stretch with the mesh, and
heartbeats that give way to other messages but never stop."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time

from meshfl.protocol.liveness import BEAT_ANYWAY_PERIODS
from meshfl.protocol.membership import (
    ALIVE,
    DOWN,
    HEARTBEAT_FANOUT,
    PeerTable,
    liveness_stretch,
)
from meshfl.protocol.ports import free_ports
from meshfl.protocol.wire import make_blob
from tests.protocol.endpoints import (
    SCHEMA,
    RawPeer,
    model_arrays,
    poll_until,
)


def test_a_silent_peer_is_marked_down_within_timeout_plus_one_interval(context, make_endpoint):
    interval, timeout = 0.1, 0.8
    endpoint = make_endpoint("watcher", heartbeat_interval=interval, peer_timeout=timeout)
    endpoint.start()
    raw = RawPeer(context, endpoint.contact)
    sent = time.monotonic()
    raw.join()
    answered = time.monotonic()

    def state() -> str:
        return next(e.state for e in endpoint.peers() if e.public_key == raw.public_key)

    assert state() == ALIVE
    assert poll_until(lambda: state() == DOWN, timeout + interval + 2.0)
    down = time.monotonic()
    assert down - sent >= timeout  # not before the timeout...
    assert down - answered <= timeout + interval + 0.5  # ...and not much after it
    assert raw.public_key not in [e.public_key for e in endpoint.alive_peers()]

    raw.send(raw.frames("heartbeat", {}))  # a down peer that speaks is alive again
    assert poll_until(lambda: state() == ALIVE)


def peers_beat_while(context, make_endpoint, caplog, held_up) -> None:
    """Two peers heartbeat a node for three timeouts while `held_up(endpoint)` holds part
    of it up; a few ticks after, within the timeout, both are alive and none was ever
    logged down: the node does not blame its peers for its own delay."""
    interval, timeout = 0.1, 0.5
    endpoint = make_endpoint("busy", heartbeat_interval=interval, peer_timeout=timeout)
    endpoint.start()
    peers = [RawPeer(context, endpoint.contact, name=f"raw{i}") for i in range(2)]
    for peer in peers:
        peer.join()
    # Both reached before the hold-up: a peer still unreached when it begins is forgotten
    # after its grace (WIRE.md 7.3), which on a loaded machine a slow handshake outlasted.
    assert poll_until(lambda: sum(e.reached for e in endpoint.peers()) == len(peers))
    with caplog.at_level(logging.WARNING, logger="meshfl.endpoint"):
        with held_up(endpoint):
            for _ in range(15):
                for peer in peers:
                    peer.send(peer.frames("heartbeat", {}))
                time.sleep(timeout / 5)
        time.sleep(2 * interval)
        assert [e.state for e in endpoint.peers()] == [ALIVE, ALIVE]
    assert "is down" not in caplog.text


def test_a_node_that_reads_its_inbox_late_does_not_blame_its_peers(context, make_endpoint, caplog):
    # The node's worker is held up (a busy process): the heartbeats wait in its inbox.
    peers_beat_while(context, make_endpoint, caplog, lambda endpoint: endpoint.lock)


@contextlib.contextmanager
def socket_unread(endpoint):
    """The transport's I/O thread held up (its turn at a busy host's GIL): heartbeats
    wait unread in ZeroMQ, and the worker finds its inbox empty."""
    go_on = threading.Event()
    read = endpoint.transport._receive_some
    endpoint.transport._receive_some = lambda: (go_on.wait(10), read())
    try:
        yield
    finally:
        endpoint.transport._receive_some = read
        go_on.set()


def test_a_node_whose_socket_is_read_late_does_not_blame_its_peers(context, make_endpoint, caplog):
    peers_beat_while(context, make_endpoint, caplog, socket_unread)


def test_liveness_waits_stretch_with_the_most_peers_a_node_has_known():
    assert liveness_stretch(5) == 1.0 and liveness_stretch(HEARTBEAT_FANOUT) == 1.0
    assert liveness_stretch(100) == 100 / HEARTBEAT_FANOUT
    now = [0.0]
    table = PeerTable(timeout=5.0, clock=lambda: now[0])
    keys = [bytes([index]) * 32 for index in range(100)]
    for index, key in enumerate(keys):
        table.upsert(key, f"n{index}", f"tcp://h:{index}", b"i" * 16)
        assert table.known() == index, "a peer counts once a handshake reached it"
        table.mark_reached(key)
    for key in keys[5:]:
        table.mark_left(key)  # the others still beat at the pace of a 100-node mesh
    assert table.known() == 100
    now[0] = 5.0 * 9.9  # silent for longer than the timeout, less than it stretched
    assert table.expire() == []
    now[0] = 5.0 * 10.1
    assert len(table.expire()) == 5


def test_a_peer_whose_handshake_took_longer_than_the_timeout_is_not_down_when_it_answers():
    now = [0.0]
    table = PeerTable(timeout=5.0, clock=lambda: now[0])
    table.upsert(b"k" * 32, "n", "tcp://h:1", b"i" * 16)  # named by a contact
    now[0] = 12.0  # the handshake completes long after
    table.mark_reached(b"k" * 32)
    assert table.expire() == [], "it answered just now"
    now[0] = 12.0 + 5.1
    assert len(table.expire()) == 1, "silent for the timeout since"


def test_a_node_sharing_its_process_with_many_waits_as_long_as_a_node_with_as_many_peers():
    now = [0.0]
    table = PeerTable(timeout=5.0, clock=lambda: now[0], crowd=50)
    table.upsert(b"k" * 32, "n", "tcp://h:1", b"i" * 16)
    table.mark_reached(b"k" * 32)
    assert table.stretch() == 5.0, "50 nodes in one process: a fifth of fifty peers' pace"
    now[0] = 5.0 * 4.9
    assert table.expire() == []
    now[0] = 5.0 * 5.1
    assert len(table.expire()) == 1


def test_a_node_starting_in_a_big_mesh_takes_its_size_from_its_bootstrap_list(make_endpoint):
    endpoint = make_endpoint("starting")
    endpoint.start([f"tcp://127.0.0.1:{port}" for port in free_ports(30)])
    assert endpoint.table.known() == 30


@contextlib.contextmanager
def announcing(endpoint, interval: float):
    """`endpoint` announcing a new blob twice a heartbeat `interval`, while it lasts."""
    stop = threading.Event()

    def announce_every_tick() -> None:
        for round_no in itertools.count(1):
            if stop.wait(interval / 2):
                return
            arrays = model_arrays(round_no)
            endpoint.publish(make_blob(endpoint.identity, 1, "model", arrays, schema=SCHEMA))

    announcer = threading.Thread(target=announce_every_tick)
    announcer.start()
    try:
        yield
    finally:
        stop.set()
        announcer.join()


def test_heartbeats_give_way_to_other_messages_but_never_stop(context, make_endpoint):
    interval = 0.1
    endpoint = make_endpoint("beater", heartbeat_interval=interval, peer_timeout=60.0)
    endpoint.start()
    raw = RawPeer(context, endpoint.contact)
    raw.join()
    idle = raw.collect("heartbeat", 20 * interval)
    with announcing(endpoint, interval):
        busy = raw.collect("heartbeat", 20 * interval)
    assert len(idle) >= 12, "about one a tick while nothing else is sent"
    assert 1 <= len(busy) <= 20 // BEAT_ANYWAY_PERIODS + 2, "one every few ticks when busy"


def test_a_peer_just_met_gets_no_heartbeat_while_other_messages_go_to_it(context, make_endpoint):
    """The hello that met it made us known as a heartbeat would: where views change
    often, a heartbeat at once each way was a third of a mesh's heartbeats."""
    interval = 0.1
    endpoint = make_endpoint("beater", heartbeat_interval=interval, peer_timeout=60.0)
    endpoint.start()
    with announcing(endpoint, interval):
        raw = RawPeer(context, endpoint.contact)
        raw.join()
        early = raw.collect("heartbeat", (BEAT_ANYWAY_PERIODS - 2) * interval)
        later = raw.collect("heartbeat", 4 * interval)
    assert early == [], "none in the first periods after the hello"
    assert later, "then one anyway"
