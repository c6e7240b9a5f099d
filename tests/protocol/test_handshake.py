"""How a live endpoint meets its peers (protocol/handshake.py): hellos and the peer lists
they ask for, bootstrap contacts, and a second process with a live node's key, refused."""

from __future__ import annotations

import pytest

from meshfl.protocol.endpoint import Refused
from meshfl.protocol.identity import Identity
from meshfl.protocol.membership import ALIVE
from meshfl.protocol.ports import free_ports
from meshfl.protocol.transport import (
    contact,
)
from tests.protocol.endpoints import (
    WAIT,
    RawPeer,
)


def test_a_second_process_with_a_live_key_is_refused(make_endpoint):
    identity = Identity.generate()
    live = make_endpoint("live", identity)
    live.start()
    twin = make_endpoint("twin", identity)
    twin.start([live.contact])
    with pytest.raises(Refused, match=identity.id):
        twin.wait_joined(WAIT)
    assert live.decoder.rejections["duplicate_key"] == 1
    assert live.peers() == []


def test_a_twin_joining_through_another_peer_is_refused(make_endpoint):
    identity = Identity.generate()
    live = make_endpoint("live", identity)
    live.start()
    friend = make_endpoint("friend")
    friend.start([live.contact])
    assert friend.wait_joined(WAIT)
    assert live.wait_for_peers(1, WAIT) and friend.wait_for_peers(1, WAIT)

    twin = make_endpoint("twin", identity)
    twin.start([friend.contact])
    with pytest.raises(Refused, match=live.settings.listen):
        twin.wait_joined(WAIT)
    # The friend still knows the key at the live process's address.
    (entry,) = friend.peers()
    assert (entry.public_key, entry.address, entry.state) == (
        identity.public_key,
        live.settings.listen,
        ALIVE,
    )
    assert entry.instance == live.instance


def test_wait_joined_is_false_when_nobody_answers(make_endpoint):
    lonely = make_endpoint("lonely")
    lonely.start([f"tcp://127.0.0.1:{free_ports(1)[0]}"])
    assert lonely.wait_joined(0.3) is False


def test_a_node_greets_a_peer_named_in_a_list_without_asking_for_its_list(context, make_endpoint):
    endpoint = make_endpoint("joiner")
    lister = RawPeer(context, endpoint.contact, name="lister")
    named = RawPeer(context, endpoint.contact, name="named")
    endpoint.start([contact(lister.address, lister.public_key)])
    hello = lister.expect("hello")
    assert hello.body.get("list", True) is True, "the first bootstrap is asked for its list"
    entries = [
        {"name": "lister", "addr": lister.address, "key": lister.public_key},
        {"name": "named", "addr": named.address, "key": named.public_key},
    ]
    lister.send(lister.frames("peers", {"peers": entries}))
    assert named.expect("hello").body.get("list") is False
    assert endpoint.wait_joined(WAIT)


def test_a_peer_list_nobody_asked_for_makes_the_node_dial_nothing(context, make_endpoint):
    endpoint = make_endpoint("target")
    endpoint.start()
    stranger = RawPeer(context, endpoint.contact, name="stranger")
    stranger.join()
    named = [RawPeer(context, endpoint.contact, name=f"aimed{i}") for i in range(20)]
    entries = [{"name": p.name, "addr": p.address, "key": p.public_key} for p in named]
    stranger.send(stranger.frames("peers", {"peers": entries}))
    stranger.join()  # handled by now: the list came before this hello
    assert endpoint.rejections()["unsolicited_peers"] == 1
    assert all(p.collect("hello", 0.2) == [] for p in named), "nobody was greeted"
    assert [e.name for e in endpoint.peers()] == ["stranger"]


def test_a_hello_that_asks_for_no_list_is_answered_by_the_node_alone(context, make_endpoint):
    endpoint = make_endpoint("target")
    endpoint.start()
    first = RawPeer(context, endpoint.contact, name="first")
    first.join()
    second = RawPeer(context, endpoint.contact, name="second")
    second.send(second.frames("hello", {"name": "second", "addr": second.address, "list": False}))
    answer = second.expect("peers")
    assert [entry["name"] for entry in answer.body["peers"]] == ["target"]
    second.send(second.hello())
    listed = {entry["name"] for entry in second.expect("peers").body["peers"]}
    assert listed == {"target", "first", "second"}


def test_peers_learn_each_other_through_one_bootstrap(make_endpoint):
    hub = make_endpoint("hub")
    hub.start()
    spokes = [make_endpoint(f"spoke{i}") for i in range(3)]
    for spoke in spokes:
        spoke.start([hub.contact])
    for endpoint in [hub, *spokes]:
        assert endpoint.wait_for_peers(3, WAIT), endpoint.settings.name
    keys = {e.identity.public_key for e in [hub, *spokes]}
    for endpoint in [hub, *spokes]:
        alive = {e.public_key for e in endpoint.alive_peers()}
        assert alive == keys - {endpoint.identity.public_key}
