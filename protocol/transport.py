"""How bytes move: one bound ROUTER in, one DEALER per peer address out.

All socket work happens on one I/O thread, because ZeroMQ sockets are not
thread-safe. Other threads hand it messages through a FIFO queue and wake it
through a pipe, so messages leave in exactly the order they were queued (the
receiver's replay check depends on that order). Received messages go to a
bounded queue that the caller drains; when that queue is full the I/O thread
stops reading and ZeroMQ's high-water marks push back on the senders.

With `Encryption`, every socket speaks ZeroMQ CURVE (WIRE.md section 1.1): the ROUTER
is a CURVE server holding the node's key pair, each DEALER a CURVE client that must be
told the key of the node it dials. In a closed mesh a ZAP handler, answered on the I/O
thread, admits at the handshake only the client keys the mesh lists, so an unlisted
node never gets a message decoded. Each transport has a ZeroMQ context of its own,
because a context has exactly one ZAP handler.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from .errors import UserError
from .identity import is_usable_public_key

log = logging.getLogger("meshfl.transport")

# libzmq asks a context's ZAP handler at this fixed inproc address (ZeroMQ RFC 27).
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
# The events a socket monitor reports: a failed handshake is the only sign, at this
# layer, of a node that does not encrypt (protocol version 2) or holds another key.
_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
INCOMING = "incoming"  # what the ROUTER's monitor watches: connections to us
# A DEALER is watched until its first handshake succeeds, then its monitor is closed: a
# monitor costs two sockets, and a node of a 100-node mesh dials 99 peers (node hosts
# run dozens of nodes under one open-files limit).
# A connection retried with none made since the last try was refused: nobody listens.
_DEALER_EVENTS = (
    _HANDSHAKE_FAILURES
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_RETRIED
)


class LogOnce:
    """Logs a warning once per (kind, subject), and at most `limit` such lines per
    `period` seconds in all: a stranger who varies the subject (a fresh connection, key
    or address each time) must not fill the log. What is not logged is still counted
    where the caller counts it."""

    def __init__(self, logger: logging.Logger, limit: int = 200, period: float = 3600.0) -> None:
        self.logger = logger
        self.limit = limit
        self.period = period
        self._seen: set[tuple[str, object]] = set()
        self._since = time.monotonic()
        self._quiet = False

    def __call__(self, kind: str, subject: object, text: str, *args: Any) -> None:
        if time.monotonic() - self._since > self.period:
            self._seen.clear()
            self._since, self._quiet = time.monotonic(), False
        if (kind, subject) in self._seen:
            return
        if len(self._seen) >= self.limit:
            if not self._quiet:
                self._quiet = True
                self.logger.warning(
                    "%d distinct problems logged in the last %.0f s; further ones are only "
                    "counted until then (see `meshfl status`)",
                    self.limit,
                    self.period,
                )
            return
        self._seen.add((kind, subject))
        self.logger.warning(text, *args)


class TransportError(UserError):
    """The transport cannot start (bad address, port in use); one line for the user."""


class BadContact(ValueError):
    """A contact that is neither tcp://HOST:PORT nor KEY@tcp://HOST:PORT."""


def split_contact(contact: str) -> tuple[str, bytes | None]:
    """(address, Ed25519 public key or None) of `KEY@tcp://HOST:PORT` (KEY: 64 hex
    digits) or of a bare `tcp://HOST:PORT`. An encrypted node is dialled with its key."""
    key_hex, at, address = contact.rpartition("@")
    if not at:
        return contact, None
    try:
        key = bytes.fromhex(key_hex)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise BadContact(
            f"{contact!r}: the part before @ must be a node's public key, 64 hex digits"
        )
    if not is_usable_public_key(key):
        raise BadContact(f"{contact!r}: {key_hex} is a key of small order, which no node holds")
    return address, key


def contact(address: str, public_key: bytes) -> str:
    """How others dial a node: `KEY@ADDRESS`, KEY the hex of its Ed25519 public key."""
    return f"{public_key.hex()}@{address}"


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
class Encryption:
    """The CURVE settings of a transport; a transport without them speaks plain TCP."""

    public_key: bytes  # this node's CURVE key pair, 32 raw bytes each
    secret_key: bytes
    # Closed mesh: which client CURVE keys may complete a handshake; None admits any.
    admit: Callable[[bytes], bool] | None = None


def curve_client(sock: zmq.Socket, encryption: Encryption, server_key: bytes) -> None:
    """Make `sock` a CURVE client of the node whose CURVE key is `server_key`; before
    it connects."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, encryption.public_key)
    sock.setsockopt(zmq.CURVE_SECRETKEY, encryption.secret_key)


def curve_server(sock: zmq.Socket, encryption: Encryption) -> None:
    """Make `sock` a CURVE server holding `encryption`'s key pair; before it binds."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, encryption.secret_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, encryption.public_key)


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
    # A message at least this big is screened as it arrives (`Transport.screen`): one
    # its receiver would not keep is freed at once, not queued for the decoder.
    screen_bytes: int = 1 << 20
    # ZeroMQ sockets in this transport's context (libzmq's default is 1023): a DEALER
    # per peer, plus a two-socket monitor for each one not yet through its handshake.
    max_sockets: int = 4096
    # How long the I/O thread sleeps with nothing to do before it notes again that it
    # has read everything (`caught_up_at`): the most a node's peers are judged late (an
    # endpoint sets its heartbeat interval, stretched for a host's crowd of nodes).
    idle_check_s: float = 1.0


@dataclass(frozen=True)
class Received:
    routing_id: bytes
    frames: list[Any]  # zmq.Frame objects: the bytes stay where ZeroMQ put them
    # When the socket thread read it (monotonic): a peer was alive then, however long
    # the message waits in the inbox of a busy node.
    arrived: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class _Outgoing:
    address: str
    frames: Sequence[Any]  # empty: close the DEALER to `address`
    server_key: bytes | None = None  # the CURVE key of the node at `address`
    once: bool = False
    kind: str = ""  # what the message is, for the count of bytes that left by kind
    proves_life: bool = False  # when it leaves, it stands in for a heartbeat (WIRE.md 7.3)


class Transport:
    def __init__(
        self,
        listen: str,
        options: TransportOptions = TransportOptions(),
        encryption: Encryption | None = None,
        screen: Callable[[list[Any]], bool] | None = None,
    ) -> None:
        """`screen`: called on the I/O thread with each message of `screen_bytes` or
        more as it arrives; False frees it at once. It must be quick: it runs between
        reads."""
        self.listen = listen
        self.screen = screen
        self.options = options
        self.encryption = encryption
        # What arrived, in order; None only wakes the reader (a new address reached,
        # or `wake_reader`), so that it can block until there is something to do.
        self.inbox: queue.Queue[Received | None] = queue.Queue(options.receive_queue)
        # When the I/O thread last found nothing more to read (monotonic): whatever
        # arrived before then is in `inbox`. A node whose I/O thread waits its turn at a
        # busy host's GIL has messages waiting unread in ZeroMQ; it must not take their
        # senders for silent (Endpoint._read_up_to).
        self.caught_up_at = time.monotonic()
        self.bytes_out = 0
        self.bytes_in = 0
        # What left, counted when ZeroMQ took it (not when it was queued here): messages
        # dropped at the high-water mark are in `dropped` instead.
        self.bytes_out_by_kind: Counter[str] = Counter()
        self.dropped = 0  # messages dropped unsent: high-water mark, undiallable address
        # address -> when a message that proves life last left for it (monotonic)
        self.last_proof_of_life: dict[str, float] = {}
        # Addresses whose DEALER, open now, has completed its handshake, with the CURVE
        # key it dialled (None unencrypted): a node there answers, and holds that key.
        self.reached: dict[str, bytes | None] = {}
        self.reached_count = 0  # moves on each new one: a cheap "anything new?" for readers
        # Addresses dialled where the connection was refused with none made since the
        # last try (nobody listens: a node gone), and a count that moves on each new one.
        self.unheard: set[str] = set()
        self.unheard_count = 0
        self._connected: set[str] = set()  # dialled addresses connected since the last try
        # Unexpected errors of the I/O thread, contained and counted, by where they came.
        self.faults: Counter[str] = Counter()
        self._counting = threading.Lock()  # other threads copy the counters under it
        # Connections the ZAP handler turned away (closed mesh): client key not listed.
        self.refused_handshakes = 0
        # Failed encrypted handshakes, by the address we dialled or INCOMING.
        self.failed_handshakes: Counter[str] = Counter()
        self._log_once = LogOnce(log)
        self._closing = threading.Event()
        self._outbox: queue.Queue[_Outgoing | None] = queue.Queue()  # None: stop
        self._wake_read, self._wake_write = os.pipe()
        # Whether the I/O thread has a wake-up byte it has not read yet: the senders of a
        # burst (a round's announces, a tick's heartbeats) write one between them.
        self._wake_pending = False
        # Non-blocking: a full pipe already means "wake up", so a lost byte is harmless.
        os.set_blocking(self._wake_write, False)
        self._context = zmq.Context()
        self._context.set(zmq.MAX_SOCKETS, options.max_sockets)
        self._poller = zmq.Poller()
        self._zap = self._serve_zap()
        self._router = self._bind(listen)
        # address -> (DEALER, the CURVE key it dials with)
        self._dealers: dict[str, tuple[zmq.Socket, bytes | None]] = {}
        self._monitors: dict[zmq.Socket, str] = {}  # monitor socket -> what it watches
        self._monitor(self._router, INCOMING)
        self._thread = threading.Thread(target=self._run, name=f"io {listen}", daemon=True)
        self._thread.start()

    def _serve_zap(self) -> zmq.Socket | None:
        if self.encryption is None or self.encryption.admit is None:
            return None  # libzmq admits every CURVE client when no ZAP handler is bound
        zap = self._context.socket(zmq.REP)
        zap.setsockopt(zmq.LINGER, 0)
        zap.bind(ZAP_ENDPOINT)
        return zap

    def _bind(self, listen: str) -> zmq.Socket:
        router = self._context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVHWM, self.options.receive_hwm)
        router.setsockopt(zmq.MAXMSGSIZE, self.options.max_frame_bytes)
        router.setsockopt(zmq.IPV6, 1)
        if self.encryption is not None:
            curve_server(router, self.encryption)
        try:
            router.bind(listen)
        except zmq.ZMQError as err:
            router.close()
            if self._zap is not None:
                self._zap.close()
            self._context.term()
            reason = "port in use" if err.errno == zmq.EADDRINUSE else err.strerror
            raise TransportError(f"cannot listen on {listen}: {reason}") from None
        return router

    def send(
        self,
        address: str,
        frames: Sequence[Any],
        server_key: bytes | None = None,
        *,
        kind: str = "",
        proves_life: bool = False,
    ) -> None:
        """Queue one message for `address`; never blocks, safe from any thread.
        `server_key`: the CURVE public key of the node there, needed when encrypting;
        `kind` and `proves_life`: what is counted when the message leaves."""
        self._queue(_Outgoing(address, frames, server_key, kind=kind, proves_life=proves_life))

    def send_once(
        self, address: str, frames: Sequence[Any], server_key: bytes | None = None, kind: str = ""
    ) -> None:
        """Send one message over a connection of its own, closed once it is out: for an
        answer to a node that is no peer (a status probe), which a DEALER kept open
        would go on redialling after the probe is gone. Where a connection to `address`
        is open already, over that one: messages to one node leave over one connection,
        in sequence order (WIRE.md 1)."""
        self._queue(_Outgoing(address, frames, server_key, once=True, kind=kind))

    def connections(self) -> int:
        """The connections this node dialled that are open now (one per peer it sends
        to); safe from any thread."""
        return len(self._dealers)

    def sent_by_kind(self) -> dict[str, int]:
        """Bytes that left, by message kind; safe from any thread."""
        with self._counting:
            return dict(self.bytes_out_by_kind)

    def thread_ids(self) -> list[int]:
        """The native id of the thread that moves this transport's messages."""
        native_id = self._thread.native_id
        return [] if native_id is None else [native_id]

    def _queue(self, item: _Outgoing) -> None:
        if self._closing.is_set():
            return
        self._outbox.put(item)
        self._wake()

    def _wake(self) -> None:
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            os.write(self._wake_write, b"x")
        except BlockingIOError:
            pass

    def wake_reader(self) -> None:
        """Wake whoever waits on the inbox; safe from any thread. A full inbox wakes its
        reader anyway."""
        try:
            self.inbox.put_nowait(None)
        except queue.Full:
            pass

    def forget(self, address: str, drain: bool = False) -> None:
        """Close the DEALER to a peer that left (done on the I/O thread). `drain`: let
        what was queued for it leave first, as `send_once` does (a last word)."""
        self._queue(_Outgoing(address, (), once=drain))

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
        for sock in (self._router, self._wake_read, self._zap, *self._monitors):
            if sock is not None:
                self._poller.register(sock, zmq.POLLIN)
        try:
            while True:
                events = dict(self._poller.poll(int(self.options.idle_check_s * 1000)))
                if self._wake_read in events:
                    os.read(self._wake_read, 65536)
                    # Before the outbox is read: what is queued after this wakes us anew.
                    self._wake_pending = False
                    if not self._drain_outbox():
                        return
                if self._zap is not None and self._zap in events:
                    self._contained("handshake check", self._answer_zap)
                for monitor in [m for m in self._monitors if m in events]:
                    self._contained("socket monitor", self._read_monitor, monitor)
                # Even with no message: reading finds none, and notes the time.
                self._contained("receiving", self._receive_some)
        finally:
            self._close_sockets()

    def _contained(self, where: str, step: Callable[..., None], *args: Any) -> None:
        """Run one step of the I/O loop; an error nobody foresaw is logged once (with its
        traceback) and counted, and the loop goes on: whatever a peer sends or names,
        the transport stays up."""
        try:
            step(*args)
        except Exception:
            with self._counting:
                self.faults[where] += 1
            if self.faults[where] == 1:
                log.exception("unexpected error while %s; the transport goes on", where)

    def _close_sockets(self) -> None:
        for address in list(self._dealers):
            self._close_dealer(address, linger=self.options.close_linger_ms)
        for monitor in self._monitors:
            monitor.close(linger=0)
        self._router.close(linger=0)
        if self._zap is not None:
            self._zap.close(linger=0)
        # Closes any socket still open (a one-off answer's) without waiting for it, then
        # returns once the DEALERs' lingering messages are out: a socket left open would
        # otherwise hold the context's termination, and the thread, for good.
        self._context.destroy(linger=0)

    def _receive_some(self) -> None:
        # Read what is there now, but keep turns fair with the outbox.
        for _ in range(64):
            looked = time.monotonic()
            try:
                routing_id, *frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.caught_up_at = looked  # all that had come by then is read
                return
            size = sum(len(frame) for frame in frames)
            self.bytes_in += size
            if size >= self.options.screen_bytes and self.screen and not self.screen(frames):
                continue  # its bytes go back now: no queue of big unverified messages
            self.inbox.put(Received(routing_id.bytes, frames))

    def _answer_zap(self) -> None:
        """One ZAP request (RFC 27: version, request id, domain, address, identity,
        mechanism, credentials...), answered 200 or 400 by the mesh's allowlist."""
        assert self._zap is not None  # polled only when the mesh encrypts
        version, request_id, _domain, peer_ip, _identity, mechanism, *credentials = (
            self._zap.recv_multipart()
        )
        key = credentials[0] if mechanism == b"CURVE" and credentials else b""
        assert self.encryption is not None and self.encryption.admit is not None
        if key and self.encryption.admit(key):
            self._zap.send_multipart([version, request_id, b"200", b"OK", b"", b""])
            return
        self.refused_handshakes += 1
        self._log_once(
            "refused",
            key.hex(),
            "refused a connection from %s at the handshake: "
            "its key (CURVE %s) is not listed in this closed mesh; further ones "
            "are only counted",
            peer_ip.decode(errors="replace"),
            key.hex(),
        )
        self._zap.send_multipart([version, request_id, b"400", b"key not listed", b"", b""])

    def _monitor(self, sock: zmq.Socket, watched: str) -> None:
        """Watch the ROUTER for failed handshakes (encrypted only: the only sign of a
        node of another key or version), and a DEALER until its first handshake: the
        proof that a node answers at its address (`reached`)."""
        if watched == INCOMING and self.encryption is None:
            return
        monitor = sock.get_monitor_socket(
            _HANDSHAKE_FAILURES if watched == INCOMING else _DEALER_EVENTS
        )
        self._monitors[monitor] = watched
        if watched != INCOMING:  # the ROUTER's is registered when the thread starts
            self._poller.register(monitor, zmq.POLLIN)

    def _read_monitor(self, monitor: zmq.Socket) -> None:
        try:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return  # woken with nothing whole to read yet
        watched = self._monitors[monitor]
        if event["event"] == zmq.EVENT_CONNECTED:
            self._connected.add(watched)
            self.unheard.discard(watched)  # someone listens there now
            return
        if event["event"] == zmq.EVENT_CONNECT_RETRIED:
            # Retried after a connection was made: a handshake broken off, counted below
            # when its cause comes; whether anyone still listens, the next retry tells.
            # With no connection made since the last retry: refused, nobody listens at
            # the address (a node that died after we dialled it, too).
            if watched in self._connected:
                self._connected.discard(watched)
            elif watched not in self.unheard:
                self.unheard.add(watched)
                self.unheard_count += 1
                self.wake_reader()
            return
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.reached[watched] = self._dealers[watched][1]
            self.reached_count += 1
            self.wake_reader()
            self._unmonitor(watched)
            return
        if watched == INCOMING and event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return  # our own ZAP refusal: counted and logged where it was made
        self.failed_handshakes[watched] += 1
        why = _handshake_failure(event, watched)
        # Once per end and cause: a broken-off connection often comes before the cause.
        self._log_once(
            "handshake",
            f"{watched} {why}",
            "encrypted handshake with %s failed: %s; further such failures are only counted",
            watched,
            why,
        )

    def _drain_outbox(self) -> bool:
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            self._contained("sending", self._carry_out, item)

    def _carry_out(self, item: _Outgoing) -> None:
        if not item.frames:
            self._close_dealer(item.address, self.options.once_linger_ms if item.once else 0)
        elif item.once:
            self._send_once_now(item)
        else:
            self._send_now(item)

    def _close_dealer(self, address: str, linger: int = 0) -> None:
        dealer, _ = self._dealers.pop(address, (None, None))
        self.reached.pop(address, None)
        self.last_proof_of_life.pop(address, None)
        self.failed_handshakes.pop(address, None)
        self.unheard.discard(address)
        self._connected.discard(address)
        if dealer is None:
            return
        self._unmonitor(address, dealer)
        dealer.close(linger=linger)

    def _unmonitor(self, address: str, dealer: zmq.Socket | None = None) -> None:
        """Stop watching the DEALER to `address` (given, or the one in use)."""
        dealer = dealer if dealer is not None else self._dealers[address][0]
        for monitor in [m for m, watched in self._monitors.items() if watched == address]:
            self._poller.unregister(monitor)
            del self._monitors[monitor]
            dealer.disable_monitor()
            monitor.close(linger=0)

    def _send_now(self, item: _Outgoing) -> None:
        dealer, dialled_with = self._dealers.get(item.address, (None, None))
        if dealer is not None and item.server_key is not None and dialled_with != item.server_key:
            # Another node (another key) now answers at this address: a DEALER dialling
            # with the old key would never complete its handshake.
            self._close_dealer(item.address)
            dealer = None
        if dealer is None:
            dealer = self._connect(item, watched=True)
            if dealer is None:
                return
            self._dealers[item.address] = (dealer, item.server_key)
        self._put(dealer, item)

    def _send_once_now(self, item: _Outgoing) -> None:
        dealer, dialled_with = self._dealers.get(item.address, (None, None))
        if dealer is not None and dialled_with == item.server_key:
            # A connection is open there already (we greet that node, say): the message
            # goes over it, behind what we sent before. Over a second one it could
            # overtake those, and their lower numbers would be refused as replays.
            self._put(dealer, item)
            return
        dealer = self._connect(item)
        if dealer is not None:
            self._put(dealer, item)
            # Closing does not wait: ZeroMQ sends the queued message in the background.
            dealer.close(linger=self.options.once_linger_ms)

    def _connect(self, item: _Outgoing, watched: bool = False) -> zmq.Socket | None:
        """A DEALER dialling `item`'s address (None when it cannot); `watched`: the
        address's own, kept, watched until its first handshake (not a one-off's)."""
        address = item.address
        if self.encryption is not None and item.server_key is None:
            self.dropped += 1
            self._log_once(
                "unkeyed",
                address,
                "cannot dial %s: this mesh is encrypted and "
                "the public key of the node there is unknown (list its public_key "
                "in peers.yaml, or give KEY@%s)",
                address,
                address,
            )
            return None
        dealer = None
        try:
            dealer = self._context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.SNDHWM, self.options.send_hwm)
            dealer.setsockopt(zmq.IMMEDIATE, 0)
            dealer.setsockopt(zmq.IPV6, 1)  # a [IPv6] address is as good as an IPv4 one
            if self.encryption is not None and item.server_key is not None:
                curve_client(dealer, self.encryption, item.server_key)
            if watched:
                # Before it dials: a connection on loopback is made at once, and an event
                # missed would make a broken-off handshake look refused.
                self._monitor(dealer, address)
            dealer.connect(address)
        except zmq.ZMQError as err:
            # A key or address ZeroMQ will not take, or no socket left: this message is
            # lost, the transport is not.
            if dealer is not None:
                if watched:
                    self._unmonitor(address, dealer)
                dealer.close(linger=0)
            self.dropped += 1
            self._log_once("connect", address, "cannot dial %s: %s", address, err.strerror)
            return None
        return dealer

    def _put(self, dealer: zmq.Socket, item: _Outgoing) -> None:
        try:
            dealer.send_multipart(item.frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.dropped += 1
            return
        size = sum(memoryview(frame).nbytes for frame in item.frames)
        with self._counting:
            self.bytes_out += size
            self.bytes_out_by_kind[item.kind] += size
        if item.proves_life:
            self.last_proof_of_life[item.address] = time.monotonic()


def _handshake_failure(event: Mapping[str, Any], watched: str) -> str:
    """Why an encrypted handshake failed, in words, from a socket monitor's event."""
    if (
        event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        and event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    ):
        return (
            "the other side does not encrypt: a meshfl protocol-2 node, or one with "
            "`encrypt: false`; it cannot take part in an encrypted mesh"
        )
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # on a DEALER: we were refused
        return (
            f"the node refused our key (ZAP status {event['value']}): a closed mesh "
            "that does not list this node"
        )
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return (
            "the connection closed during the handshake: the other side may hold "
            "another key than the one it was dialled with, or speak without encryption"
        )
    if watched == INCOMING:
        return (
            "a client did not complete the CURVE handshake: it dialled with another "
            "key than this node's"
        )
    return "the node there holds another key than the one we dialled it with"
