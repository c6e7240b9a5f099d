"""A live Endpoint over real ZeroMQ sockets on loopback: what it refuses, counts and
logs, and that it goes on serving (how it meets peers: test_handshake.py).

Hostile and broken messages are crafted by hand and sent from a raw DEALER; the
test side binds its own ROUTER to receive what the endpoint answers, so it can tell
that the node is still serving after each rejection.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter

import msgpack
import numpy as np
import pytest

from meshfl.protocol.views import MAX_CARDS
from meshfl.protocol.wire import (
    HEADER_CONTEXT,
    RECORD_CONTEXT,
    REJECTION_REASONS,
    encode,
    new_instance,
)
from tests.protocol.endpoints import (
    MESH,
    OTHER_MESH,
    RawPeer,
    blob_message,
    delivered,
    hand_made_blob,
    resign,
    small_blob,
    valid_header,
)


def craft_oversize(scene):
    big = np.zeros(20_000, dtype=np.float32)  # 80 kB > 64 kB: honest, just too big
    return blob_message(scene, small_blob(scene.raw.identity, w=big))


def craft_too_many_frames(scene):
    arrays = {f"t{i}": np.zeros(2, dtype=np.float32) for i in range(6)}  # 7 frames > 1 + 4
    return blob_message(scene, small_blob(scene.raw.identity, **arrays))


def craft_bad_msgpack(scene):
    return [b"\xc1"]  # 0xc1 is never used by msgpack


def craft_truncated_envelope(scene):
    return [scene.raw.hello()[0][:-20]]


def craft_bad_header_field(scene):
    header = valid_header(scene)
    header["seq"] = str(header["seq"])
    return resign(scene.raw.identity, header)


def craft_bad_header_kind(scene):
    header = valid_header(scene)
    header["kind"] = "gimme_your_keys"
    return resign(scene.raw.identity, header)


def craft_bad_header_body(scene):
    header = valid_header(scene, "announce", {"origin": scene.raw.public_key, "round": 1})
    return resign(scene.raw.identity, header)  # announce without kind/digest/size


def craft_wrong_mesh(scene):
    return scene.raw.frames("heartbeat", {}, mesh=OTHER_MESH)


def craft_unknown_sender(scene):
    body = {"name": "intruder", "addr": scene.raw.address}
    return scene.raw.frames("hello", body, identity=scene.stranger)


def craft_replay(scene):
    beat = scene.raw.frames("heartbeat", {})
    scene.raw.send(beat)  # the first copy is fine...
    scene.raw.join()
    return list(beat)  # ...the identical second one is a replay


def craft_bad_signature(scene):
    header_bytes, _ = msgpack.unpackb(scene.raw.frames("heartbeat", {})[0])
    forged = scene.stranger.sign(HEADER_CONTEXT + header_bytes)
    return [msgpack.packb([header_bytes, forged])]


def craft_bad_origin_signature(scene):
    # `raw` relays a blob claiming `origin` made it, but `raw` signed the record itself.
    genuine = small_blob(scene.origin)
    forged = dataclasses.replace(
        genuine, signature=scene.raw.identity.sign(RECORD_CONTEXT + genuine.record)
    )
    return blob_message(scene, forged)


def craft_digest_mismatch(scene):
    frames = blob_message(scene, small_blob(scene.origin))
    frames[1] = bytes([frames[1][0] ^ 0xFF]) + frames[1][1:]
    return frames


def craft_forbidden_dtype(scene):
    blob = hand_made_blob(scene.origin, [bytes(16)], [["w", "complex64", [2], 16]])
    return blob_message(scene, blob)


def craft_shape_mismatch(scene):
    # The index says four float32 (16 bytes); the frame holds 20.
    blob = hand_made_blob(scene.origin, [bytes(20)], [["w", "float32", [4], 16]])
    return blob_message(scene, blob)


def craft_duplicate_tensor(scene):
    # Two tensors named "w": read by name, the second would hide the first.
    index = [["w", "float32", [1], 4], ["w", "float32", [1], 4]]
    return blob_message(scene, hand_made_blob(scene.origin, [bytes(4), bytes(4)], index))


def craft_schema_mismatch(scene):
    return blob_message(scene, small_blob(scene.origin, schema=b"another model"))


def craft_duplicate_key(scene):
    # Signed with the endpoint's own key by another process (another instance).
    return encode(
        scene.endpoint.identity,
        MESH,
        "heartbeat",
        time.time_ns(),
        0,
        {"name": "twin", "addr": scene.raw.address},
        instance=new_instance(),
    )


# The neutral point of Edwards25519 as a public key, and a signature that verifies under it
# for any message (R the neutral point, S = 0): OpenSSL accepts it.
NEUTRAL_KEY = (1).to_bytes(32, "little")
ANY_MESSAGE_SIGNATURE = NEUTRAL_KEY + bytes(32)


def craft_weak_key(scene):
    header = valid_header(scene)
    header["from"] = NEUTRAL_KEY
    return [msgpack.packb([msgpack.packb(header), ANY_MESSAGE_SIGNATURE])]


def craft_bad_address(scene):
    return scene.raw.frames("hello", {"name": scene.raw.name, "addr": "garbage"})


def craft_too_many_cards(scene):
    return scene.raw.frames("shuffle", {"cards": [{}] * (MAX_CARDS + 1)})


CRAFTS = {
    "oversize": craft_oversize,
    "too_many_frames": craft_too_many_frames,
    "bad_msgpack": craft_bad_msgpack,
    "bad_msgpack-truncated": craft_truncated_envelope,
    "bad_header": craft_bad_header_field,
    "bad_header-unknown_kind": craft_bad_header_kind,
    "bad_header-body": craft_bad_header_body,
    "wrong_mesh": craft_wrong_mesh,
    "unknown_sender": craft_unknown_sender,
    "replay": craft_replay,
    "bad_signature": craft_bad_signature,
    "bad_origin_signature": craft_bad_origin_signature,
    "digest_mismatch": craft_digest_mismatch,
    "forbidden_dtype": craft_forbidden_dtype,
    "shape_mismatch": craft_shape_mismatch,
    "duplicate_tensor": craft_duplicate_tensor,
    "schema_mismatch": craft_schema_mismatch,
    "duplicate_key": craft_duplicate_key,
    "weak_key": craft_weak_key,
    "bad_address": craft_bad_address,
    "too_many_cards": craft_too_many_cards,
}


def test_every_rejection_reason_has_a_crafted_message():
    assert {case.split("-")[0] for case in CRAFTS} == set(REJECTION_REASONS)


@pytest.mark.parametrize("case", list(CRAFTS))
def test_rejected_message_is_counted_and_dropped_and_the_node_keeps_serving(scene, case):
    reason = case.split("-")[0]
    endpoint, raw = scene.endpoint, scene.raw
    bad = CRAFTS[case](scene)  # crafted now: its sequence number is the newest
    rejections_before = Counter(endpoint.decoder.rejections)
    before = delivered(endpoint)

    raw.send(bad)
    peers = raw.join()  # still serving: a valid hello sent afterwards is answered

    assert Counter(endpoint.decoder.rejections) - rejections_before == Counter({reason: 1})
    assert sum(endpoint.decoder.rejections.values()) == sum(rejections_before.values()) + 1
    after = delivered(endpoint)
    assert after["received"] - before["received"] == Counter({"hello": 1})
    assert {k: v for k, v in after.items() if k != "received"} == {
        k: v for k, v in before.items() if k != "received"
    }
    assert endpoint.stats()["rejections"][reason] >= 1
    listed = {item["key"] for item in peers.body["peers"]}
    assert scene.stranger.public_key not in listed
    assert endpoint.identity.public_key in listed and raw.public_key in listed


def test_replayed_frames_are_handled_once(scene):
    beat = scene.raw.frames("heartbeat", {})
    received = scene.endpoint.received["heartbeat"]
    for _ in range(3):
        scene.raw.send(beat)
    scene.raw.join()
    assert scene.endpoint.received["heartbeat"] == received + 1
    assert scene.endpoint.decoder.rejections["replay"] == 2


def test_rejections_are_logged_once_per_connection_and_reason(context, make_endpoint, caplog):
    caplog.set_level(logging.WARNING, logger="meshfl.endpoint")
    endpoint = make_endpoint("target")
    endpoint.start()
    raw = RawPeer(context, endpoint.contact)
    raw.join()
    bad = raw.frames("heartbeat", {}, mesh=OTHER_MESH)

    def logged() -> int:
        return sum(
            1
            for record in caplog.records
            if record.name == "meshfl.endpoint" and "(wrong_mesh)" in record.getMessage()
        )

    for _ in range(5):
        raw.send(bad)
    raw.join()
    assert endpoint.decoder.rejections["wrong_mesh"] == 5
    assert logged() == 1

    other = RawPeer(context, endpoint.contact, name="raw2")  # a second connection logs again
    other.send(bad)
    other.join()
    assert endpoint.decoder.rejections["wrong_mesh"] == 6
    assert logged() == 2
