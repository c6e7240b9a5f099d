"""What a stranger who can reach a node's port can make it do, on real sockets: keys of
small order, addresses no node can be dialled at, peer lists nobody asked for, floods of
fresh keys, handshakes that fail, a copied model. The node refuses each under its
reason, dials nothing it was not meant to, forgets what it was told once nobody answers,
and goes on answering `meshfl status` and finishing rounds."""

from __future__ import annotations

import hashlib
import logging
import os
import time

import numpy as np
import pytest
import yaml
import zmq

from meshfl.protocol.endpoint import Endpoint, EndpointSettings
from meshfl.protocol.identity import Identity, is_usable_public_key
from meshfl.protocol.ports import free_ports
from meshfl.protocol.probe import ask_status
from meshfl.protocol.transport import (
    BadContact,
    Encryption,
    Transport,
    TransportError,
    curve_server,
    split_contact,
)
from meshfl.protocol.wire import make_blob
from tests.nodes import records, start_node, stop, write_config
from tests.protocol.endpoints import poll_until
from tests.stranger import (
    NEUTRAL_KEY,
    UNUSABLE_ADDRESSES,
    Stranger,
    small_order_keys,
    unreachable_addresses,
)

MESH = hashlib.sha256(b"stranger test mesh").digest()[:16]
WAIT = 5.0


@pytest.fixture
def make_endpoint():
    made: list[Endpoint] = []

    def make(name: str = "target", **settings) -> Endpoint:
        for _ in range(5):
            listen = f"tcp://127.0.0.1:{free_ports(1)[0]}"
            try:
                endpoint = Endpoint(
                    Identity.generate(), MESH, EndpointSettings(name, listen, **settings)
                )
            except TransportError:
                continue
            made.append(endpoint)
            endpoint.start()
            return endpoint
        raise RuntimeError("no free port")

    yield make
    for endpoint in made:
        endpoint.close()


def answers_status(endpoint: Endpoint) -> bool:
    answer = ask_status(Identity.generate(), endpoint.contact, "127.0.0.1", WAIT)
    return answer is not None and answer.sender == endpoint.identity.public_key


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_every_encoding_of_a_small_order_point_is_unusable_and_real_keys_are_not():
    keys = small_order_keys()
    assert NEUTRAL_KEY in keys and len(keys) == 14  # 8 points, 6 more spellings
    assert not any(is_usable_public_key(key) for key in keys)
    assert all(is_usable_public_key(Identity.generate().public_key) for _ in range(50))
    with pytest.raises(BadContact):
        split_contact(f"{NEUTRAL_KEY.hex()}@tcp://127.0.0.1:5555")


def test_small_order_keys_are_refused_wherever_a_key_travels(context, make_endpoint):
    endpoint = make_endpoint()
    stranger = Stranger(endpoint.contact, MESH, context)
    sent = stranger.weak_keys()
    assert poll_until(lambda: endpoint.rejections().get("weak_key") == sent)
    assert set(endpoint.rejections()) == {"weak_key"}, "refused before any other check"
    assert endpoint.peers() == []
    assert answers_status(endpoint), "the node answers on, its transport up"
    stranger.send(stranger.hello())
    assert any(m.kind == "peers" for m in stranger.receive(WAIT))


def test_addresses_no_node_can_be_dialled_at_are_refused_at_decoding(
    context, make_endpoint, caplog
):
    endpoint = make_endpoint(heartbeat_interval=0.1)
    stranger = Stranger(endpoint.contact, MESH, context)
    with caplog.at_level(logging.INFO):
        sent = stranger.unusable_addresses()
        assert poll_until(lambda: endpoint.rejections().get("bad_address") == sent)
        time.sleep(1.0)  # ten heartbeat periods: nothing is dialled, nothing re-logged
    assert endpoint.peers() == [] and endpoint.transport.dropped == 0
    assert len(caplog.records) <= len(UNUSABLE_ADDRESSES) * 2


def test_a_connection_that_cannot_open_is_dropped_and_the_transport_goes_on(context):
    ours, theirs = Identity.generate(), Identity.generate()
    listen = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    transport = Transport(
        listen, encryption=Encryption(ours.curve_public_key, ours.curve_secret_key)
    )
    try:
        receiver = context.socket(zmq.ROUTER)
        curve_server(receiver, Encryption(theirs.curve_public_key, theirs.curve_secret_key))
        address = f"tcp://127.0.0.1:{receiver.bind_to_random_port('tcp://127.0.0.1')}"
        # A CURVE server key of the wrong length: libzmq refuses the option outright.
        transport.send(address, [b"lost"], server_key=b"short")
        assert poll_until(lambda: transport.dropped == 1)
        transport.send(address, [b"delivered"], server_key=theirs.curve_public_key)
        assert receiver.poll(WAIT * 1000)
        assert receiver.recv_multipart()[1:] == [b"delivered"]
    finally:
        transport.close()
    assert not transport._thread.is_alive(), "closed, not stuck in the context's end"


def test_a_one_off_answer_to_a_node_dialled_already_follows_what_went_before(context):
    # Over a connection of its own it could overtake the messages queued on the open
    # one, and the receiver would refuse their lower sequence numbers as replays.
    listen = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    transport = Transport(listen)
    try:
        receiver = context.socket(zmq.ROUTER)
        address = f"tcp://127.0.0.1:{receiver.bind_to_random_port('tcp://127.0.0.1')}"
        transport.send(address, [b"hello"])
        transport.send_once(address, [b"answer"])
        arrived = []
        while len(arrived) < 2 and receiver.poll(WAIT * 1000):
            arrived.append(receiver.recv_multipart())
        assert [frames[1:] for frames in arrived] == [[b"hello"], [b"answer"]]
        assert arrived[0][0] == arrived[1][0], "one connection: one routing id"
        assert transport.connections() == 1
    finally:
        transport.close()


def test_a_peer_list_nobody_asked_for_greets_nobody(context, make_endpoint):
    endpoint = make_endpoint()
    stranger = Stranger(endpoint.contact, MESH, context)
    aimed = [Stranger(endpoint.contact, MESH, context) for _ in range(20)]
    stranger.unsolicited_peers([s.address for s in aimed])
    assert poll_until(lambda: endpoint.rejections().get("unsolicited_peers") == 1)
    assert all(not list(s.receive(0.1)) for s in aimed), "no hello reached any of them"
    assert [e.name for e in endpoint.peers()] == [f"s{stranger.identity.id[:12]}"]


def test_a_thousand_strangers_are_forgotten_and_cost_nothing_lasting(
    context, make_endpoint, caplog
):
    endpoint = make_endpoint(heartbeat_interval=0.2, peer_timeout=1.0)
    stranger = Stranger(endpoint.contact, MESH, context)
    files_before = open_files()
    with caplog.at_level(logging.INFO, logger="meshfl"):
        stranger.fresh_hellos(1000)
        assert poll_until(lambda: sum(endpoint.received.values()) >= 1000, 30.0)
        most = len(endpoint.peers())
        assert most <= endpoint.settings.max_unreached, "never more than the bound at once"
        assert poll_until(lambda: endpoint.peers() == [], 60.0), "forgotten within a minute"
        assert poll_until(lambda: open_files() <= files_before + 4, 10.0)
    lines = [r for r in caplog.records if r.name.startswith("meshfl")]
    assert len(lines) < 60, f"{len(lines)} log lines for 1000 strangers"
    assert answers_status(endpoint)


def test_handshake_abuse_then_a_copied_model_leaves_the_node_answering(context, make_endpoint):
    endpoint = make_endpoint()
    endpoint.set_round(1)
    endpoint.publish(make_blob(endpoint.identity, 1, "model", {"w": np.ones(8, "f4")}))
    stranger = Stranger(endpoint.contact, MESH, context)
    for _ in range(3):
        assert stranger.handshake_abuse(2.0) == 9
        assert stranger.copied_model(), "the node served its blob, and took the copy back"
        assert answers_status(endpoint)
    assert endpoint.transport.failed_handshakes["incoming"] >= 3
    assert endpoint.received["unrequested_blob"] == 3
    assert endpoint.transport._thread.is_alive() and endpoint.worker.thread.is_alive()


@pytest.mark.slow
def test_a_mesh_a_stranger_attacks_finishes_every_round_and_answers_status(tmp_path, context):
    config = tmp_path / "peers.yaml"
    rounds = 12
    settings = write_config(config, 3, rounds=rounds, round_timeout=20.0)
    # Rounds of at least a second: the mesh must still run when the attacks are over.
    for peer in settings["peers"]:
        peer["train_delay"] = 1.0
    config.write_text(yaml.safe_dump(settings))
    nodes = [start_node(config, f"node{i}", tmp_path) for i in range(3)]
    try:
        info = tmp_path / "node0" / "info.json"
        assert poll_until(info.exists, 60.0), "node0 started"
        import json

        facts = json.loads(info.read_text())
        node0 = f"{facts['public_key']}@{facts['listen']}"
        answer = ask_status(Identity.generate(), node0, "127.0.0.1", WAIT)
        assert answer is not None
        stranger = Stranger(node0, answer.mesh_id, context)
        stranger.weak_keys()
        stranger.unusable_addresses()
        stranger.unsolicited_peers(unreachable_addresses(20))
        stranger.fresh_hellos(300)
        stranger.handshake_abuse(3.0)
        stranger.copied_model()
        status = ask_status(Identity.generate(), node0, "127.0.0.1", WAIT)
        assert status is not None, "node0 answers status under attack"
        rejected = status.status["rejections"]
        assert rejected["weak_key"] >= 14 and rejected["bad_address"] >= 10
        assert rejected["unsolicited_peers"] >= 1
        for node in nodes:
            assert node.wait(timeout=240) == 0, "every honest node finishes"
    finally:
        stop(nodes)
    for name in ("node0", "node1", "node2"):
        assert [r["round"] for r in records(tmp_path, name)] == list(range(1, rounds + 1))
        assert "Traceback" not in (tmp_path / name / "node.log").read_text()
