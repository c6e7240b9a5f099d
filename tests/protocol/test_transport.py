"""The transport (protocol/transport.py) as a node relies on it: what it could not send
is counted as dropped, not as sent, and is no sign of life."""

from __future__ import annotations

import time

import pytest

from meshfl.protocol.transport import TransportOptions
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
