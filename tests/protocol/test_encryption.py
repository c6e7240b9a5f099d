"""Encrypted meshes (WIRE.md 1.1): CURVE keys bound to the Ed25519 identity, a sniffer on
the path, unlisted keys refused at the handshake, nodes that do not encrypt.

Real endpoints on loopback; the "sniffer" is a TCP relay that forwards and records
every byte between two nodes, standing where a switch or a router would.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
from blake3 import blake3
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from meshfl.protocol import wire
from meshfl.protocol.endpoint import REFUSED_HANDSHAKE, Endpoint, EndpointSettings
from meshfl.protocol.identity import BadPublicKey, Identity, curve_public_key
from meshfl.protocol.ports import free_ports
from meshfl.protocol.transport import BadContact, contact, split_contact

pytestmark = pytest.mark.sockets  # CURVE is the sockets'

MESH = hashlib.sha256(b"encryption test mesh").digest()[:16]
WAIT = 10.0


def poll_until(condition, timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class Relay:
    """A loopback TCP relay to `target` that records every byte it forwards."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.seen = bytearray()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stopping = threading.Event()
        self._spawn(self._accept)

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            self._sockets += [client, server]
            self._spawn(self._pump, client, server)
            self._spawn(self._pump, server, client)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        while True:
            try:
                data = source.recv(1 << 16)
                if not data:
                    break
                with self._lock:
                    self.seen += data
                sink.sendall(data)
            except OSError:
                break
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._stopping.set()
        self._listener.close()
        for sock in self._sockets:
            sock.close()
        for thread in self._threads:
            thread.join(timeout=5)


@pytest.fixture
def endpoints():
    made: list[Endpoint] = []

    def make(name: str, identity: Identity | None = None, **settings) -> Endpoint:
        listen = f"tcp://127.0.0.1:{free_ports(1)[0]}"
        endpoint = Endpoint(
            identity or Identity.generate(),
            MESH,
            EndpointSettings(name, listen, heartbeat_interval=0.2, **settings),
        )
        made.append(endpoint)
        return endpoint

    yield make
    for endpoint in reversed(made):
        endpoint.close()


def test_the_curve_key_pair_is_derived_from_the_ed25519_key():
    for _ in range(50):
        identity = Identity.generate()
        pair = X25519PrivateKey.from_private_bytes(identity.curve_secret_key)
        assert pair.public_key().public_bytes_raw() == identity.curve_public_key
        assert curve_public_key(identity.public_key) == identity.curve_public_key
    with pytest.raises(BadPublicKey):
        curve_public_key((1).to_bytes(32, "little"))  # y = 1: the neutral point


def test_a_contact_carries_the_key_and_a_bad_one_is_named():
    key = Identity.generate().public_key
    assert split_contact(contact("tcp://10.0.0.5:7700", key)) == ("tcp://10.0.0.5:7700", key)
    assert split_contact("tcp://10.0.0.5:7700") == ("tcp://10.0.0.5:7700", None)
    with pytest.raises(BadContact, match="64 hex digits"):
        split_contact("abcd@tcp://10.0.0.5:7700")


def blob_through_a_sniffer(endpoints, encrypt: bool) -> tuple[bytes, bytes]:
    """A blob of random bytes fetched by `puller` from `origin`, with every byte sent to
    the puller passing through a relay (the puller advertises the relay's address):
    (the blob's tensor bytes, what the relay saw)."""
    origin = endpoints("origin", encrypt=encrypt)
    puller_port = free_ports(1)[0]
    relay = Relay(puller_port)
    try:
        puller = endpoints("puller", encrypt=encrypt, listen_port=puller_port, relay=relay)
        origin.start()
        puller.start([origin.contact if encrypt else origin.settings.listen])
        assert puller.wait_joined(WAIT) and origin.wait_for_peers(1, WAIT)
        tensor = np.frombuffer(np.random.default_rng(7).bytes(1 << 18), dtype=np.float32)
        blob = wire.make_blob(origin.identity, 1, "model", {"w": tensor})
        origin.publish(blob)
        assert poll_until(lambda: puller.offers(1)), "the announce came through the relay"
        puller.fetch(puller.offers(1))
        assert puller.wait_blobs([blob.id], time.monotonic() + WAIT), "the blob arrived"
        return tensor.tobytes(), bytes(relay.seen)
    finally:
        relay.close()


@pytest.mark.parametrize("encrypt", [True, False], ids=["encrypted", "plain"])
def test_a_sniffer_on_the_path_sees_a_blob_only_when_encryption_is_off(encrypt):
    made: list[Endpoint] = []

    def make(
        name: str, listen_port: int | None = None, relay: Relay | None = None, **settings
    ) -> Endpoint:
        listen = f"tcp://127.0.0.1:{listen_port or free_ports(1)[0]}"
        advertise = relay.address if relay is not None else ""
        endpoint = Endpoint(
            Identity.generate(),
            MESH,
            EndpointSettings(name, listen, advertise=advertise, heartbeat_interval=0.2, **settings),
        )
        made.append(endpoint)
        return endpoint

    try:
        tensor, seen = blob_through_a_sniffer(make, encrypt)
    finally:
        for endpoint in reversed(made):
            endpoint.close()
    assert len(seen) > len(tensor), "the blob crossed the relay"
    windows = {tensor[at : at + 16] for at in range(0, len(tensor) - 16, 16)}
    in_clear = sum(window in seen for window in windows)
    if encrypt:
        assert in_clear == 0, f"{in_clear} of {len(windows)} 16-byte pieces in the clear"
        assert b"announce" not in seen and b"peers" not in seen, "headers are hidden too"
    else:
        assert tensor in seen, "without encryption the tensor crosses in the clear"


def test_an_unlisted_key_cannot_complete_the_handshake_of_a_closed_mesh(endpoints, caplog):
    member, stranger_identity = Identity.generate(), Identity.generate()
    host_identity = Identity.generate()
    listed = frozenset([host_identity.public_key, member.public_key])
    host = endpoints("host", host_identity, allowlist=listed)
    host.start()
    friend = endpoints("friend", member, allowlist=listed)
    stranger = endpoints("stranger", stranger_identity)
    with caplog.at_level(logging.WARNING):
        friend.start([host.contact])
        stranger.start([host.contact])
        assert friend.wait_joined(WAIT), "a listed key gets in"
        assert not stranger.wait_joined(1.0), "an unlisted one does not"
    refused = host.rejections()[REFUSED_HANDSHAKE]
    assert refused >= 1
    assert "hello" not in host.received or host.received["hello"] == 1, "only the friend's"
    assert [entry.name for entry in host.peers()] == ["friend"]
    assert stranger.transport.failed_handshakes[host.settings.address] >= 1
    assert "not listed in this closed mesh" in caplog.text
    assert "the node refused our key" in caplog.text


def names_no_encryption(log: str, side: str) -> bool:
    """Whether `log` has a line saying the handshake with `side` failed for want of
    encryption on the other end."""
    return any(
        f"encrypted handshake with {side} failed" in line
        and ("does not encrypt" in line or "speak without encryption" in line)
        for line in log.splitlines()
    )


def test_a_node_that_does_not_encrypt_is_told_apart_and_nothing_crashes(endpoints, caplog):
    """A protocol-2 node speaks ZMTP NULL, as one with `encrypt: false` does."""
    encrypted = endpoints("encrypted")
    plain = endpoints("plain", encrypt=False)
    encrypted.start()
    plain.start()
    with caplog.at_level(logging.WARNING):
        plain_dialler = endpoints("plain-joiner", encrypt=False)
        plain_dialler.start([encrypted.settings.listen])
        encrypted_dialler = endpoints("encrypted-joiner")
        encrypted_dialler.start([contact(plain.settings.listen, plain.identity.public_key)])
        assert not plain_dialler.wait_joined(1.0) and not encrypted_dialler.wait_joined(0.5)
        # Which end of a mismatched handshake notices first is a race inside ZeroMQ: an
        # encrypted end reads either the plain greeting (does not encrypt) or the other
        # end hanging up on its own (closed during the handshake); both words say so.
        sides = ["incoming", plain.settings.listen]
        assert poll_until(lambda: all(names_no_encryption(caplog.text, side) for side in sides))
    assert encrypted.peers() == [] and plain.peers() == []
    assert encrypted.rejections() == {} and plain.rejections() == {}


def test_a_version_2_message_is_dropped_with_a_word_on_versions(endpoints, caplog):
    """With encryption off a version-2 node connects; its messages are refused."""
    node = endpoints("node", encrypt=False)
    node.start()
    old = Identity.generate()
    header = msgpack.packb(
        {
            "v": 2,
            "mesh": MESH,
            "kind": "hello",
            "from": old.public_key,
            "inst": wire.new_instance(),
            "seq": time.time_ns(),
            "round": 0,
            "body": {"name": "old", "addr": "tcp://127.0.0.1:9"},
            "digest": blake3(b"").digest(),
        }
    )
    envelope = msgpack.packb([header, old.sign(b"meshfl/2 header\n" + header)])
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(node.settings.listen)
        with caplog.at_level(logging.WARNING):
            dealer.send(envelope)
            assert poll_until(lambda: node.rejections().get("bad_header") == 1)
            # The worker counts the drop before it logs it: wait for the line too.
            assert poll_until(lambda: "speaks meshfl protocol 2, this node 3" in caplog.text)
    finally:
        context.destroy(linger=0)
