"""Live endpoints for the protocol's tests: the fixtures that make and close them (on an
in-process network, or over real ZeroMQ sockets on loopback where a test needs them), a
raw peer that sends hand-made frames, and small blobs to exchange."""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import numpy as np
import pytest
import zmq

from meshfl.protocol.decoder import Decoder
from meshfl.protocol.endpoint import (
    Endpoint,
    EndpointSettings,
)
from meshfl.protocol.identity import Identity, curve_public_key
from meshfl.protocol.memory import MemoryNetwork
from meshfl.protocol.ports import free_ports
from meshfl.protocol.transport import (
    Encryption,
    TransportError,
    curve_client,
    curve_server,
    split_contact,
)
from meshfl.protocol.wire import (
    HEADER_CONTEXT,
    RECORD_CONTEXT,
    Blob,
    Limits,
    Message,
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


# Ports of the in-process network's addresses: nothing listens there for real.
_MEMORY_PORTS = itertools.count(20000)


def memory_address(host: str = "127.0.0.1") -> str:
    """A new address on an in-process network (memory.py)."""
    return f"tcp://{host}:{next(_MEMORY_PORTS)}"


@pytest.fixture
def make_endpoint(request: pytest.FixtureRequest):
    """Endpoints, closed after the test: on an in-process network (memory.py), or on free
    loopback ports where the test talks to them over sockets of its own (it takes the
    `context` or `scene` fixture) or is marked `sockets`."""
    made: list[Endpoint] = []
    uses_sockets = {"context", "scene"} & set(request.fixturenames)
    network = (
        None if uses_sockets or request.node.get_closest_marker("sockets") else MemoryNetwork()
    )

    def make(
        name: str = "node",
        identity: Identity | None = None,
        schema: bytes | None = SCHEMA,
        mesh: bytes = MESH,
        **settings,
    ) -> Endpoint:
        identity = identity or Identity.generate()
        if network is not None:
            settings_of = EndpointSettings(name, memory_address(), **settings)
            made.append(Endpoint(identity, mesh, settings_of, schema=schema, network=network))
            return made[-1]
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
    if network is not None:
        network.close()


class RawPeer:
    """A peer driven by hand: a DEALER to the endpoint, a ROUTER for its answers."""

    def __init__(
        self,
        context: zmq.Context,
        target: str,
        identity: Identity | None = None,
        name: str = "raw",
        host: str = "127.0.0.1",
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
        self.inbox.bind(f"tcp://{host}:*")
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


def delivered(endpoint: Endpoint) -> dict:
    """Everything a rejected message must not change."""
    with endpoint.lock:
        return {
            "received": Counter(endpoint.received),
            "store": sorted(endpoint.blobs.store._blobs),
            "store_bytes": endpoint.blobs.store.bytes,
            "offers": sorted(endpoint.blobs.offer_book._offers),
            "fetched": list(endpoint.blobs.fetch_log),
            "direct": endpoint.inbox.waiting(),
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
