"""What a node is offered (protocol/offers.py through live endpoints): the latest round
announced again to a node that joins late, and kept for one far behind until it takes
the mesh's round."""

from __future__ import annotations

import time

from meshfl.protocol.wire import make_blob
from tests.protocol.endpoints import SCHEMA, WAIT, model_arrays, poll_until


def test_a_late_joiner_is_offered_the_latest_round_published_before_it_came(make_endpoint):
    origin = make_endpoint("origin")
    origin.start()
    old, latest = (
        make_blob(origin.identity, round_no, "model", model_arrays(round_no), schema=SCHEMA)
        for round_no in (1, 2)
    )
    origin.publish(old)
    origin.set_round(2)
    origin.publish(latest)  # announced to nobody: nobody is there yet

    late = make_endpoint("late")
    late.start([origin.contact])
    assert late.wait_joined(WAIT) and late.wait_for_peers(1, WAIT)
    offers = late.wait_offers(2, {"model"}, {origin.identity.public_key}, time.monotonic() + WAIT)
    assert [offer.id for offer in offers] == [latest.id]
    assert late.offers(1) == [], "only the latest round is announced again"


def test_a_joiner_far_behind_gets_the_offers_once_it_takes_the_mesh_round(make_endpoint):
    origin = make_endpoint("origin")
    origin.start()
    origin.set_round(10)
    blob = make_blob(origin.identity, 10, "model", model_arrays(10), schema=SCHEMA)
    origin.publish(blob)

    late = make_endpoint("late")
    late.start([origin.contact])
    assert late.wait_joined(WAIT) and late.wait_for_peers(1, WAIT)
    # Round 10 is too far ahead of the joiner's round 0: that first announce is ignored.
    assert poll_until(lambda: late.received["ignored_announce"] == 1)
    assert late.offers(10) == []
    late.set_round(10)
    late.refresh_offers()
    offers = late.wait_offers(10, {"model"}, {origin.identity.public_key}, time.monotonic() + WAIT)
    assert [offer.id for offer in offers] == [blob.id]
