"""Whether a node's peers are alive, and that they know it is: heartbeats, down marks,
and forgetting the peers nobody answers for (WIRE.md 7.1, 7.3).

A peer is reached once its address answered a handshake with its own key; one never
reached, or one that left long ago, is forgotten, so that what strangers can make a
node hold and dial is bounded in time as well as in number.
"""

from __future__ import annotations

import logging
import time

from .handshake import curve_key_of
from .membership import LEFT, PeerEntry
from .parts import Host
from .wire import Message

log = logging.getLogger("meshfl.endpoint")

# A peer that was sent other messages still gets a heartbeat this many periods apart.
BEAT_ANYWAY_PERIODS = 5


class Liveness:
    """The liveness of one endpoint's peers (`endpoint`)."""

    def __init__(self, endpoint: Host) -> None:
        self.endpoint = endpoint
        self.last_beat: dict[str, float] = {}  # address -> when we last heartbeat it
        self._reached_seen = 0  # transport.reached_count when we last looked

    def on_heartbeat(self, message: Message) -> None:
        """A peer's heartbeat refreshes it; a stranger's is the overlay's to judge."""
        endpoint = self.endpoint
        if endpoint.table.heard_from(message.sender, message.round) is not None:
            return
        name, address = message.body.get("name"), message.body.get("addr")
        if not isinstance(address, str):  # the decoder checked any address it carries
            return
        endpoint.overlay.on_stranger_heartbeat(message, name, address)

    def on_bye(self, message: Message) -> None:
        """A peer that says it leaves is marked so, and its connection let go."""
        entry = self.endpoint.table.mark_left(message.sender)
        if entry is not None:
            log.info("%s: %s left", self.endpoint.settings.name, entry.name)
            self.endpoint.transport.forget(entry.address)

    def tick(self) -> None:
        """Mark silent peers down, and heartbeat each peer we told nothing for a while.
        In a mesh of more than HEARTBEAT_FANOUT peers both waits stretch with its size
        (membership.liveness_stretch); any other message is as good as a heartbeat, but
        every BEAT_ANYWAY_PERIODS a heartbeat goes anyway: only it (or a hello) makes us
        known to a peer that lost us, say one restarted since."""
        endpoint = self.endpoint
        table, interval = endpoint.table, endpoint.settings.heartbeat_interval
        now = time.monotonic()
        last_sent = endpoint.transport.last_proof_of_life
        with endpoint.lock:
            self.note_reached()
            grace = 2 * endpoint.settings.peer_timeout * table.stretch()  # for a starved host
            self._forget_stale(now, grace)
            again = endpoint.handshake.again(now, grace)
            for entry in table.expire():
                if entry.reached:  # one never reached is a stranger's word: forgotten soon
                    name = endpoint.settings.name
                    log.warning("%s: peer %s (%s) is down", name, entry.name, entry.address)
                endpoint.overlay.on_down(entry)
            again, shuffle = endpoint.overlay.beat(now, again)
            period = interval * table.stretch()
            # Silent for a period, give or take half a tick: the last tick's heartbeat
            # left (and was timed) a moment after that tick.
            quiet = period - interval / 2
            anyway = BEAT_ANYWAY_PERIODS * period
            targets = [
                entry.address
                for entry in table.entries.values()
                if entry.state != LEFT
                and (
                    now - last_sent.get(entry.address, -period) >= quiet
                    or now - self._beat_clock(entry.address, now) >= anyway
                )
            ]
            endpoint.note_change()
        self.heartbeat(targets, now)
        for address, wants_peers in again:
            endpoint.handshake.say_hello(address, wants_peers)
        if shuffle is not None:
            endpoint.send(*shuffle)

    def _beat_clock(self, address: str, now: float) -> float:
        """When we last heartbeat `address`, or first looked at it: a peer is met by a
        hello or its answer, which makes us known as a heartbeat would, so its first
        beat anyway is due a whole BEAT_ANYWAY_PERIODS on. (Beating every new
        neighbour at once cost a mesh whose views change often a message each way per
        link, a third of its heartbeats.)"""
        return self.last_beat.setdefault(address, now)

    def heartbeat(self, addresses: list[str], now: float) -> None:
        body = self.endpoint.handshake.hello_body()
        for address in addresses:
            self.last_beat[address] = now
            self.endpoint.send(address, "heartbeat", body)

    def note_new_reached(self) -> None:
        """`note_reached`, if the transport reached an address since we last looked."""
        if self.endpoint.transport.reached_count != self._reached_seen:
            with self.endpoint.lock:
                self.note_reached()

    def note_reached(self) -> None:
        """Mark the peers whose address answered a handshake with their own key
        (transport.reached: the CURVE key dialled, None unencrypted)."""
        self._reached_seen = self.endpoint.transport.reached_count
        for entry in list(self.endpoint.table.entries.values()):
            self.mark_if_reached(entry)

    def mark_if_reached(self, entry: PeerEntry) -> None:
        endpoint = self.endpoint
        reached = endpoint.transport.reached
        if entry.reached or entry.address not in reached:
            return
        dialled = reached[entry.address]
        if dialled is None or dialled == curve_key_of(entry.public_key):
            endpoint.table.mark_reached(entry.public_key)
            log.info("%s: %s joined from %s", endpoint.settings.name, entry.name, entry.address)

    def _forget_stale(self, now: float, grace: float) -> None:
        """Forget peers no node answered for within `grace` of their coming at their
        address, and peers left for `forget_after`: what strangers can make this node
        hold and dial is bounded in time as well as in number (WIRE.md 7.1). A reached
        peer that is down is kept (and greeted: a partition heals) until room is needed."""
        endpoint = self.endpoint
        forget_after = endpoint.settings.forget_after
        stale = [
            entry
            for entry in endpoint.table.entries.values()
            if (not entry.reached and now - entry.entered > grace)
            or (entry.state == LEFT and now - entry.since > forget_after)
        ]
        for entry in stale:
            endpoint.forget(entry)
        if stale:
            log.info(
                "%s: forgot %d peer(s) gone or never reached (latest: %s at %s)",
                endpoint.settings.name,
                len(stale),
                stale[-1].name,
                stale[-1].address,
            )
