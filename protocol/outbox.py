"""How a node's messages leave: numbered (WIRE.md 6), signed and queued on the transport,
which sends them over a connection in that order (WIRE.md 1), each to the CURVE key its
address was learned with (handshake.py) unless the sender names another."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from .handshake import curve_key_of
from .identity import Identity
from .memory import MemoryTransport
from .transport import Transport
from .wire import Blob, encode

# What a receiver does not count as a sign of life (WIRE.md 7.3): a message of any other
# kind to a peer stands in for a heartbeat to it.
NO_PROOF_OF_LIFE = frozenset({"refuse", "bye", "status", "status_reply"})


class Outbox:
    """One node's outgoing messages, from any thread."""

    def __init__(
        self,
        identity: Identity,
        mesh_id: bytes,
        instance: bytes,
        transport: Transport | MemoryTransport,
        curve_key_at: Callable[[str], bytes | None],
        round_of: Callable[[], int],
    ) -> None:
        self.identity = identity
        self.mesh_id = mesh_id
        self.instance = instance
        self.transport = transport
        self.curve_key_at = curve_key_at  # as the handshake learned it for an address
        self.round_of = round_of
        # Start from wall-clock nanoseconds so a restarted node's numbers keep rising.
        self._seq = time.time_ns()
        self._lock = threading.Lock()

    def send(
        self,
        address: str,
        kind: str,
        body: dict[str, Any],
        blob: Blob | None = None,
        once: bool = False,
        key: bytes | None = None,
    ) -> None:
        """`key`: the Ed25519 key of the node at `address`, when it is not the one learned
        for that address (an answer to a status probe or a twin). `once`: over a
        connection of its own, closed when sent (to a node that is not a peer)."""
        server_key = curve_key_of(key) if key is not None else self.curve_key_at(address)
        # Numbering and queueing under one lock: messages leave in sequence order.
        with self._lock:
            self._seq += 1
            frames = encode(
                self.identity,
                self.mesh_id,
                kind,
                self._seq,
                self.round_of(),
                body,
                instance=self.instance,
                blob=blob,
            )
            if once:
                self.transport.send_once(address, frames, server_key, kind=kind)
            else:
                proves_life = kind not in NO_PROOF_OF_LIFE
                self.transport.send(address, frames, server_key, kind=kind, proves_life=proves_life)
