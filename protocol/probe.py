"""Ask a live node how it is, from outside any mesh: one signed `status`, one answer;
and a node's side of it, the answer (`StatusAnswers`).

The probe binds a ROUTER of its own, since a node answers at the address the request
names and never over the request's connection (WIRE.md section 1), sends the request
from a DEALER and waits for a signed `status_reply`. It joins nothing: the node keeps
no peer entry for it. WIRE.md section 7.6 specifies the exchange. Asked at a contact
KEY@tcp://HOST:PORT, both connections are encrypted (section 1.1): the request's with
the node's key, the answer's with the CURVE key of the probe's own signing key.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from .decoder import Decoder
from .identity import Identity, curve_public_key, node_id
from .parts import Host, RateLimit
from .transport import Encryption, curve_client, curve_server, split_contact
from .wire import ANY_MESH, Message, Rejected, encode, new_instance

TERM_WAIT_S = 2.0  # how long a probe waits for its ZeroMQ context to end


@dataclass(frozen=True)
class StatusAnswer:
    sender: bytes  # the answering node's public key, from the signed header
    mesh_id: bytes
    status: dict[str, Any]

    @property
    def node_id(self) -> str:
        """Derived from the signed key, as every node id is: never taken from the body."""
        return node_id(self.sender)


def ask_status(
    identity: Identity, node: str, reply_host: str, timeout: float, mesh_id: bytes = ANY_MESH
) -> StatusAnswer | None:
    """The status the node at `node` answers within `timeout` seconds, else None.

    `node` is KEY@tcp://HOST:PORT (encrypted) or a bare tcp://HOST:PORT (a node with
    encryption off); `reply_host` is this machine's address as the node can reach it.
    """
    address, node_key = split_contact(node)
    encryption = None
    if node_key is not None:
        encryption = Encryption(identity.curve_public_key, identity.curve_secret_key)
    context = zmq.Context()
    try:
        inbox = context.socket(zmq.ROUTER)
        inbox.setsockopt(zmq.LINGER, 0)
        outbox = context.socket(zmq.DEALER)
        outbox.setsockopt(zmq.LINGER, 0)
        if encryption is not None and node_key is not None:
            curve_server(inbox, encryption)  # the node answers with our signing key's twin
            curve_client(outbox, encryption, curve_public_key(node_key))
        port = inbox.bind_to_random_port(f"tcp://{reply_host}")
        outbox.connect(address)
        body = {"addr": f"tcp://{reply_host}:{port}"}
        # Clock-based, as every sender's numbers are; a status request does not move the
        # receiver's counter for this key, so a borrowed key stays usable by its node.
        outbox.send_multipart(
            encode(identity, mesh_id, "status", time.time_ns(), 0, body, instance=new_instance())
        )
        return _await_answer(inbox, time.monotonic() + timeout, node_key)
    finally:
        _end(context)


def _end(context: zmq.Context) -> None:
    """Close the probe's sockets, then end its context, waiting at most TERM_WAIT_S for
    that: libzmq can hang ending a context whose connection failed its handshake (a
    probe at a bare address of an encrypted node), and a one-shot probe must not hang."""
    # The sockets are no longer used here, so another thread may close them.
    ender = threading.Thread(target=context.destroy, kwargs={"linger": 0}, daemon=True)
    ender.start()
    ender.join(TERM_WAIT_S)


def _await_answer(
    inbox: zmq.Socket, deadline: float, node_key: bytes | None
) -> StatusAnswer | None:
    decoder = Decoder(None)  # we belong to no mesh: the answer tells us the node's
    while (left := deadline - time.monotonic()) > 0:
        if not inbox.poll(int(left * 1000)):  # what pyzmq would do with a float
            break
        _, *frames = inbox.recv_multipart()
        try:
            message = decoder.decode(frames)
        except Rejected:
            continue  # not an authentic message: wait on for the real answer
        if message.kind == "status_reply" and node_key in (None, message.sender):
            return StatusAnswer(message.sender, message.mesh, message.body["status"])
    return None


class StatusAnswers:
    """How one endpoint (`endpoint`) answers `status`: at most `status_per_second` a
    second, each answer costing a connection to the address the asker names."""

    def __init__(self, endpoint: Host) -> None:
        self.endpoint = endpoint
        self.limit = RateLimit(endpoint.settings.status_per_second)
        self.started = time.monotonic()

    def on_status(self, message: Message) -> None:
        # Not `heard_from`: the asker may be a probe holding a peer's key, and it says
        # nothing about whether that peer is alive.
        endpoint = self.endpoint
        if not self.limit.allow():
            endpoint.received["status_unanswered"] += 1
            return
        address = message.body["addr"]
        is_peer = any(entry.address == address for entry in endpoint.table.entries.values())
        answer = {"status": self.status()}
        endpoint.send(address, "status_reply", answer, once=not is_peer, key=message.sender)

    def on_status_reply(self, message: Message) -> None:
        pass  # a node never asks, so an answer is unsolicited: counted in `received` only

    def status(self) -> dict[str, Any]:
        """This node as a status answer tells it (WIRE.md 7.6)."""
        endpoint = self.endpoint
        now = time.monotonic()
        peers = [
            {
                "name": entry.name,
                "id": entry.id,
                "addr": entry.address,
                "state": entry.state,
                "round": entry.round,
                "last_seen_s": round(now - entry.last_seen, 3),
            }
            for entry in endpoint.table.entries.values()
        ]
        status = {
            "name": endpoint.settings.name,
            "addr": endpoint.address,
            "round": endpoint.round,
            "uptime_s": round(now - self.started, 3),
            "peers": peers,
            "rejections": endpoint.rejections(),
            "received": dict(endpoint.received),
        }
        if endpoint.status_extra is not None:
            status.update(endpoint.status_extra())
        return status
