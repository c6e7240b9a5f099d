"""How bytes move: one bound ROUTER in, one DEALER per peer address out.

All socket work happens on one I/O thread, because ZeroMQ sockets are not
thread-safe. Other threads hand it messages through a FIFO queue and wake it
through a pipe, so messages leave in exactly the order they were queued (the
receiver's replay check depends on that order). Received messages go to a
bounded queue that the caller drains; when that queue is full the I/O thread
stops reading and ZeroMQ's high-water marks push back on the senders.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

log = logging.getLogger("meshfl.transport")


class TransportError(Exception):
    """The transport cannot start (bad address, port in use); one line for the user."""


def host_towards(address: str) -> str:
    """Our own IP address on the interface that reaches `address` (tcp://HOST:PORT), so
    that a node there can dial us back; no packet is sent."""
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, 9))
        return probe.getsockname()[0]
    except OSError as err:
        raise TransportError(f"cannot reach {address}: {err.strerror}") from None
    finally:
        probe.close()


@dataclass(frozen=True)
class TransportOptions:
    send_hwm: int = 64  # messages queued per peer before sends are dropped
    receive_hwm: int = 64
    receive_queue: int = 256  # decoded-later messages held between I/O and worker
    max_frame_bytes: int = 256 << 20
    # Sockets never linger (a dead peer must not hang our exit), except for this
    # bounded moment on a clean close, so that a final `bye` gets out.
    close_linger_ms: int = 200
    # A one-off answer to a node that is not a peer (`send_once`) gets this long to leave.
    once_linger_ms: int = 2000


@dataclass(frozen=True)
class Received:
    routing_id: bytes
    frames: list[Any]  # zmq.Frame objects: the bytes stay where ZeroMQ put them


class Transport:
    def __init__(self, listen: str, options: TransportOptions = TransportOptions()) -> None:
        self.listen = listen
        self.options = options
        self.inbox: queue.Queue[Received] = queue.Queue(options.receive_queue)
        self.bytes_out = 0
        self.bytes_in = 0
        self.dropped: Counter[str] = Counter()  # peer address -> messages dropped at HWM
        self._closing = threading.Event()
        # (address, frames, once); empty frames: forget the address; None: stop.
        self._outbox: queue.Queue[tuple[str, Sequence[Any], bool] | None] = queue.Queue()
        self._wake_read, self._wake_write = os.pipe()
        # Non-blocking: a full pipe already means "wake up", so a lost byte is harmless.
        os.set_blocking(self._wake_write, False)
        self._context = zmq.Context.instance()
        self._router = self._bind(listen)
        self._dealers: dict[str, zmq.Socket] = {}
        self._thread = threading.Thread(target=self._run, name=f"io {listen}", daemon=True)
        self._thread.start()

    def _bind(self, listen: str) -> zmq.Socket:
        router = self._context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVHWM, self.options.receive_hwm)
        router.setsockopt(zmq.MAXMSGSIZE, self.options.max_frame_bytes)
        try:
            router.bind(listen)
        except zmq.ZMQError as err:
            router.close()
            reason = "port in use" if err.errno == zmq.EADDRINUSE else err.strerror
            raise TransportError(f"cannot listen on {listen}: {reason}") from None
        return router

    def send(self, address: str, frames: Sequence[Any]) -> None:
        """Queue one message for `address`; never blocks, safe from any thread."""
        self._queue(address, frames, once=False)

    def send_once(self, address: str, frames: Sequence[Any]) -> None:
        """Send one message over a connection of its own, closed once it is out: for an
        answer to a node that is no peer (a status probe), which a DEALER kept open
        would go on redialling after the probe is gone."""
        self._queue(address, frames, once=True)

    def _queue(self, address: str, frames: Sequence[Any], once: bool) -> None:
        if self._closing.is_set():
            return
        self._outbox.put((address, frames, once))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"x")
        except BlockingIOError:
            pass

    def forget(self, address: str) -> None:
        """Close the DEALER to a peer that left (done on the I/O thread)."""
        self._queue(address, (), once=False)

    def close(self) -> None:
        """Send what is queued, then close every socket without lingering."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._outbox.put(None)
        self._wake()
        self._thread.join(timeout=5)
        os.close(self._wake_read)
        os.close(self._wake_write)

    # --- the I/O thread -------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if self._wake_read in events:
                    os.read(self._wake_read, 65536)
                    if not self._drain_outbox():
                        return
                if self._router in events:
                    self._receive_some()
        finally:
            for dealer in self._dealers.values():
                dealer.close(linger=self.options.close_linger_ms)
            self._router.close(linger=0)

    def _receive_some(self) -> None:
        # Read what is there now, but keep turns fair with the outbox.
        for _ in range(64):
            try:
                routing_id, *frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.bytes_in += sum(len(frame) for frame in frames)
            self.inbox.put(Received(routing_id.bytes, frames))

    def _drain_outbox(self) -> bool:
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            address, frames, once = item
            if once:
                self._send_once_now(address, frames)
            elif frames:
                self._send_now(address, frames)
            else:
                dealer = self._dealers.pop(address, None)
                if dealer is not None:
                    dealer.close(linger=0)

    def _send_now(self, address: str, frames: Sequence[Any]) -> None:
        dealer = self._dealers.get(address)
        if dealer is None:
            dealer = self._connect(address)
            if dealer is None:
                return
            self._dealers[address] = dealer
        self._put(dealer, address, frames)

    def _send_once_now(self, address: str, frames: Sequence[Any]) -> None:
        dealer = self._connect(address)
        if dealer is not None:
            self._put(dealer, address, frames)
            # Closing does not wait: ZeroMQ sends the queued message in the background.
            dealer.close(linger=self.options.once_linger_ms)

    def _connect(self, address: str) -> zmq.Socket | None:
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDHWM, self.options.send_hwm)
        dealer.setsockopt(zmq.IMMEDIATE, 0)
        try:
            dealer.connect(address)
        except zmq.ZMQError as err:
            dealer.close(linger=0)
            log.warning("cannot connect to %s: %s", address, err.strerror)
            self.dropped[address] += 1
            return None
        return dealer

    def _put(self, dealer: zmq.Socket, address: str, frames: Sequence[Any]) -> None:
        try:
            dealer.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.dropped[address] += 1
            return
        self.bytes_out += sum(memoryview(frame).nbytes for frame in frames)
