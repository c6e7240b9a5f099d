"""A live Endpoint over real ZeroMQ sockets on loopback.

Hostile and broken messages are crafted by hand and sent from a raw DEALER; the
test side binds its own ROUTER to receive what the endpoint answers, so it can tell
that the node is still serving after each rejection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import numpy as np
import pytest
import zmq

from meshfl.protocol.endpoint import (
    BEAT_ANYWAY_PERIODS,
    Endpoint,
    EndpointSettings,
    OtherMesh,
    Refused,
)
from meshfl.protocol.exchange import FetchRecord
from meshfl.protocol.identity import Identity, curve_public_key, verify
from meshfl.protocol.membership import (
    ALIVE,
    DOWN,
    HEARTBEAT_FANOUT,
    LEFT,
    PeerTable,
    liveness_stretch,
)
from meshfl.protocol.offers import Offer
from meshfl.protocol.probe import ask_status
from meshfl.protocol.transport import (
    Encryption,
    TransportError,
    TransportOptions,
    contact,
    curve_client,
    curve_server,
    free_ports,
    split_contact,
)
from meshfl.protocol.views import MAX_CARDS
from meshfl.protocol.wire import (
    HEADER_CONTEXT,
    RECORD_CONTEXT,
    REJECTION_REASONS,
    Blob,
    Decoder,
    Limits,
    Message,
    announce_body,
    encode,
    frames_digest,
    make_blob,
    new_instance,
)

MESH = hashlib.sha256(b"endpoint test mesh").digest()[:16]
OTHER_MESH = hashlib.sha256(b"some other mesh").digest()[:16]
SCHEMA = hashlib.sha256(b"model schema").digest()
SMALL = Limits(max_message_bytes=64 << 10, max_frames=4, max_envelope_bytes=16 << 10)
WAIT = 5.0  # the longest any single step may take before the test fails


def poll_until(condition: Callable[[], bool], timeout: float = WAIT, step: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


@pytest.fixture
def make_endpoint():
    """Endpoints on free loopback ports, closed after the test."""
    made: list[Endpoint] = []

    def make(
        name: str = "node",
        identity: Identity | None = None,
        schema: bytes | None = SCHEMA,
        mesh: bytes = MESH,
        **settings,
    ) -> Endpoint:
        identity = identity or Identity.generate()
        for _ in range(5):  # a port found free can be taken before we bind it
            listen = f"tcp://127.0.0.1:{free_ports(1)[0]}"
            try:
                endpoint = Endpoint(
                    identity, mesh, EndpointSettings(name, listen, **settings), schema=schema
                )
            except TransportError:
                continue
            made.append(endpoint)
            return endpoint
        raise RuntimeError("no free port")

    yield make
    for endpoint in reversed(made):
        endpoint.close()


class RawPeer:
    """A peer driven by hand: a DEALER to the endpoint, a ROUTER for its answers."""

    def __init__(
        self, context: zmq.Context, target: str, identity: Identity | None = None, name: str = "raw"
    ) -> None:
        self.identity = identity or Identity.generate()
        self.name = name
        self.instance = new_instance()
        self.seq = time.time_ns()
        self.inbox = context.socket(zmq.ROUTER)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.out = context.socket(zmq.DEALER)
        self.out.setsockopt(zmq.LINGER, 0)
        address, node_key = split_contact(target)  # KEY@ADDRESS: the endpoint encrypts
        if node_key is not None:
            keys = Encryption(self.identity.curve_public_key, self.identity.curve_secret_key)
            curve_server(self.inbox, keys)
            curve_client(self.out, keys, curve_public_key(node_key))
        self.inbox.bind("tcp://127.0.0.1:*")
        self.address = self.inbox.getsockopt_string(zmq.LAST_ENDPOINT)
        self.out.connect(address)
        self.decoder = Decoder(MESH)
        self.pending: list[Message] = []

    @property
    def public_key(self) -> bytes:
        return self.identity.public_key

    def frames(
        self,
        kind: str,
        body: dict,
        *,
        identity: Identity | None = None,
        mesh: bytes = MESH,
        round_no: int = 0,
        blob: Blob | None = None,
    ) -> list:
        self.seq += 1
        return [
            bytes(frame)
            for frame in encode(
                identity or self.identity,
                mesh,
                kind,
                self.seq,
                round_no,
                body,
                instance=self.instance,
                blob=blob,
            )
        ]

    def hello(self) -> list:
        return self.frames("hello", {"name": self.name, "addr": self.address})

    def send(self, frames: list) -> None:
        self.out.send_multipart(frames)

    def _receive(self, timeout: float) -> bool:
        if not self.inbox.poll(max(timeout, 0) * 1000):
            return False
        _, *frames = self.inbox.recv_multipart()
        self.pending.append(self.decoder.decode(frames))
        return True

    def expect(self, kind: str, timeout: float = WAIT) -> Message:
        deadline = time.monotonic() + timeout
        while True:
            for at, message in enumerate(self.pending):
                if message.kind == kind:
                    return self.pending.pop(at)
            left = deadline - time.monotonic()
            if left <= 0 or not self._receive(left):
                raise AssertionError(f"no {kind!r} from the endpoint within {timeout}s")

    def collect(self, kind: str, duration: float) -> list[Message]:
        """Everything of `kind` that arrives within `duration`."""
        deadline = time.monotonic() + duration
        while (left := deadline - time.monotonic()) > 0:
            self._receive(left)
        got = [message for message in self.pending if message.kind == kind]
        self.pending = [message for message in self.pending if message.kind != kind]
        return got

    def join(self) -> Message:
        """Say hello and wait for the peer table: proof the endpoint is serving."""
        self.send(self.hello())
        return self.expect("peers")


# --- crafting one bad message per rejection reason -----------------------------------
# Each craft_* function returns the frames of one message that must be rejected for its
# reason, and nothing else wrong with it (signed by an allowed key, fresh sequence number).


@dataclass
class Scene:
    endpoint: Endpoint
    raw: RawPeer  # allowed in the closed mesh
    origin: Identity  # allowed too: the origin of blobs `raw` relays
    stranger: Identity  # not in the allowlist


def small_blob(origin: Identity, schema: bytes = SCHEMA, **arrays: np.ndarray) -> Blob:
    arrays = arrays or {"w": np.arange(4, dtype=np.float32)}
    return make_blob(origin, 1, "model", arrays, schema=schema)


def hand_made_blob(origin: Identity, frames: list[bytes], index: list) -> Blob:
    """A blob honestly signed by `origin` whose tensor index is written by hand."""
    digest = frames_digest(frames)
    record = msgpack.packb([origin.public_key, 1, "model", SCHEMA, digest, index, {}])
    return Blob(
        origin.public_key,
        1,
        "model",
        SCHEMA,
        digest,
        [],
        {},
        record,
        origin.sign(RECORD_CONTEXT + record),
        frames,
    )


def blob_message(scene: Scene, blob: Blob) -> list:
    return scene.raw.frames("blob", {}, round_no=blob.round, blob=blob)


def resign(identity: Identity, header: dict) -> list:
    header_bytes = msgpack.packb(header)
    return [msgpack.packb([header_bytes, identity.sign(HEADER_CONTEXT + header_bytes)])]


def valid_header(scene: Scene, kind: str = "heartbeat", body: dict | None = None) -> dict:
    header_bytes, _ = msgpack.unpackb(scene.raw.frames(kind, body or {})[0])
    return msgpack.unpackb(header_bytes)


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


def delivered(endpoint: Endpoint) -> dict:
    """Everything a rejected message must not change."""
    with endpoint._lock:
        return {
            "received": Counter(endpoint.received),
            "store": sorted(endpoint.blobs.store._blobs),
            "store_bytes": endpoint.blobs.store.bytes,
            "offers": sorted(endpoint.blobs.offer_book._offers),
            "fetched": list(endpoint.blobs.fetch_log),
            "direct": {kind: box.qsize() for kind, box in endpoint._inboxes.items()},
            "peers": sorted(entry.public_key for entry in endpoint.table.entries.values()),
        }


@pytest.fixture
def scene(context, make_endpoint):
    raw_identity, origin, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    endpoint = make_endpoint(
        "target", allowlist=frozenset({raw_identity.public_key, origin.public_key}), limits=SMALL
    )
    endpoint.start()
    raw = RawPeer(context, endpoint.contact, raw_identity)
    raw.join()
    return Scene(endpoint, raw, origin, stranger)


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


# --- membership ---------------------------------------------------------------------


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


def test_a_silent_peer_is_marked_down_within_timeout_plus_one_interval(context, make_endpoint):
    interval, timeout = 0.1, 0.8
    endpoint = make_endpoint("watcher", heartbeat_interval=interval, peer_timeout=timeout)
    endpoint.start()
    raw = RawPeer(context, endpoint.contact)
    sent = time.monotonic()
    raw.join()
    answered = time.monotonic()

    def state() -> str:
        return next(e.state for e in endpoint.peers() if e.public_key == raw.public_key)

    assert state() == ALIVE
    assert poll_until(lambda: state() == DOWN, timeout + interval + 2.0)
    down = time.monotonic()
    assert down - sent >= timeout  # not before the timeout...
    assert down - answered <= timeout + interval + 0.5  # ...and not much after it
    assert raw.public_key not in [e.public_key for e in endpoint.alive_peers()]

    raw.send(raw.frames("heartbeat", {}))  # a down peer that speaks is alive again
    assert poll_until(lambda: state() == ALIVE)


def peers_beat_while(context, make_endpoint, caplog, held_up) -> None:
    """Two peers heartbeat a node for three timeouts while `held_up(endpoint)` holds part
    of it up; a few ticks after, within the timeout, both are alive and none was ever
    logged down: the node does not blame its peers for its own delay."""
    interval, timeout = 0.1, 0.5
    endpoint = make_endpoint("busy", heartbeat_interval=interval, peer_timeout=timeout)
    endpoint.start()
    peers = [RawPeer(context, endpoint.contact, name=f"raw{i}") for i in range(2)]
    for peer in peers:
        peer.join()
    with caplog.at_level(logging.WARNING, logger="meshfl.endpoint"):
        with held_up(endpoint):
            for _ in range(15):
                for peer in peers:
                    peer.send(peer.frames("heartbeat", {}))
                time.sleep(timeout / 5)
        time.sleep(2 * interval)
        assert [e.state for e in endpoint.peers()] == [ALIVE, ALIVE]
    assert "is down" not in caplog.text


def test_a_node_that_reads_its_inbox_late_does_not_blame_its_peers(context, make_endpoint, caplog):
    # The node's worker is held up (a busy process): the heartbeats wait in its inbox.
    peers_beat_while(context, make_endpoint, caplog, lambda endpoint: endpoint._lock)


@contextlib.contextmanager
def socket_unread(endpoint):
    """The transport's I/O thread held up (its turn at a busy host's GIL): heartbeats
    wait unread in ZeroMQ, and the worker finds its inbox empty."""
    go_on = threading.Event()
    read = endpoint.transport._receive_some
    endpoint.transport._receive_some = lambda: (go_on.wait(10), read())
    try:
        yield
    finally:
        endpoint.transport._receive_some = read
        go_on.set()


def test_a_node_whose_socket_is_read_late_does_not_blame_its_peers(context, make_endpoint, caplog):
    peers_beat_while(context, make_endpoint, caplog, socket_unread)


def test_liveness_waits_stretch_with_the_most_peers_a_node_has_known():
    assert liveness_stretch(5) == 1.0 and liveness_stretch(HEARTBEAT_FANOUT) == 1.0
    assert liveness_stretch(100) == 100 / HEARTBEAT_FANOUT
    now = [0.0]
    table = PeerTable(timeout=5.0, clock=lambda: now[0])
    keys = [bytes([index]) * 32 for index in range(100)]
    for index, key in enumerate(keys):
        table.upsert(key, f"n{index}", f"tcp://h:{index}", b"i" * 16)
        assert table.known() == index, "a peer counts once a handshake reached it"
        table.mark_reached(key)
    for key in keys[5:]:
        table.mark_left(key)  # the others still beat at the pace of a 100-node mesh
    assert table.known() == 100
    now[0] = 5.0 * 9.9  # silent for longer than the timeout, less than it stretched
    assert table.expire() == []
    now[0] = 5.0 * 10.1
    assert len(table.expire()) == 5


def test_a_peer_whose_handshake_took_longer_than_the_timeout_is_not_down_when_it_answers():
    now = [0.0]
    table = PeerTable(timeout=5.0, clock=lambda: now[0])
    table.upsert(b"k" * 32, "n", "tcp://h:1", b"i" * 16)  # named by a contact
    now[0] = 12.0  # the handshake completes long after
    table.mark_reached(b"k" * 32)
    assert table.expire() == [], "it answered just now"
    now[0] = 12.0 + 5.1
    assert len(table.expire()) == 1, "silent for the timeout since"


def test_a_node_sharing_its_process_with_many_waits_as_long_as_a_node_with_as_many_peers():
    now = [0.0]
    table = PeerTable(timeout=5.0, clock=lambda: now[0], crowd=50)
    table.upsert(b"k" * 32, "n", "tcp://h:1", b"i" * 16)
    table.mark_reached(b"k" * 32)
    assert table.stretch() == 5.0, "50 nodes in one process: a fifth of fifty peers' pace"
    now[0] = 5.0 * 4.9
    assert table.expire() == []
    now[0] = 5.0 * 5.1
    assert len(table.expire()) == 1


def test_a_node_starting_in_a_big_mesh_takes_its_size_from_its_bootstrap_list(make_endpoint):
    endpoint = make_endpoint("starting")
    endpoint.start([f"tcp://127.0.0.1:{port}" for port in free_ports(30)])
    assert endpoint.table.known() == 30


def test_heartbeats_give_way_to_other_messages_but_never_stop(context, make_endpoint):
    interval = 0.1
    endpoint = make_endpoint("beater", heartbeat_interval=interval, peer_timeout=60.0)
    endpoint.start()
    raw = RawPeer(context, endpoint.contact)
    raw.join()
    idle = raw.collect("heartbeat", 20 * interval)
    stop = threading.Event()

    def announce_every_tick() -> None:
        for round_no in itertools.count(1):
            if stop.wait(interval / 2):
                return
            arrays = model_arrays(round_no)
            endpoint.publish(make_blob(endpoint.identity, 1, "model", arrays, schema=SCHEMA))

    announcer = threading.Thread(target=announce_every_tick)
    announcer.start()
    try:
        busy = raw.collect("heartbeat", 20 * interval)
    finally:
        stop.set()
        announcer.join()
    assert len(idle) >= 12, "about one a tick while nothing else is sent"
    assert 1 <= len(busy) <= 20 // BEAT_ANYWAY_PERIODS + 2, "one every few ticks when busy"


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


# --- gossip -------------------------------------------------------------------------


def joined_pair(make_endpoint, **settings) -> tuple[Endpoint, Endpoint]:
    first = make_endpoint("a", **settings)
    first.start()
    second = make_endpoint("b", **settings)
    second.start([first.contact])
    assert second.wait_joined(WAIT)
    assert first.wait_for_peers(1, WAIT) and second.wait_for_peers(1, WAIT)
    return first, second


def model_arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((64, 32)).astype(np.float32),
        "b": rng.standard_normal(64).astype(np.float32),
        "steps": np.array(seed, dtype=np.int64),
    }


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
    with endpoint._lock:
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
    with endpoint._lock:
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
    with endpoint._lock:
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


def test_messages_are_decoded_without_holding_the_endpoint_lock(context, make_endpoint):
    endpoint = make_endpoint("target")
    endpoint.start()
    lock_free_while_decoding: list[bool] = []
    decode = endpoint.decoder.decode

    def try_the_lock() -> None:
        taken = endpoint._lock.acquire(timeout=0.5)
        if taken:
            endpoint._lock.release()
        lock_free_while_decoding.append(taken)

    def observed_decode(frames):
        # Another thread must be able to take the lock while a message is being decoded.
        probe = threading.Thread(target=try_the_lock)
        probe.start()
        probe.join()
        return decode(frames)

    endpoint.decoder.decode = observed_decode
    raw = RawPeer(context, endpoint.contact)
    raw.join()
    raw.send(raw.frames("heartbeat", {}, mesh=OTHER_MESH))  # a rejected one too
    raw.join()
    assert len(lock_free_while_decoding) >= 3 and all(lock_free_while_decoding)
    assert endpoint.rejections() == {"wrong_mesh": 1}


# --- another mesh ---------------------------------------------------------------------


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
    node._status_answers.period = 60.0  # so that a slow machine cannot spread the asks out
    node.start()
    answers = [ask_status(Identity.generate(), node.contact, "127.0.0.1", 1.0) for _ in range(3)]
    assert [answer is not None for answer in answers] == [True, True, False]
    assert node.received["status_unanswered"] == 1


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
    with endpoint._lock:
        assert not endpoint.blobs.fetches.requested(broken.id), "its fetch slot is free again"


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
