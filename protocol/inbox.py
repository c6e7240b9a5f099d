"""The direct messages a node reads (WIRE.md 4): a coordinator's `upload`s, a client's
`personal` blobs, queued by the endpoint's worker for the node's own thread."""

from __future__ import annotations

import queue
import threading
from collections import Counter

from .wire import Message

UNREAD_DIRECT, INBOX_FULL = "unread_direct", "inbox_full"
# One round's direct message and the next round's may wait together; more is a flood.
MAX_QUEUED_PER_SENDER = 2


class DirectInbox:
    """Queues of the direct `kinds` a node reads, at most MAX_QUEUED_PER_SENDER messages
    of a kind waiting from any one sender: a sender that floods must not fill the node's
    memory (a message may be 256 MiB)."""

    def __init__(self, kinds: frozenset[str]) -> None:
        self.kinds = kinds
        # Made here, not on first use: two threads must never each make one.
        self._queues: dict[str, queue.Queue[Message]] = {kind: queue.Queue() for kind in kinds}
        self._waiting: Counter[tuple[str, bytes]] = Counter()  # (kind, sender) queued
        self._lock = threading.Lock()

    def refusal(self, kind: str, sender: bytes) -> str | None:
        """Why a message of `kind` from `sender` would not be queued now (UNREAD_DIRECT,
        INBOX_FULL); None when there is room for it."""
        if kind not in self.kinds:
            return UNREAD_DIRECT
        with self._lock:
            full = self._waiting[(kind, sender)] >= MAX_QUEUED_PER_SENDER
        return INBOX_FULL if full else None

    def put(self, message: Message) -> str | None:
        """Queue `message`, or say why not (`refusal`)."""
        refusal = self.refusal(message.kind, message.sender)
        if refusal is None:
            with self._lock:
                self._waiting[(message.kind, message.sender)] += 1
            self._queues[message.kind].put(message)
        return refusal

    def next(self, kind: str, timeout: float) -> Message | None:
        """The next message of `kind` within `timeout` seconds, or None."""
        try:
            message = self._queues[kind].get(timeout=timeout)
        except queue.Empty:
            return None
        with self._lock:
            self._waiting[(kind, message.sender)] -= 1
        return message

    def waiting(self) -> dict[str, int]:
        """How many messages of each kind wait to be read."""
        return {kind: box.qsize() for kind, box in self._queues.items()}
