"""Reading a message off the wire: `Decoder` checks every incoming message step by step,
in the order WIRE.md fixes (sizes, envelope, header fields, keys and addresses, mesh,
signature, replays, the data frames' digest, a blob's record), before anything else
of the node reads it, and counts what it drops by reason."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from .addresses import is_wire_endpoint
from .identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    WEAK_KEY,
    is_usable_public_key,
    verify,
)
from .views import MAX_CARDS, card_shape_fault
from .wire import (
    ANY_MESH,
    BLOB_KINDS,
    DIGEST_BYTES,
    DTYPES,
    INSTANCE_BYTES,
    MAX_DIMENSIONS,
    MESH_ID_BYTES,
    PROTOCOL_VERSION,
    RECORD_CONTEXT,
    TOO_MANY_CARDS,
    Blob,
    Limits,
    Message,
    Rejected,
    SignedClaim,
    TensorInfo,
    frames_digest,
    signed_by_sender,
)

# Each header field: (msgpack type, exact length for bytes or None).
_HEADER_FIELDS: dict[str, tuple[type, int | None]] = {
    "v": (int, None),
    "mesh": (bytes, MESH_ID_BYTES),
    "kind": (str, None),
    "from": (bytes, PUBLIC_KEY_BYTES),
    "inst": (bytes, INSTANCE_BYTES),
    "seq": (int, None),
    "round": (int, None),
    "body": (dict, None),
    "digest": (bytes, DIGEST_BYTES),
}

# Required body fields per kind (extra fields are allowed, for forward compatibility).
_BODY_FIELDS: dict[str, dict[str, tuple[type, int | None]]] = {
    "hello": {"name": (str, None), "addr": (str, None)},
    "peers": {"peers": (list, None)},
    "refuse": {"reason": (str, None)},
    "heartbeat": {},
    "bye": {},
    "status": {"addr": (str, None)},
    "status_reply": {"status": (dict, None)},
    "announce": {
        "id": (bytes, DIGEST_BYTES),
        "origin": (bytes, PUBLIC_KEY_BYTES),
        "round": (int, None),
        "kind": (str, None),
        "digest": (bytes, DIGEST_BYTES),
        "size": (int, None),
    },
    "fetch": {"id": (bytes, DIGEST_BYTES)},
    "miss": {"id": (bytes, DIGEST_BYTES)},
    "shuffle": {"cards": (list, None)},
    "shuffle_reply": {"cards": (list, None)},
    "unlink": {},
    **{kind: {"record": (bytes, None), "sig": (bytes, SIGNATURE_BYTES)} for kind in BLOB_KINDS},
}


_PEER_ENTRY_FIELDS: dict[str, tuple[type, int | None]] = {
    "name": (str, None),
    "addr": (str, None),
    "key": (bytes, PUBLIC_KEY_BYTES),
}


def _is_count(value: Any) -> bool:
    """An integer >= 0 on the wire; msgpack's booleans are Python ints, and refused."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_fields(where: str, values: Any, fields: Mapping[str, tuple[type, int | None]]) -> None:
    if not isinstance(values, dict):
        raise Rejected("bad_header", f"{where} is not a map")
    for name, (kind, length) in fields.items():
        value: Any = values.get(name)  # its type is checked just below
        if not (_is_count(value) if kind is int else isinstance(value, kind)):
            raise Rejected(
                "bad_header",
                f"{where}.{name} missing or not "
                f"{'an integer >= 0' if kind is int else kind.__name__}",
            )
        if length is not None and len(value) != length:
            raise Rejected("bad_header", f"{where}.{name} must be {length} bytes")


# The kinds whose body names the sender's own address, where its answers go (`addr`).
_ADDRESSED_KINDS = ("hello", "heartbeat", "status")


def _check_keys_and_addresses(message: Message) -> None:
    """Every public key a message names can be a node's (no small-order key, which would
    sign anything, WIRE.md 2), and every address it names can be dialled (a ZeroMQ TCP
    endpoint): checked before any signature, so a node never dials or trusts either."""
    if not is_usable_public_key(message.sender):
        raise Rejected(WEAK_KEY, "sender")
    body = message.body
    if message.kind in _ADDRESSED_KINDS and "addr" in body and not is_wire_endpoint(body["addr"]):
        raise Rejected("bad_address", f"{message.kind}.body.addr")
    if message.kind == "hello" and not isinstance(body.get("list", True), bool):
        raise Rejected("bad_header", "hello.body.list is not a bool")
    if message.kind == "hello" and "about" in body and not is_about(body["about"]):
        raise Rejected("bad_header", "hello.body.about is not a short map of text")
    if message.kind == "announce" and not is_usable_public_key(body["origin"]):
        raise Rejected(WEAK_KEY, "announce origin")
    if message.kind == "peers" and not isinstance(body.get("linked", True), bool):
        raise Rejected("bad_header", "peers.body.linked is not a bool")
    _check_cards(message)
    if message.kind == "peers":
        for entry in body["peers"]:
            _check_fields("peers entry", entry, _PEER_ENTRY_FIELDS)
            if not is_usable_public_key(entry["key"]):
                raise Rejected(WEAK_KEY, "peers entry")
            if not is_wire_endpoint(entry["addr"]):
                raise Rejected("bad_address", "peers entry")


# A hello's optional `about` (WIRE.md 7.8): what the sender's mesh is, for a human.
MAX_ABOUT_FIELDS = 16
MAX_ABOUT_TEXT = 256


def is_about(value: Any) -> bool:
    """Whether `value` is a well-formed `about`: a map of at most 16 fields, each a
    name of at most 32 characters and a value that is text of at most 256 or an int."""
    return (
        isinstance(value, dict)
        and len(value) <= MAX_ABOUT_FIELDS
        and all(
            isinstance(name, str)
            and 0 < len(name) <= 32
            and (
                (isinstance(text, str) and len(text) <= MAX_ABOUT_TEXT)
                or (isinstance(text, int) and not isinstance(text, bool))
            )
            for name, text in value.items()
        )
    )


def _check_cards(message: Message) -> None:
    """The cards a shuffle (or its answer) carries, and the one a hello or peers may carry, are
    well formed and few (WIRE.md 7.7); their owners' signatures are checked on use."""
    body = message.body
    cards = body.get("cards", []) if message.kind in ("shuffle", "shuffle_reply") else []
    if message.kind in ("hello", "peers") and "card" in body:
        cards = [body["card"]]
    if message.kind in ("shuffle", "shuffle_reply") and not _is_count(body.get("neighbours", 0)):
        raise Rejected("bad_header", f"{message.kind}.body.neighbours is not an integer >= 0")
    if len(cards) > MAX_CARDS:
        raise Rejected(TOO_MANY_CARDS, f"{len(cards)} cards, at most {MAX_CARDS}")
    for card in cards:
        fault = card_shape_fault(card)
        if fault is not None:
            raise Rejected(WEAK_KEY if fault.endswith("weak") else "bad_header", fault)


def _about_claim(message: Message, header_bytes: bytes, signature: bytes) -> SignedClaim | None:
    """A hello of another mesh that says what that mesh is (`about`), for the receiver
    to name both meshes once it checked the signature (WIRE.md 7.8); else None."""
    if message.kind != "hello" or "about" not in message.body:
        return None
    return SignedClaim(message, header_bytes, signature)


def _check_signature(message: Message, header_bytes: bytes, signature: bytes) -> None:
    if not signed_by_sender(message, header_bytes, signature):
        raise Rejected("bad_signature")


# Senders whose last sequence number a decoder keeps (WIRE.md 6): a key unheard from
# for this many others may replay its old messages, each of which says what it said.
MAX_SENDERS = 16384

DEFAULT_LIMITS = Limits()
MessageCheck = Callable[["Message"], "str | None"]


class Decoder:
    """Checks an incoming message step by step, in the order WIRE.md fixes, and counts
    every rejection by reason. One decoder per receiving thread; other threads may read
    the counts through `rejection_counts`."""

    def __init__(
        self,
        mesh_id: bytes | None,
        limits: Limits = DEFAULT_LIMITS,
        schema: bytes | None = None,
        admit: MessageCheck | None = None,
        accept: MessageCheck | None = None,
        kept: Callable[[bytes], bool] | None = None,
    ) -> None:
        self.mesh_id = mesh_id  # None: a probe outside any mesh, which takes every mesh id
        self.limits = limits
        self.schema = schema  # the model schema blobs must match (None: don't check)
        # Hooks returning a rejection reason or None: `admit` before the signature is
        # checked (is this sender allowed at all), `accept` after it (is this process
        # the live holder of its key), so only authentic messages can be refused.
        self.admit = admit
        self.accept = accept
        # The last sequence number of each sender, the least recently heard first: at
        # most MAX_SENDERS of them, so fresh keys cannot grow it without end.
        self.last_seq: OrderedDict[bytes, int] = OrderedDict()
        # Senders whose numbers are never forgotten to make room (the receiver's peers):
        # else a flood of fresh keys would let a peer's old messages replay.
        self.kept = kept
        self.rejections: Counter[str] = Counter()
        self._counting = threading.Lock()  # a reader must not see the counter mid-insert

    def decode(self, frames: Sequence[Any]) -> Message:
        try:
            return self._decode(frames)
        except Rejected as rejection:
            self.count(rejection.reason)
            raise

    def screen(self, frames: Sequence[Any]) -> Message:
        """The checks of `decode` up to the header signature (steps 1 to 11 of WIRE.md 9,
        the sender's admission and sequence number aside), without its side effects: for
        judging a big message as it arrives, on another thread than the decoder's. The
        message is decoded in full later; a rejection here is counted as there."""
        try:
            message, _, signed, signature = self._read_header([memoryview(f) for f in frames])
            _check_signature(message, signed, signature)
            return message
        except Rejected as rejection:
            self.count(rejection.reason)
            raise

    def count(self, reason: str) -> None:
        """Count one message dropped for `reason`; safe from any thread."""
        with self._counting:
            self.rejections[reason] += 1

    def rejection_counts(self) -> dict[str, int]:
        """A copy of the rejection counts, safe to take from any thread."""
        with self._counting:
            return dict(self.rejections)

    def _decode(self, frames: Sequence[Any]) -> Message:
        # Read-only: a zmq.Frame is writable, yet a verified blob must not change in place.
        buffers = [memoryview(frame).toreadonly() for frame in frames]
        message, header, signed, signature = self._read_header(buffers)
        if self.admit is not None and (reason := self.admit(message)):
            raise Rejected(reason)
        if message.seq <= self.last_seq.get(message.sender, -1):
            raise Rejected("replay", f"seq {message.seq}")
        _check_signature(message, signed, signature)
        if self.accept is not None and (reason := self.accept(message)):
            raise Rejected(reason, message=message)
        # Only now, with the signature checked, may the sender's counter move. A status
        # request never moves it: a probe may borrow a live node's key, and its clock-based
        # number must not make that node's own messages look like replays.
        if message.kind != "status":
            self._note_seq(message.sender, message.seq)
        try:
            message.blob = self._check_frames(message, header["digest"], buffers[1:])
        except Rejected as rejection:
            rejection.message = message  # authentic: its sender is to blame for the frames
            raise
        return message

    def _check_frames(self, message: Message, digest: bytes, data: list[memoryview]) -> Blob | None:
        """The blob the frames of an authentic message carry (None for a kind without)."""
        if frames_digest(data) != digest:
            raise Rejected("digest_mismatch")
        if message.kind in BLOB_KINDS:
            return self._check_blob(message.body, digest, data)
        if data:
            raise Rejected("bad_header", f"{message.kind} carries no frames")
        return None

    def _read_header(
        self, buffers: list[memoryview]
    ) -> tuple[Message, dict[str, Any], bytes, bytes]:
        """Steps 1 to 8 of WIRE.md 9: sizes, envelope, header, keys and addresses, mesh.
        Returns the message, its header, the signed header bytes and their signature."""
        self._check_size(buffers)
        header_bytes, signature, header = self._unpack_envelope(buffers[0])
        message = self._check_header(header)
        _check_keys_and_addresses(message)
        if not self._same_mesh(header["mesh"], message.kind):
            raise Rejected("wrong_mesh", claim=_about_claim(message, header_bytes, signature))
        return message, header, header_bytes, signature

    def _note_seq(self, sender: bytes, seq: int) -> None:
        self.last_seq[sender] = seq
        self.last_seq.move_to_end(sender)
        if len(self.last_seq) > MAX_SENDERS:
            forgettable = (key for key in self.last_seq if not (self.kept and self.kept(key)))
            if (oldest := next(forgettable, None)) is not None:
                del self.last_seq[oldest]

    def _same_mesh(self, mesh: bytes, kind: str) -> bool:
        if self.mesh_id is None or mesh == self.mesh_id:
            return True
        return kind == "status" and mesh == ANY_MESH  # asked by a probe that knows no mesh

    def _check_size(self, buffers: list[memoryview]) -> None:
        if len(buffers) > self.limits.max_frames + 1:
            raise Rejected("too_many_frames", f"{len(buffers)} frames")
        if not buffers:
            raise Rejected("bad_header", "empty message")
        total = sum(buffer.nbytes for buffer in buffers)
        limits = self.limits
        if total > limits.max_message_bytes or buffers[0].nbytes > limits.max_envelope_bytes:
            raise Rejected("oversize", f"{total} bytes")

    def _unpack(self, data: Any) -> Any:
        try:
            options = self.limits.unpacker_options()
            return msgpack.unpackb(data, raw=False, strict_map_key=True, **options)
        except Exception as err:  # msgpack raises many types on hostile input
            raise Rejected("bad_msgpack", type(err).__name__) from None

    def _unpack_envelope(self, envelope: memoryview) -> tuple[bytes, bytes, dict[str, Any]]:
        outer = self._unpack(envelope)
        if not (
            isinstance(outer, list)
            and len(outer) == 2
            and all(isinstance(part, bytes) for part in outer)
        ):
            raise Rejected("bad_header", "envelope is not [header, signature]")
        header_bytes, signature = outer
        if len(signature) != SIGNATURE_BYTES:
            raise Rejected("bad_header", "signature length")
        return header_bytes, signature, self._unpack(header_bytes)

    def _check_header(self, header: Any) -> Message:
        _check_fields("header", header, _HEADER_FIELDS)
        if header["v"] != PROTOCOL_VERSION:
            raise Rejected("bad_header", f"version {header['v']}")
        kind = header["kind"]
        if kind not in _BODY_FIELDS:
            raise Rejected("bad_header", f"unknown kind {kind[:32]!r}")
        _check_fields(f"{kind}.body", header["body"], _BODY_FIELDS[kind])
        return Message(
            kind,
            header["from"],
            header["seq"],
            header["round"],
            header["inst"],
            header["body"],
            mesh=header["mesh"],
        )

    def _check_blob(self, body: dict[str, Any], digest: bytes, frames: list[memoryview]) -> Blob:
        record = self._unpack(body["record"])
        if not (isinstance(record, list) and len(record) == 7):
            raise Rejected("bad_header", "blob record is not a 7-item array")
        origin, round_no, kind, schema, record_digest, raw_index, meta = record
        if not (
            isinstance(origin, bytes)
            and len(origin) == PUBLIC_KEY_BYTES
            and _is_count(round_no)
            and isinstance(kind, str)
            and isinstance(schema, bytes)
            and isinstance(record_digest, bytes)
            and isinstance(raw_index, list)
            and isinstance(meta, dict)
        ):
            raise Rejected("bad_header", "blob record fields")
        if not is_usable_public_key(origin):
            raise Rejected(WEAK_KEY, "blob origin")
        if record_digest != digest:
            raise Rejected("digest_mismatch", "record digest differs from the frames'")
        if not verify(origin, body["sig"], RECORD_CONTEXT + body["record"]):
            raise Rejected("bad_origin_signature")
        index = [self._tensor_info(entry) for entry in raw_index]
        # Read by name everywhere past here: a second tensor of one name would hide the first.
        if len({info.name for info in index}) < len(index):
            raise Rejected("duplicate_tensor", "two tensors of one name")
        if len(index) != len(frames):
            raise Rejected("shape_mismatch", f"{len(index)} tensors, {len(frames)} frames")
        for info, frame in zip(index, frames, strict=True):
            if frame.nbytes != info.nbytes:
                raise Rejected("shape_mismatch", f"{info.name}: {frame.nbytes} bytes")
        if self.schema is not None and schema != self.schema:
            raise Rejected("schema_mismatch")
        return Blob(
            origin,
            round_no,
            kind,
            schema,
            digest,
            index,
            meta,
            body["record"],
            body["sig"],
            list(frames),
        )

    @staticmethod
    def _tensor_info(entry: Any) -> TensorInfo:
        if not (
            isinstance(entry, list)
            and len(entry) == 4
            and isinstance(entry[0], str)
            and isinstance(entry[1], str)
            and isinstance(entry[2], list)
            and _is_count(entry[3])
        ):
            raise Rejected("bad_header", "tensor index entry")
        name, dtype, shape, nbytes = entry
        if dtype not in DTYPES:
            raise Rejected("forbidden_dtype", dtype[:32])
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
            raise Rejected("bad_header", f"{name}: shape holds a non-integer")
        if len(shape) > MAX_DIMENSIONS or not all(n >= 0 for n in shape):
            raise Rejected("shape_mismatch", f"{name}: shape")
        if int(np.prod(shape, dtype=object)) * DTYPES[dtype].itemsize != nbytes:
            raise Rejected("shape_mismatch", f"{name}: shape and length disagree")
        return TensorInfo(name, dtype, tuple(shape), nbytes)
