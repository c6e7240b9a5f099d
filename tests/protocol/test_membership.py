"""Who is a peer (protocol/membership.py through a live Endpoint): peers that leave, a
node that is never its own peer, and names held by one key (who is alive:
test_liveness.py)."""

from __future__ import annotations

import time

from meshfl.protocol.identity import Identity
from meshfl.protocol.membership import (
    LEFT,
)
from tests.protocol.endpoints import (
    WAIT,
    RawPeer,
    poll_until,
)


def test_bye_marks_a_peer_left(make_endpoint):
    first = make_endpoint("first", peer_timeout=60.0)
    first.start()
    second = make_endpoint("second", peer_timeout=60.0)
    second.start([first.contact])
    assert second.wait_joined(WAIT) and first.wait_for_peers(1, WAIT)
    second.close()

    def state() -> str:
        return next(e.state for e in first.peers() if e.public_key == second.identity.public_key)

    assert poll_until(lambda: state() == LEFT, 2.0)
    assert first.alive_peers() == []


def test_a_node_never_becomes_its_own_peer(context, make_endpoint):
    endpoint = make_endpoint("target")
    endpoint.start()
    own = endpoint.settings.listen
    raw = RawPeer(context, endpoint.contact)
    # A hello whose answer address is the node's own, and a peer list that points a
    # stranger's key there: the node ends up talking to itself, and must not mind.
    raw.send(raw.frames("hello", {"name": "liar", "addr": own}))
    ghost = {"name": "ghost", "addr": own, "key": Identity.generate().public_key}
    raw.send(raw.frames("peers", {"peers": [ghost]}))
    raw.join()

    def knows_itself() -> bool:
        return endpoint.identity.public_key in [e.public_key for e in endpoint.peers()]

    assert not poll_until(knows_itself, 0.5)
    assert [e.public_key for e in endpoint.peers()] == [raw.public_key]
    assert endpoint.wait_for_peers(2, 0.1) is False


def test_a_name_is_held_by_one_live_key_and_never_by_a_stranger_as_ours(context, make_endpoint):
    endpoint = make_endpoint("target")
    endpoint.start()
    first = RawPeer(context, endpoint.contact, name="alice")
    first.join()
    for name, reason in (
        ("alice", "name_taken"),
        ("target", "name_taken"),
        ("evil/owner", "bad_name"),
        ("bad\nname", "bad_name"),
    ):
        squatter = RawPeer(context, endpoint.contact, name=name)
        squatter.send(squatter.hello())
        deadline = time.monotonic() + WAIT
        while endpoint.rejections().get(reason, 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert endpoint.rejections().get(reason, 0) >= 1, name
        assert [peer.name for peer in endpoint.peers()].count(name) <= 1
        assert squatter.public_key not in {peer.public_key for peer in endpoint.peers()}
