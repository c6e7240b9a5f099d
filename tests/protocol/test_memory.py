"""The in-process network (memory.py): what the endpoint reads of a transport holds as
on sockets, so that tests on it say what they would say over ZeroMQ."""

from __future__ import annotations

import queue

import pytest

from meshfl.protocol.identity import Identity
from meshfl.protocol.memory import MemoryNetwork, MemoryTransport
from meshfl.protocol.transport import Encryption, TransportError, TransportOptions
from tests.protocol.endpoints import WAIT, joined_pair, memory_address, poll_until


@pytest.fixture
def network():
    made = MemoryNetwork()
    yield made
    made.close()


def keys(identity: Identity, admit=None) -> Encryption:
    return Encryption(identity.curve_public_key, identity.curve_secret_key, admit)


def read(transport: MemoryTransport) -> list[bytes]:
    """The first frame of each message that arrived, in order."""
    got = []
    while True:
        try:
            received = transport.inbox.get(timeout=0.2)
        except queue.Empty:
            return got
        if received is not None:
            got.append(bytes(received.frames[0]))


def test_messages_wait_for_a_listener_and_arrive_in_order_once_it_binds(network):
    sender = network.transport(memory_address(), TransportOptions())
    address = memory_address()
    for n in range(3):
        sender.send(address, [b"m%d" % n])
    assert network.settle(WAIT)
    assert sender.unheard == {address} and sender.unheard_count == 1
    receiver = network.transport(address, TransportOptions())
    assert network.settle(WAIT)
    assert read(receiver) == [b"m0", b"m1", b"m2"]
    assert sender.reached == {address: None} and not sender.unheard
    assert sender.bytes_out == receiver.bytes_in == 6


def test_a_second_transport_at_a_taken_address_is_refused(network):
    address = memory_address()
    network.transport(address, TransportOptions())
    with pytest.raises(TransportError, match="port in use"):
        network.transport(address, TransportOptions())


def test_only_the_key_of_the_node_there_makes_a_connection(network):
    ours, theirs, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    sender = network.transport(memory_address(), TransportOptions(), keys(ours))
    address = memory_address()
    receiver = network.transport(address, TransportOptions(), keys(theirs))
    sender.send(address, [b"wrong key"], stranger.curve_public_key)
    assert network.settle(WAIT)
    assert read(receiver) == [] and sender.failed_handshakes[address] == 1
    sender.send(address, [b"right key"], theirs.curve_public_key)
    assert network.settle(WAIT)
    assert read(receiver) == [b"right key"]
    assert sender.reached == {address: theirs.curve_public_key}


def test_a_closed_mesh_refuses_a_key_it_does_not_list(network):
    ours, theirs = Identity.generate(), Identity.generate()
    sender = network.transport(memory_address(), TransportOptions(), keys(ours))
    address = memory_address()
    receiver = network.transport(address, TransportOptions(), keys(theirs, admit=lambda k: False))
    sender.send(address, [b"hello"], theirs.curve_public_key)
    assert network.settle(WAIT)
    assert read(receiver) == [] and receiver.refused_handshakes == 1 and not sender.reached


def test_a_big_message_the_screen_refuses_never_reaches_the_inbox(network):
    options = TransportOptions(screen_bytes=100)
    seen = []
    address = memory_address()
    receiver = network.transport(address, options, screen=lambda frames: seen.append(1) or False)
    sender = network.transport(memory_address(), options)
    sender.send(address, [b"x" * 50])
    sender.send(address, [b"y" * 200])
    assert network.settle(WAIT)
    assert read(receiver) == [b"x" * 50] and seen == [1]
    assert receiver.bytes_in == 250  # read, then dropped


def test_the_endpoints_a_protocol_test_makes_join_over_the_network_not_sockets(make_endpoint):
    node, peer = joined_pair(make_endpoint)
    assert isinstance(node.transport, MemoryTransport)  # no socket anywhere
    assert poll_until(lambda: node.transport.reached and peer.transport.reached)
