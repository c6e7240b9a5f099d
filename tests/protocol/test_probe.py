"""`meshfl status` answers (protocol/probe.py): a live endpoint answers a probe, checks
it like any message, answers only listed keys in a closed mesh, and limits its rate."""

from __future__ import annotations

import pytest

from meshfl.protocol.identity import Identity
from meshfl.protocol.membership import ALIVE
from meshfl.protocol.probe import ask_status
from tests.protocol.endpoints import (
    MESH,
    OTHER_MESH,
    WAIT,
    joined_pair,
)

pytestmark = pytest.mark.sockets  # a probe asks over sockets of its own

# --- status -------------------------------------------------------------------------


def test_a_node_answers_a_status_probe_and_does_not_take_it_for_a_peer(make_endpoint):
    node, peer = joined_pair(make_endpoint)
    node.status_extra = lambda: {"accuracies": [{"round": 1, "test_acc": 0.5}]}
    answer = ask_status(Identity.generate(), node.contact, "127.0.0.1", WAIT)
    assert answer is not None
    assert (answer.sender, answer.node_id, answer.mesh_id) == (
        node.identity.public_key,
        node.id,
        MESH,
    )
    status = answer.status
    assert (status["name"], status["addr"], status["round"]) == ("a", node.settings.listen, 0)
    (listed,) = status["peers"]
    assert (listed["name"], listed["id"], listed["state"]) == ("b", peer.id, ALIVE)
    assert 0 <= listed["last_seen_s"] < node.settings.peer_timeout
    assert status["accuracies"] == [{"round": 1, "test_acc": 0.5}]
    assert status["rejections"] == {}
    assert [entry.public_key for entry in node.peers()] == [peer.identity.public_key]


def test_a_status_request_is_checked_like_any_message(make_endpoint):
    node = make_endpoint("node")
    node.start()
    wrong_mesh = ask_status(Identity.generate(), node.contact, "127.0.0.1", 0.5, mesh_id=OTHER_MESH)
    assert wrong_mesh is None and node.rejections() == {"wrong_mesh": 1}
    assert (
        ask_status(Identity.generate(), node.contact, "127.0.0.1", WAIT, mesh_id=MESH) is not None
    ), "the mesh's own id is fine too"


def test_a_closed_mesh_answers_status_only_to_listed_keys_even_one_in_use(scene):
    endpoint, raw = scene.endpoint, scene.raw
    address = endpoint.contact
    assert ask_status(scene.stranger, address, "127.0.0.1", 0.5) is None
    # Encrypted, the stranger's key is turned away at the handshake: nothing is decoded.
    assert endpoint.rejections()["refused_handshake"] >= 1
    assert "unknown_sender" not in endpoint.rejections()
    unencrypted = ask_status(scene.stranger, endpoint.settings.listen, "127.0.0.1", 0.5)
    assert unencrypted is None and "unknown_sender" not in endpoint.rejections()
    # The operator may sign with a listed key whose node is live: that is no twin, and
    # the probe's clock-based number must not make the live node's messages replays.
    answer = ask_status(raw.identity, address, "127.0.0.1", WAIT)
    assert answer is not None and answer.node_id == endpoint.id
    raw.join()
    assert set(endpoint.rejections()) == {"refused_handshake"}


def test_status_answers_are_rate_limited(make_endpoint):
    node = make_endpoint("node", status_per_second=2)
    node.status_answers.limit.period = 60.0  # so that a slow machine cannot spread the asks out
    node.start()
    answers = [ask_status(Identity.generate(), node.contact, "127.0.0.1", 1.0) for _ in range(3)]
    assert [answer is not None for answer in answers] == [True, True, False]
    assert node.received["status_unanswered"] == 1
