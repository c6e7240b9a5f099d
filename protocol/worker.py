"""The endpoint's worker thread: it decodes what arrived, hands each message to the part
that handles its kind (WIRE.md section 4), and keeps the liveness ticks.

Decoding hashes every byte of a blob and checks two signatures: it runs without the
endpoint's lock, so the node's thread is not held up behind a big message. Only this
thread decodes, and only it changes the peer table the checks read.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from .parts import Host
from .transport import LogOnce, Received
from .wire import KINDS, PROTOCOL_VERSION, Message, Rejected
from .wire import blob_id as id_of_record

log = logging.getLogger("meshfl.endpoint")

WORKER_ERROR = "worker_error"  # the worker raised: a bug, contained and logged


class Worker:
    """The thread of one endpoint (`endpoint`); `handlers` takes each kind of message."""

    def __init__(self, endpoint: Host, handlers: dict[str, Callable[[Message], None]]):
        missing = set(KINDS) ^ set(handlers)
        assert not missing, f"kinds without a handler, or handlers without a kind: {missing}"
        self.endpoint = endpoint
        self.handlers = handlers
        # Up to when the worker has read what arrived (monotonic): the arrival time of
        # the message it handles, or, with the inbox empty, when the transport last
        # found nothing more to read. The peer table's clock.
        self.read_up_to = time.monotonic()
        self.stopping = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name=f"mesh {endpoint.settings.name}", daemon=True
        )
        self._log_once = LogOnce(log)

    def _run(self) -> None:
        rejections = self.endpoint.flow_rejections
        next_beat = time.monotonic()
        while not self.stopping.is_set():
            try:
                next_beat = self._once(next_beat)
            except Exception:
                # A bug: logged with its traceback, and the worker goes on, for without
                # it the node would answer nobody and beat to nobody, silently.
                rejections[WORKER_ERROR] += 1
                if rejections[WORKER_ERROR] <= 3:  # the first few, with traceback
                    name = self.endpoint.settings.name
                    log.exception("%s: unexpected error in the mesh worker", name)

    def _once(self, next_beat: float) -> float:
        """Handle what arrived, and beat when it is time; returns when to beat next. It
        sleeps until a message, a wake-up or the beat: a host's hundreds of idle workers
        must not each poll for the GIL."""
        endpoint = self.endpoint
        transport = endpoint.transport
        try:
            received = transport.inbox.get(timeout=max(next_beat - time.monotonic(), 0))
        except queue.Empty:
            received = None
        if received is None:
            # Read up to when the transport last found its socket empty (read before
            # looking at the inbox: what it read by then is in it, or handled).
            caught_up = transport.caught_up_at
            if transport.inbox.empty():
                self.read_up_to = max(self.read_up_to, caught_up)
        else:
            self.read_up_to = received.arrived
            self._handle(received)
        endpoint.liveness.note_new_reached()
        endpoint.overlay.note_unheard()
        if time.monotonic() >= next_beat:
            next_beat = time.monotonic() + endpoint.settings.heartbeat_interval
            endpoint.liveness.tick()
        return next_beat

    def _handle(self, received: Received) -> None:
        endpoint = self.endpoint
        try:
            message = endpoint.decoder.decode(received.frames)
        except Rejected as rejection:
            self._refused(received, rejection)
            return
        with endpoint.lock:
            if message.sender == endpoint.identity.public_key:
                if message.instance == endpoint.instance:
                    return  # sent to ourselves (some hello or peer list gave out our address)
            endpoint.received[message.kind] += 1
            self.handlers[message.kind](message)
            endpoint.note_change()

    def _refused(self, received: Received, rejection: Rejected) -> None:
        """What a refused message still tells: a twin of ours or of a peer (refused in
        turn), a holder that will not send a blob (looked for elsewhere now), a node of
        another mesh (noted)."""
        endpoint = self.endpoint
        refused = rejection.message
        if rejection.claim is None:
            self._log_rejection(received.routing_id, rejection)  # else the node says more
        if rejection.reason == "duplicate_key" and refused is not None:
            with endpoint.lock:
                endpoint.handshake.refuse_twin(refused)
        elif refused is not None and refused.kind == "blob":
            with endpoint.lock:
                endpoint.blobs.holder_failed(refused.sender, id_of_record(refused.body["record"]))
        elif refused is not None and refused.kind in endpoint.inbox.kinds:
            with endpoint.lock:
                endpoint.on_refused_direct(refused, rejection.reason)
        elif rejection.claim is not None:
            with endpoint.lock:
                endpoint.admission.meet_other_mesh(rejection.claim)
                endpoint.wake_waiters()

    def _log_rejection(self, routing_id: bytes, rejection: Rejected) -> None:
        # Once per peer connection and reason: a flood must not flood the log too.
        self._log_once(
            rejection.reason,
            routing_id,
            "%s: dropped a message (%s) from connection %s; further ones are only counted%s",
            self.endpoint.settings.name,
            rejection,
            routing_id.hex(),
            _version_hint(rejection),
        )


def _version_hint(rejection: Rejected) -> str:
    """A word for the operator when a message came from a node of another version."""
    if rejection.reason == "bad_header" and rejection.detail.startswith("version "):
        return (
            f"; the sender speaks meshfl protocol {rejection.detail.split()[1]}, this "
            f"node {PROTOCOL_VERSION}: run the same meshfl version on every node"
        )
    return ""
