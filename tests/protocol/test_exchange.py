"""Blobs between live endpoints (protocol/exchange.py, offers.py): announce, fetch,
verify and hold; caps on fetches in flight; offers for late joiners; misses, evictions
and what a node forgets."""

from __future__ import annotations

import time

import numpy as np

from meshfl.protocol.exchange import FetchRecord
from meshfl.protocol.identity import verify
from meshfl.protocol.offers import Offer
from meshfl.protocol.wire import (
    RECORD_CONTEXT,
    announce_body,
    frames_digest,
    make_blob,
)
from tests.protocol.endpoints import (
    SCHEMA,
    WAIT,
    RawPeer,
    delivered,
    hand_made_blob,
    joined_pair,
    model_arrays,
    poll_until,
    small_blob,
)


def test_publish_announce_fetch_delivers_the_verified_blob(make_endpoint):
    a, b = joined_pair(make_endpoint)
    arrays = model_arrays(1)
    blob = make_blob(a.identity, 1, "model", arrays, schema=SCHEMA, meta={"samples": 10})
    a.publish(blob)

    asked = time.monotonic()
    offers = b.wait_offers(1, {"model"}, {a.identity.public_key}, asked + WAIT)
    assert time.monotonic() - asked < WAIT / 2  # returns once the origin announced
    assert [(o.id, o.origin, o.round, o.kind, o.digest, o.size, o.holders) for o in offers] == [
        (
            blob.id,
            a.identity.public_key,
            1,
            "model",
            blob.digest,
            blob.size,
            [a.identity.public_key],
        )
    ]
    assert b.offers(1, "head") == []

    b.fetch(offers)
    got = b.wait_blobs([blob.id], time.monotonic() + WAIT)
    assert list(got) == [blob.id]
    fetched = got[blob.id]
    assert fetched.origin == a.identity.public_key and fetched.meta == {"samples": 10}
    assert verify(a.identity.public_key, fetched.signature, RECORD_CONTEXT + fetched.record)
    assert frames_digest(fetched.frames) == blob.digest
    for name, array in fetched.arrays().items():
        np.testing.assert_array_equal(array, arrays[name])
        assert array.shape == arrays[name].shape
    assert b.blobs.fetch_log == [FetchRecord(a.id, 1, "model", blob.size, "a")]
    assert b.stats()["fetched"] == 1 and a.received["fetch"] == 1

    b.fetch(offers)  # already held: nothing is fetched again
    assert not poll_until(lambda: a.received["fetch"] > 1, 0.3)


def test_a_node_serves_a_blob_it_fetched_to_a_third_node(make_endpoint):
    origin, relay = joined_pair(make_endpoint)
    blob = make_blob(origin.identity, 2, "model", model_arrays(2), schema=SCHEMA)
    origin.set_round(2)
    origin.publish(blob)
    offers = relay.wait_offers(2, {"model"}, {origin.identity.public_key}, time.monotonic() + WAIT)
    relay.fetch(offers)
    assert blob.id in relay.wait_blobs([blob.id], time.monotonic() + WAIT)

    origin.close()  # the origin is gone; only the relay holds the blob now
    assert poll_until(lambda: relay.alive_peers() == [])
    late = make_endpoint("late")
    late.start([relay.contact])
    assert late.wait_joined(WAIT) and late.wait_for_peers(1, WAIT)
    assert origin.identity.public_key not in [e.public_key for e in late.peers()]

    late.fetch(
        [
            Offer(
                blob.id,
                origin.identity.public_key,
                2,
                "model",
                blob.digest,
                blob.size,
                holders=[relay.identity.public_key],
            )
        ]
    )
    got = late.wait_blobs([blob.id], time.monotonic() + WAIT)
    assert list(got) == [blob.id]
    relayed = got[blob.id]
    # Sent by the relay, still signed by the origin, and checked by late's decoder.
    assert relayed.origin == origin.identity.public_key
    assert verify(origin.identity.public_key, relayed.signature, RECORD_CONTEXT + relayed.record)
    for name, array in relayed.arrays().items():
        np.testing.assert_array_equal(array, model_arrays(2)[name])
    assert late.blobs.fetch_log == [FetchRecord(origin.id, 2, "model", blob.size, "b")]
    assert late.decoder.rejections == {}


def test_fetches_in_flight_per_peer_are_capped(context, make_endpoint):
    endpoint = make_endpoint("puller", max_inflight=2, heartbeat_interval=5.0)
    endpoint.start()
    holder = RawPeer(context, endpoint.contact, name="holder")
    holder.join()
    blobs = [small_blob(holder.identity, w=np.full(64, i, dtype=np.float32)) for i in range(5)]
    by_id = {blob.id: blob for blob in blobs}
    for blob in blobs:
        holder.send(holder.frames("announce", announce_body(blob), round_no=1))
    holder.join()
    offers = endpoint.offers(1, "model")
    assert len(offers) == 5

    endpoint.fetch(offers)
    asked = [m.body["id"] for m in holder.collect("fetch", 0.5)]
    assert len(asked) == 2  # the cap, and not one more while none is answered
    with endpoint.lock:
        assert len(endpoint.blobs.fetches.in_flight[holder.public_key]) == 2
        assert len(endpoint.blobs.fetches.waiting[holder.public_key]) == 3

    served: list[bytes] = []
    while asked:
        blob_id = asked.pop(0)
        holder.send(holder.frames("blob", {}, round_no=1, blob=by_id[blob_id]))
        served.append(blob_id)
        more = [m.body["id"] for m in holder.collect("fetch", 0.3)]
        assert len(more) == (1 if len(served) + len(asked) < 5 else 0)
        asked += more
        assert len(asked) <= 2
    assert sorted(served) == sorted(by_id)  # each asked for exactly once

    got = endpoint.wait_blobs(by_id, time.monotonic() + WAIT)
    assert set(got) == set(by_id)
    assert len(endpoint.blobs.fetch_log) == 5
    with endpoint.lock:
        assert not endpoint.blobs.fetches.in_flight[holder.public_key]
        assert not endpoint.blobs.fetches.waiting[holder.public_key]


def test_equal_tensors_from_two_origins_are_two_blobs_and_a_third_node_fetches_both(make_endpoint):
    # After FedAvg several nodes hold bit-identical models: same digest, different records.
    puller = make_endpoint("puller")
    puller.start()
    origins = [make_endpoint(name) for name in ("first", "second")]
    for origin in origins:
        origin.start([puller.contact])
    for endpoint in [puller, *origins]:
        assert endpoint.wait_for_peers(2, WAIT), endpoint.settings.name
    blobs = [
        make_blob(origin.identity, 1, "model", model_arrays(3), schema=SCHEMA) for origin in origins
    ]
    assert blobs[0].digest == blobs[1].digest and blobs[0].id != blobs[1].id
    for origin, blob in zip(origins, blobs, strict=True):
        origin.publish(blob)

    keys = {origin.identity.public_key for origin in origins}
    offers = puller.wait_offers(1, {"model"}, keys, time.monotonic() + WAIT)
    assert sorted((o.origin, o.id) for o in offers) == sorted((b.origin, b.id) for b in blobs)
    puller.fetch(offers)
    got = puller.wait_blobs([blob.id for blob in blobs], time.monotonic() + WAIT)
    assert {blob_id: blob.origin for blob_id, blob in got.items()} == {
        blob.id: blob.origin for blob in blobs
    }
    pulled = sorted(record.origin for record in puller.blobs.fetch_log)
    assert pulled == sorted(o.id for o in origins)
    assert all(origin.received["fetch"] == 1 for origin in origins), "each asked its own"


def test_a_blob_whose_record_contradicts_its_announce_is_rejected_and_counted(scene):
    endpoint, liar = scene.endpoint, scene.raw
    blob = small_blob(scene.origin)  # genuinely `origin`'s, announced as the liar's own
    claim = {**announce_body(blob), "origin": liar.public_key}
    liar.send(liar.frames("announce", claim, round_no=1))
    liar.join()
    (offer,) = endpoint.offers(1, "model")
    assert offer.origin == liar.public_key
    before = delivered(endpoint)

    endpoint.fetch([offer])
    assert liar.expect("fetch").body == {"id": blob.id}
    liar.send(liar.frames("blob", {}, round_no=1, blob=blob))
    liar.join()  # still serving

    assert endpoint.rejections().get("offer_mismatch") == 1
    assert endpoint.stats()["rejections"]["offer_mismatch"] == 1
    after = delivered(endpoint)
    assert (after["store"], after["fetched"]) == (before["store"], before["fetched"])
    assert endpoint.offers(1) == [], "the lying offer is dropped, not fetched again"
    with endpoint.lock:
        assert not endpoint.blobs.fetches.requested(blob.id), "its fetch slot is free again"

    # A truthful announce of the same blob is taken, and the blob with it.
    liar.send(liar.frames("announce", announce_body(blob), round_no=1))
    liar.join()
    (offer,) = endpoint.offers(1, "model")
    assert offer.origin == scene.origin.public_key
    endpoint.fetch([offer])
    assert liar.expect("fetch").body == {"id": blob.id}
    liar.send(liar.frames("blob", {}, round_no=1, blob=blob))
    assert list(endpoint.wait_blobs([blob.id], time.monotonic() + WAIT)) == [blob.id]
    assert endpoint.rejections()["offer_mismatch"] == 1


# --- a peer that lags behind never waits in vain; what left is what counts -----------


def test_a_peer_behind_that_fetches_an_evicted_blob_goes_on_within_a_heartbeat(make_endpoint):
    interval = 0.5
    arrays = model_arrays(1)
    size = sum(array.nbytes for array in arrays.values())
    origin, lagging = joined_pair(
        make_endpoint, store_bytes=int(1.5 * size), heartbeat_interval=interval
    )
    early = make_blob(origin.identity, 1, "model", arrays, schema=SCHEMA)
    origin.publish(early)
    (offer,) = lagging.wait_offers(
        1, {"model"}, {origin.identity.public_key}, time.monotonic() + WAIT
    )
    origin.set_round(3)
    origin.publish(make_blob(origin.identity, 3, "model", model_arrays(3), schema=SCHEMA))
    assert early.id not in origin.blobs.store, "evicted: the store holds one model's bytes"

    asked = time.monotonic()
    lagging.fetch([offer])
    assert poll_until(lambda: not lagging.may_come(offer), WAIT)
    waited = time.monotonic() - asked
    assert waited < interval, f"told within {waited:.2f} s, not after a deadline"
    assert origin.received["fetch_miss"] == 1 and lagging.received["miss"] == 1
    assert not lagging.blobs.fetches.in_flight[origin.identity.public_key], "its slot is free"


def test_a_miss_sends_the_fetch_to_the_next_holder(make_endpoint):
    origin, relay = joined_pair(make_endpoint)
    third = make_endpoint("c")
    third.start([origin.contact])
    assert third.wait_for_peers(2, WAIT) and relay.wait_for_peers(2, WAIT)
    blob = make_blob(origin.identity, 1, "model", model_arrays(1), schema=SCHEMA)
    origin.publish(blob)
    (offer,) = relay.wait_offers(
        1, {"model"}, {origin.identity.public_key}, time.monotonic() + WAIT
    )
    relay.fetch([offer])
    assert relay.wait_blobs([blob.id], time.monotonic() + WAIT)
    relay.publish(relay.blobs.store.get(blob.id))  # the relay announces what it holds
    assert poll_until(lambda: len(getattr(third.blobs.offer_book.get(blob.id), "holders", [])) == 2)
    origin.blobs.store._blobs.clear()  # the origin lost it (evicted, say)
    origin.blobs.store.bytes = 0

    third.fetch([third.blobs.offer_book.get(blob.id)])
    assert third.wait_blobs([blob.id], time.monotonic() + WAIT), "fetched from the relay"
    assert third.blobs.fetch_log[-1].holder == "b"


def test_a_broken_blob_answer_counts_as_a_miss_and_the_round_stops_waiting(context, make_endpoint):
    # A holder whose answer fails decoding after its header signature (here the index
    # lies about a tensor's size) would otherwise hold the fetch until fetch_timeout.
    endpoint = make_endpoint("puller", fetch_timeout=60.0)
    endpoint.start()
    holder = RawPeer(context, endpoint.contact, name="holder")
    holder.join()
    broken = hand_made_blob(holder.identity, [bytes(20)], [["w", "float32", [4], 16]])
    holder.send(holder.frames("announce", announce_body(broken), round_no=1))
    holder.join()
    (offer,) = endpoint.offers(1, "model")

    endpoint.fetch([offer])
    assert holder.expect("fetch").body == {"id": broken.id}
    asked = time.monotonic()
    holder.send(holder.frames("blob", {}, round_no=1, blob=broken))
    assert poll_until(lambda: not endpoint.may_come(offer), WAIT)
    assert time.monotonic() - asked < 2.0, "told by the answer, not after a deadline"
    assert endpoint.rejections()["shape_mismatch"] == 1
    with endpoint.lock:
        assert not endpoint.blobs.fetches.requested(broken.id), "its fetch slot is free again"


def test_a_fetched_blob_taken_in_is_forgotten_but_never_our_own(make_endpoint):
    origin, taker = joined_pair(make_endpoint)
    theirs = make_blob(origin.identity, 2, "model", model_arrays(2), schema=SCHEMA)
    ours = make_blob(taker.identity, 2, "model", model_arrays(3), schema=SCHEMA)
    origin.set_round(2)
    taker.set_round(2)
    origin.publish(theirs)
    taker.publish(ours)
    offers = taker.wait_offers(2, {"model"}, {origin.identity.public_key}, time.monotonic() + WAIT)
    taker.fetch(offers)
    assert theirs.id in taker.wait_blobs([theirs.id], time.monotonic() + WAIT)
    taker.forget_fetched([theirs.id, ours.id])
    assert taker.held([theirs.id, ours.id]) == {ours.id: ours}
    assert taker.blobs.store.bytes == ours.size


def test_a_node_keeps_its_own_blobs_one_round_past_theirs(make_endpoint):
    # A peer one round behind still fetches them; one further behind skips ahead.
    node = make_endpoint("a")
    for round_no in range(1, 11):
        node.set_round(round_no)
        node.publish(make_blob(node.identity, round_no, "model", model_arrays(0), schema=SCHEMA))
    kept = sorted(blob.round for blob in node.blobs.store._blobs.values())
    assert kept == [9, 10]
