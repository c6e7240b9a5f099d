"""Transports that reach one another inside one process: what `transport.Transport` does,
with no socket, no port and no I/O thread per node.

A `MemoryNetwork` carries every message its transports send, in order, on one thread of
its own (a sender never runs a receiver's checks while holding its own locks). It keeps
what the endpoint reads of a socket transport: a connection per address dialled, made
once a node listens there and, in an encrypted mesh, once the key dialled is that
node's and its allowlist takes ours (`reached`); messages queued for an address nobody
listens at yet (delivered when a node binds it, as ZeroMQ redials); addresses found
unheard; bytes in and out; the screen of big messages. It is for tests of the protocol
and the round loop, and for anything else that wants many endpoints in one process
cheaply; what only sockets show (CURVE itself, frame limits, processes) is the socket
transport's.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .transport import Encryption, Received, TransportError, TransportOptions


@dataclass
class _Link:
    """A connection dialled to one address: the key it dials with, and what waits for a
    node to answer there."""

    server_key: bytes | None
    routing_id: bytes = field(default_factory=lambda: os.urandom(5))
    connected: bool = False
    waiting: deque[list[bytes]] = field(default_factory=deque)  # each message's frames


class MemoryNetwork:
    """The in-process network: `transport` makes a transport listening at an address."""

    def __init__(self) -> None:
        self._listening: dict[str, MemoryTransport] = {}
        self._members: list[MemoryTransport] = []
        self._lock = threading.Lock()
        self._work: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._carry, name="memory network", daemon=True)
        self._thread.start()

    def transport(
        self,
        listen: str,
        options: TransportOptions,
        encryption: Encryption | None = None,
        screen: Callable[[list[Any]], bool] | None = None,
    ) -> MemoryTransport:
        """A transport listening at `listen` (the signature of `Transport`)."""
        with self._lock:
            if listen in self._listening:
                raise TransportError(f"cannot listen on {listen}: port in use")
            made = MemoryTransport(self, listen, options, encryption, screen)
            self._listening[listen] = made
            self._members.append(made)
        self.post(lambda: self._bound(listen))
        return made

    def post(self, step: Callable[[], None]) -> None:
        self._work.put(step)

    def settle(self, timeout: float = 5.0) -> bool:
        """Wait until everything sent so far was carried; whether it was in time."""
        done = threading.Event()
        self.post(done.set)
        return done.wait(timeout)

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(timeout=5)

    def listener(self, address: str) -> MemoryTransport | None:
        with self._lock:
            return self._listening.get(address)

    def leave(self, transport: MemoryTransport) -> None:
        """`transport` closed: nobody listens at its address, and every connection to it
        is broken (a later send there finds the address unheard)."""
        with self._lock:
            if self._listening.get(transport.listen) is transport:
                del self._listening[transport.listen]
            self._members.remove(transport)
            members = list(self._members)
        for member in members:
            link = member.links.get(transport.listen)
            if link is not None:
                link.connected = False

    def _carry(self) -> None:
        while (step := self._work.get()) is not None:
            step()

    def _bound(self, address: str) -> None:
        """A node listens at `address` now: what waited for it is delivered."""
        with self._lock:
            members = list(self._members)
        for member in members:
            link = member.links.get(address)
            if link is not None and link.waiting:
                member.try_link(address, link)


class MemoryTransport:
    """One node's end of a `MemoryNetwork`; the interface of `transport.Transport`."""

    def __init__(
        self,
        network: MemoryNetwork,
        listen: str,
        options: TransportOptions,
        encryption: Encryption | None,
        screen: Callable[[list[Any]], bool] | None,
    ) -> None:
        self.network = network
        self.listen = listen
        self.options = options
        self.encryption = encryption
        self.screen = screen
        self.inbox: queue.Queue[Received | None] = queue.Queue(options.receive_queue)
        self.bytes_out = 0
        self.bytes_in = 0
        self.bytes_out_by_kind: Counter[str] = Counter()
        self.dropped = 0
        self.last_proof_of_life: dict[str, float] = {}
        self.reached: dict[str, bytes | None] = {}
        self.reached_count = 0
        self.unheard: set[str] = set()
        self.unheard_count = 0
        self.refused_handshakes = 0
        self.failed_handshakes: Counter[str] = Counter()
        self.links: dict[str, _Link] = {}
        self._closing = threading.Event()

    @property
    def caught_up_at(self) -> float:
        return time.monotonic()  # whatever was carried is in the inbox already

    # --- the interface of Transport --------------------------------------------------

    def send(
        self,
        address: str,
        frames: Sequence[Any],
        server_key: bytes | None = None,
        *,
        kind: str = "",
        proves_life: bool = False,
    ) -> None:
        self._post(address, frames, server_key, kind, proves_life, once=False)

    def send_once(
        self, address: str, frames: Sequence[Any], server_key: bytes | None = None, kind: str = ""
    ) -> None:
        self._post(address, frames, server_key, kind, False, once=True)

    def connections(self) -> int:
        return len(self.links)

    def sent_by_kind(self) -> dict[str, int]:
        return dict(self.bytes_out_by_kind)

    def thread_ids(self) -> list[int]:
        return []  # the network's carrier thread is every endpoint's, no one's own

    def wake_reader(self) -> None:
        try:
            self.inbox.put_nowait(None)
        except queue.Full:
            pass

    def forget(self, address: str, drain: bool = False) -> None:
        if not self._closing.is_set():
            self.network.post(lambda: self._unlink(address))

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        self.network.leave(self)

    # --- on the network's thread -----------------------------------------------------

    def _post(
        self,
        address: str,
        frames: Sequence[Any],
        server_key: bytes | None,
        kind: str,
        proves_life: bool,
        once: bool,
    ) -> None:
        if self._closing.is_set():
            return
        if self.encryption is not None and server_key is None:
            self.dropped += 1  # an encrypted mesh cannot dial a node whose key it lacks
            return
        copied = [bytes(memoryview(frame)) for frame in frames]  # as bytes on a wire
        self.network.post(lambda: self._carry(address, copied, server_key, kind, proves_life, once))

    def _carry(
        self,
        address: str,
        frames: list[bytes],
        server_key: bytes | None,
        kind: str,
        proves_life: bool,
        once: bool,
    ) -> None:
        link = self.links.get(address)
        if once and (link is None or link.server_key != server_key):
            self._send_once(address, frames, server_key, kind)
            return
        if link is not None and server_key is not None and link.server_key != server_key:
            self._unlink(address)  # another node (another key) answers there now
            link = None
        if link is None:
            link = self.links[address] = _Link(server_key)
        if len(link.waiting) >= self.options.send_hwm:
            self.dropped += 1
            return
        self._count_out(address, frames, kind, proves_life)
        link.waiting.append(frames)
        self.try_link(address, link)

    def try_link(self, address: str, link: _Link) -> None:
        """Connect `link` if a node listens at `address` and takes us, and deliver what
        waits on it."""
        there = self.network.listener(address)
        if there is None:
            if address not in self.unheard:
                self.unheard.add(address)
                self.unheard_count += 1
                self.wake_reader()
            return
        self.unheard.discard(address)
        if not link.connected:
            if not self._handshake(there, link.server_key, address):
                return
            link.connected = True
            if address not in self.reached:
                self.reached[address] = link.server_key
                self.reached_count += 1
                self.wake_reader()
        while link.waiting:
            there.arrive(link.routing_id, link.waiting.popleft(), self)

    def _send_once(
        self, address: str, frames: list[bytes], server_key: bytes | None, kind: str
    ) -> None:
        """A message over a connection of its own: lost where nobody answers."""
        there = self.network.listener(address)
        if there is None or not self._handshake(there, server_key, address):
            return
        self._count_out(address, frames, kind, False)
        there.arrive(os.urandom(5), frames, self)

    def _handshake(self, there: MemoryTransport, server_key: bytes | None, address: str) -> bool:
        """Whether a connection to `there`, dialled with `server_key`, is made: both ends
        encrypt or neither does, the key is the node's, and its allowlist takes ours."""
        ours, theirs = self.encryption, there.encryption
        if ours is None and theirs is None:
            return True
        if ours is None or theirs is None or server_key != theirs.public_key:
            self.failed_handshakes[address] += 1
            return False
        if theirs.admit is not None and not theirs.admit(ours.public_key):
            there.refused_handshakes += 1
            self.failed_handshakes[address] += 1
            return False
        return True

    def arrive(self, routing_id: bytes, frames: list[bytes], sender: MemoryTransport) -> None:
        """A message for this node, read as its socket would read it."""
        if self._closing.is_set():
            return
        size = sum(len(frame) for frame in frames)
        self.bytes_in += size
        if size >= self.options.screen_bytes and self.screen and not self.screen(list(frames)):
            return
        try:
            self.inbox.put_nowait(Received(routing_id, list(frames)))
        except queue.Full:
            sender.dropped += 1

    def _count_out(self, address: str, frames: list[bytes], kind: str, proves_life: bool) -> None:
        size = sum(len(frame) for frame in frames)
        self.bytes_out += size
        self.bytes_out_by_kind[kind] += size
        if proves_life:
            self.last_proof_of_life[address] = time.monotonic()

    def _unlink(self, address: str) -> None:
        self.links.pop(address, None)
        self.reached.pop(address, None)
        self.last_proof_of_life.pop(address, None)
        self.failed_handshakes.pop(address, None)
        self.unheard.discard(address)
