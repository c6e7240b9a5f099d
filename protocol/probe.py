"""Ask a live node how it is, from outside any mesh: one signed `status`, one answer.

The probe binds a ROUTER of its own, since a node answers at the address the request
names and never over the request's connection (WIRE.md section 1), sends the request
from a DEALER and waits for a signed `status_reply`. It joins nothing: the node keeps
no peer entry for it. WIRE.md section 7.6 specifies the exchange.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import zmq

from .identity import Identity, node_id
from .wire import ANY_MESH, Decoder, Rejected, encode, new_instance


@dataclass(frozen=True)
class StatusAnswer:
    sender: bytes  # the answering node's public key, from the signed header
    mesh_id: bytes
    status: dict[str, Any]

    @property
    def node_id(self) -> str:
        """Derived from the signed key, as every node id is: never taken from the body."""
        return node_id(self.sender)


def ask_status(identity: Identity, address: str, reply_host: str, timeout: float,
               mesh_id: bytes = ANY_MESH) -> StatusAnswer | None:
    """The status the node at `address` answers within `timeout` seconds, else None.

    `reply_host` is this machine's address as the node can reach it.
    """
    context = zmq.Context()
    try:
        inbox = context.socket(zmq.ROUTER)
        inbox.setsockopt(zmq.LINGER, 0)
        port = inbox.bind_to_random_port(f"tcp://{reply_host}")
        outbox = context.socket(zmq.DEALER)
        outbox.setsockopt(zmq.LINGER, 0)
        outbox.connect(address)
        body = {"addr": f"tcp://{reply_host}:{port}"}
        # Clock-based, as every sender's numbers are; a status request does not move the
        # receiver's counter for this key, so a borrowed key stays usable by its node.
        outbox.send_multipart(encode(identity, mesh_id, "status", time.time_ns(), 0, body,
                                     instance=new_instance()))
        return _await_answer(inbox, time.monotonic() + timeout)
    finally:
        context.destroy(linger=0)


def _await_answer(inbox: zmq.Socket, deadline: float) -> StatusAnswer | None:
    decoder = Decoder(None)  # we belong to no mesh: the answer tells us the node's
    while (left := deadline - time.monotonic()) > 0:
        if not inbox.poll(left * 1000):
            break
        _, *frames = inbox.recv_multipart()
        try:
            message = decoder.decode(frames)
        except Rejected:
            continue  # not an authentic message: wait on for the real answer
        if message.kind == "status_reply":
            return StatusAnswer(message.sender, message.mesh, message.body["status"])
    return None
