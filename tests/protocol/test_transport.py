"""The transport (protocol/transport.py) as a node relies on it: what it could not send
is counted as dropped, not as sent, and is no sign of life; the ports a launcher picks
for its nodes are still free when the nodes bind them."""

from __future__ import annotations

import socket
import time

import pytest

from meshfl.protocol import transport
from meshfl.protocol.errors import UserError
from meshfl.protocol.transport import TransportOptions, ephemeral_ports_start, free_ports
from meshfl.protocol.wire import make_blob
from tests.protocol.endpoints import RawPeer, model_arrays, poll_until

pytestmark = pytest.mark.sockets  # the socket transport itself


def test_messages_dropped_at_the_high_water_mark_are_not_counted_as_sent(context, make_endpoint):
    endpoint = make_endpoint("sender", transport=TransportOptions(send_hwm=2))
    endpoint.start()
    peer = RawPeer(context, endpoint.contact)
    peer.join()
    peer.inbox.close(linger=0)  # the peer is gone: nothing it was sent leaves any more
    peer.out.close(linger=0)
    time.sleep(0.3)
    queued = 40
    for round_no in range(1, queued + 1):
        endpoint.publish(make_blob(endpoint.identity, round_no, "model", model_arrays(0)))
    assert poll_until(lambda: endpoint.transport.dropped >= queued - 10)
    sent = endpoint.stats()["bytes_sent_by_kind"]["announce"]
    one = sent / (queued - endpoint.transport.dropped)
    assert 50 < one < 500, "bytes of the announces that left, each counted once"
    left = endpoint.transport.last_proof_of_life[peer.address]
    endpoint.publish(make_blob(endpoint.identity, 99, "model", model_arrays(0)))
    time.sleep(0.2)
    assert endpoint.transport.last_proof_of_life[peer.address] == left, "dropped: no sign of life"


def test_picked_ports_differ_lie_below_the_ephemeral_range_and_are_free():
    # Below the range the OS lends outgoing connections, so the dialling of a mesh's
    # first nodes cannot take a port a later node is about to bind; never handed twice,
    # so two meshes started one after the other cannot share one.
    first, second = free_ports(50), free_ports(50)
    picked = first + second
    assert len(set(picked)) == len(picked)
    assert all(port < ephemeral_ports_start() for port in picked)
    for port in picked:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", port))


def test_a_port_is_handed_out_again_only_once_its_node_had_time_to_bind_it(monkeypatch):
    # 1,000 ports to pick from, each handed out at most once within HANDED_OUT_S: a
    # second mesh of 900 does not fit, until the first mesh's ports are old enough.
    lowest = transport.LOWEST_PICKED_PORT + 5000
    monkeypatch.setattr(transport, "LOWEST_PICKED_PORT", lowest)
    monkeypatch.setattr(transport, "ephemeral_ports_start", lambda: lowest + 1000)
    first = free_ports(900)
    with pytest.raises(UserError, match="listening ports are free"):
        free_ports(900)
    monkeypatch.setattr(transport, "HANDED_OUT_S", 0.0)
    assert set(free_ports(900)) & set(first)
