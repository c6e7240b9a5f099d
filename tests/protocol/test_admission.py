"""Whom an endpoint lets in (protocol/admission.py): nodes of another mesh are kept
apart, yet each side learns what the other mesh is, from a signed `about` only."""

from __future__ import annotations

import time

import msgpack

from meshfl.protocol.identity import Identity
from meshfl.protocol.parts import OtherMesh
from meshfl.protocol.wire import (
    HEADER_CONTEXT,
)
from tests.protocol.endpoints import (
    OTHER_MESH,
    WAIT,
    RawPeer,
    poll_until,
)


def test_nodes_of_two_meshes_tell_each_other_what_their_mesh_is_and_stay_apart(make_endpoint):
    """A hello to a node of another mesh is dropped, yet its signed `about` is noted, and
    answered once with the receiver's own, so that both sides can say how the meshes
    differ (WIRE.md 7.8); a joiner that asked to learn it stops waiting at once."""
    ours = make_endpoint("alpha", about={"task": "cnn.py", "classes": 10})
    theirs = make_endpoint("beta", mesh=OTHER_MESH, about={"task": "mlp.py", "classes": 10})
    told: list[OtherMesh] = []
    ours.on_other_mesh = told.append
    ours.start()
    theirs.start([ours.contact])
    started = time.monotonic()
    assert theirs.wait_joined(WAIT, until_other_mesh=True) is False
    assert time.monotonic() - started < WAIT / 2
    assert told == [OtherMesh("beta", theirs.address, {"task": "mlp.py", "classes": 10})]
    assert list(theirs.other_meshes.values()) == [
        OtherMesh("alpha", ours.address, {"task": "cnn.py", "classes": 10})
    ]
    assert not ours.peers() and not theirs.peers()
    time.sleep(0.5)  # each answered once: no hello goes back and forth
    assert ours.rejections()["wrong_mesh"] == theirs.rejections()["wrong_mesh"] == 1


def test_an_about_unsigned_or_not_a_short_map_of_text_is_not_noted(make_endpoint, context):
    endpoint = make_endpoint(about={"task": "cnn.py"})
    endpoint.start()
    raw = RawPeer(context, endpoint.contact)
    for about in ({"task": "x" * 257}, {"task": [1]}, ["task"], {str(i): i for i in range(17)}):
        body = {"name": "raw", "addr": raw.address, "about": about}
        raw.send(raw.frames("hello", body, mesh=OTHER_MESH))
    signed = raw.frames(
        "hello", {"name": "raw", "addr": raw.address, "about": {"task": "a"}}, mesh=OTHER_MESH
    )
    header_bytes, _ = msgpack.unpackb(signed[0])
    forged = Identity.generate().sign(HEADER_CONTEXT + header_bytes)
    raw.send([msgpack.packb([header_bytes, forged])])
    assert poll_until(lambda: endpoint.rejections() == {"bad_header": 4, "wrong_mesh": 1})
    assert not endpoint.other_meshes
    assert raw.collect("hello", 0.3) == []
