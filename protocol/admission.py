"""Who and what a node lets in: the keys the decoder admits, the peers its table takes,
the big messages that may wait for its worker, and the nodes of other meshes it notes.

What strangers can make a node hold, dial or check is bounded (WIRE.md 7.1, 7.3, 7.8,
10): each refusal is counted by its reason, beside the decoder's.
"""

from __future__ import annotations

from typing import Any

from .handshake import curve_key_of
from .inbox import INBOX_FULL
from .membership import ALIVE
from .parts import Host, OtherMesh, RateLimit
from .transport import Encryption
from .wire import BLOB_KINDS, Message, Rejected, SignedClaim

ADDRESS_TAKEN = "address_taken"  # another key claims the address of a reached peer
TABLE_FULL = "table_full"  # no room for a new peer (or for one more not yet reached)
# Nodes of other meshes noted (and answered) at most: strangers cannot grow it for good.
MAX_OTHER_MESHES = 64


class Admission:
    """The admission checks of one endpoint (`endpoint`)."""

    def __init__(self, endpoint: Host) -> None:
        self.endpoint = endpoint
        self._about_checks = RateLimit(endpoint.settings.status_per_second)

    def encryption(self) -> Encryption | None:
        """The endpoint's CURVE keys, and in a closed mesh the client keys its handshake
        admits (WIRE.md 1.1); None where the mesh does not encrypt."""
        settings, identity = self.endpoint.settings, self.endpoint.identity
        if not settings.encrypt:
            return None
        admit = None
        if settings.allowlist is not None:
            listed = {curve_key_of(key) for key in [*settings.allowlist, identity.public_key]}
            admit = listed.__contains__
        return Encryption(identity.curve_public_key, identity.curve_secret_key, admit)

    # --- the decoder's hooks -------------------------------------------------------------

    def admit(self, message: Message) -> str | None:
        """A closed mesh's keys only (and our own)."""
        allowlist = self.endpoint.settings.allowlist
        sender = message.sender
        if allowlist is not None and sender not in allowlist and sender != self._own_key:
            return "unknown_sender"
        return None

    def accept(self, message: Message) -> str | None:
        """No second live instance of a key, ours included."""
        endpoint = self.endpoint
        if message.kind == "status":
            return None  # asking takes no part in the mesh: a probe may borrow a live key
        if message.sender == self._own_key:
            # Our twin's `refuse` is signed with our own key: it is the answer we wait for.
            if message.instance == endpoint.instance or message.kind == "refuse":
                return None
            return "duplicate_key"
        address = message.body.get("addr") if message.kind in ("hello", "heartbeat") else None
        with endpoint.lock:
            if endpoint.table.conflicting_instance(message.sender, message.instance, address):
                return "duplicate_key"
        return None

    @property
    def _own_key(self) -> bytes:
        return self.endpoint.identity.public_key

    # --- the peer table ------------------------------------------------------------------

    def may_enter(self, public_key: bytes, name: object, address: str) -> bool:
        """Whether a peer may enter the table at `address`, new or moved there: a name and
        an address no other live key holds, and room. Counted when refused."""
        endpoint = self.endpoint
        table, settings, rejections = endpoint.table, endpoint.settings, endpoint.flow_rejections
        if self.name_refused(public_key, name):
            return False
        holder = table.holder_of(address)
        if holder is not None and holder.public_key != public_key:
            rejections[ADDRESS_TAKEN] += 1
            return False
        known = table.get(public_key)
        if known is not None and known.address == address:
            return True
        if known is None and (refusal := endpoint.overlay.refusal(str(name), address)):
            rejections[refusal] += 1
            return False
        # New here: it will be dialled, so it counts as unreached, whoever it is.
        self._make_room(public_key)
        entries = table.entries.values()
        unreached = sum(not entry.reached for entry in entries if entry is not known)
        full = len(entries) - (known is not None) >= settings.max_peers
        if full or unreached >= settings.max_unreached:
            rejections[TABLE_FULL] += 1
            return False
        return True

    def _make_room(self, newcomer: bytes) -> None:
        """Before `newcomer` enters: with `max_unreached` unreached peers, forget the one
        that came first (an honest peer is reached within moments, a stranger's address
        never); with `max_peers` in all, the one unreached, left or down longest. A
        reached, alive peer never makes room."""
        endpoint = self.endpoint
        others = [e for e in endpoint.table.entries.values() if e.public_key != newcomer]
        unreached = [entry for entry in others if not entry.reached]
        if len(unreached) >= endpoint.settings.max_unreached:
            endpoint.forget(min(unreached, key=lambda entry: entry.entered))
        elif len(others) >= endpoint.settings.max_peers:
            gone = [entry for entry in others if entry.state != ALIVE or not entry.reached]
            if gone:
                endpoint.forget(min(gone, key=lambda entry: (entry.reached, entry.since)))

    def name_refused(self, key: bytes, name: object) -> bool:
        """True (and counted) when `key` may not go by `name` (membership.name_refusal):
        names are how rules and metrics tell peers apart, so two live keys never share one
        and nobody takes this node's own."""
        endpoint = self.endpoint
        refusal = endpoint.table.name_refusal(key, name, endpoint.settings.name)
        if refusal is not None:
            endpoint.flow_rejections[refusal] += 1
        return refusal is not None

    # --- what arrives --------------------------------------------------------------------

    def worth_holding(self, frames: list[Any]) -> bool:
        """Whether a big message that just arrived may wait for the worker: authentic (its
        header signature checks), and a blob this node asked its sender for or a direct
        message it reads from a peer with room for it. Anything else is dropped as it
        arrives, counted as the worker would, so nobody can queue big messages here
        (WIRE.md 10). Runs on the transport's I/O thread."""
        endpoint = self.endpoint
        try:
            message = endpoint.decoder.screen(frames)
        except Rejected:
            return False
        sender, kind = message.sender, message.kind
        with endpoint.lock:
            if kind == "blob":
                if endpoint.blobs.awaits_blob_from(sender):
                    return True
                endpoint.received["unrequested_blob"] += 1
            elif kind not in BLOB_KINDS:
                endpoint.flow_rejections["bad_header"] += 1
            else:
                refusal = endpoint.inbox.refusal(kind, sender)
                if refusal is None and endpoint.table.get(sender) is None:
                    refusal = INBOX_FULL  # a stranger has no room in it
                if refusal is None:
                    return True
                endpoint.flow_rejections[refusal] += 1
        return False

    def meet_other_mesh(self, claim: SignedClaim) -> None:
        """A signed hello of another mesh that says what that mesh is: noted once per key,
        told to the node, and answered with our own hello unless it answers ours, so that its
        node can say how the two differ too (WIRE.md 7.8). Neither joins the other. Its
        signature is checked only for a new key, room left and at most status_per_second
        a second: another mesh's hellos must not buy a flood of signature checks."""
        endpoint = self.endpoint
        met_before = endpoint.other_meshes
        message = claim.message
        if message.sender in met_before or len(met_before) >= MAX_OTHER_MESHES:
            return
        if not self._about_checks.allow() or not claim.authentic():
            return
        body = message.body
        met = OtherMesh(body["name"], body["addr"], dict(body["about"]))
        met_before[message.sender] = met
        if endpoint.settings.about is not None and not endpoint.handshake.awaits(met.address):
            # (a node we greeted has our `about` already: its answer is not answered)
            hello = endpoint.handshake.hello_body(False)
            endpoint.send(met.address, "hello", hello, once=True, key=message.sender)
        endpoint.on_other_mesh(met)
