"""The message format: one ZeroMQ multipart message per message.

    frame 0      msgpack [header: bin, signature: bin]   (the envelope)
    frames 1..n  raw array bytes, C order, little endian

`header` is a msgpack map; `signature` is the sender's Ed25519 signature of
HEADER_CONTEXT + header, so the exact signed bytes travel on the wire and no
canonical re-encoding is needed. The header carries the BLAKE3 digest of frames 1..n.
Blobs add a record signed by their origin, so a relayed blob stays verifiable; a blob
is named by the sha256 of that record (its id), not by its tensors alone.
protocol/WIRE.md is the full specification; this module implements it.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
from blake3 import blake3

from .identity import WEAK_KEY, Identity, node_id, verify

# 2: data frames digested with BLAKE3 instead of SHA-256; 3: every connection encrypted
# with ZeroMQ CURVE under keys derived from the nodes' Ed25519 keys (WIRE.md 1.1).
PROTOCOL_VERSION = 3
HEADER_CONTEXT = b"meshfl/3 header\n"
RECORD_CONTEXT = b"meshfl/3 blob\n"
DIGEST_BYTES = 32
MESH_ID_BYTES = 16
INSTANCE_BYTES = 8

KINDS = (
    "hello",
    "peers",
    "refuse",
    "heartbeat",
    "bye",
    "announce",
    "fetch",
    "miss",
    "blob",
    "upload",
    "personal",
    "status",
    "status_reply",
    "shuffle",
    "shuffle_reply",
    "unlink",
)
BLOB_KINDS = ("blob", "upload", "personal")  # kinds whose frames are a signed blob
# The mesh id of a `status` request from a probe that belongs to no mesh (WIRE.md 7.6).
ANY_MESH = bytes(MESH_ID_BYTES)

DTYPES: dict[str, np.dtype[Any]] = {  # wire name -> numpy dtype; nothing else is ever decoded
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "bfloat16": np.dtype("<u2"),  # bits only: codecs.py widens it to float32
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "bool": np.dtype("?"),
}

TOO_MANY_CARDS = "too_many_cards"

MAX_DIMENSIONS = 64  # numpy's own limit: a tensor with more could not even be built

REJECTION_REASONS = (
    "oversize",
    "too_many_frames",
    "bad_msgpack",
    "bad_header",
    WEAK_KEY,
    "bad_address",
    "too_many_cards",
    "wrong_mesh",
    "unknown_sender",
    "duplicate_key",
    "replay",
    "bad_signature",
    "digest_mismatch",
    "bad_origin_signature",
    "forbidden_dtype",
    "shape_mismatch",
    "duplicate_tensor",
    "schema_mismatch",
)


class Rejected(Exception):
    """A message the decoder refused; `reason` is one of REJECTION_REASONS."""

    def __init__(
        self,
        reason: str,
        detail: str = "",
        message: Message | None = None,
        claim: SignedClaim | None = None,
    ) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.message = message  # set when the rejected message was authentic (signature ok)
        self.claim = claim  # a hello of another mesh saying what it is, signature unchecked


@dataclass(frozen=True)
class SignedClaim:
    """A message refused before its signature was checked, kept with what checks it:
    the receiver decides whether it is worth a signature check (WIRE.md 7.8)."""

    message: Message
    header_bytes: bytes
    signature: bytes

    def authentic(self) -> bool:
        return signed_by_sender(self.message, self.header_bytes, self.signature)


@dataclass(frozen=True)
class Limits:
    """Bounds on what a node will parse; everything beyond is rejected unread."""

    max_message_bytes: int = 256 << 20
    max_frames: int = 4096
    max_envelope_bytes: int = 1 << 20
    max_str: int = 1 << 16
    max_items: int = 1 << 16

    def unpacker_options(self) -> dict[str, int]:
        return dict(
            max_bin_len=self.max_envelope_bytes,
            max_str_len=self.max_str,
            max_array_len=self.max_items,
            max_map_len=self.max_items,
            max_ext_len=0,
        )


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def packed(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.nbytes]


@dataclass
class Blob:
    """Arrays signed by their origin; `frames` are the raw bytes, one per tensor."""

    origin: bytes
    round: int
    kind: str
    schema: bytes
    digest: bytes
    index: list[TensorInfo]
    meta: dict[str, Any]
    record: bytes
    signature: bytes
    frames: list[Any] = field(repr=False)

    @property
    def size(self) -> int:
        return sum(info.nbytes for info in self.index)

    @property
    def origin_id(self) -> str:
        return node_id(self.origin)

    @functools.cached_property
    def id(self) -> bytes:
        """The blob's name in announces, fetches and stores: see `blob_id`."""
        return blob_id(self.record)

    def arrays(self) -> dict[str, np.ndarray]:
        """The tensors as read-only numpy views of the received bytes (no copy)."""
        return {
            info.name: np.frombuffer(frame, dtype=DTYPES[info.dtype]).reshape(info.shape)
            for info, frame in zip(self.index, self.frames, strict=True)
        }


@dataclass
class Message:
    kind: str
    sender: bytes
    seq: int
    round: int
    instance: bytes
    body: dict[str, Any]
    blob: Blob | None = None
    mesh: bytes = b""  # the sender's mesh id (a probe's decoder takes any)
    # Why the decoder refused the frames of this authentic direct message: it is queued
    # without them, so that its reader need not wait for it (Endpoint.on_refused_direct).
    refused: str | None = None

    @property
    def sender_id(self) -> str:
        return node_id(self.sender)


def blob_id(record: bytes) -> bytes:
    """sha256 of the signed record bytes. The record names origin, round, kind and the
    tensors' digest, so equal tensors published by two origins (or for two rounds or
    kinds) are two blobs, while a relayed blob keeps its id."""
    return hashlib.sha256(record).digest()


def frames_digest(frames: Sequence[Any]) -> bytes:
    """BLAKE3 (32 bytes) over the concatenated frames, without concatenating them.

    Every byte of every model is hashed once by its origin and once by each receiver, so
    this hash bounds the wire's throughput. BLAKE3 runs about five times faster than
    SHA-256 on one core (about 5 GB/s against 1 GB/s on the development machine, whose
    SHA-256 already uses the CPU's SHA instructions) and releases the GIL on large
    buffers; with SHA-256 a signed stream reached only a quarter of raw loopback.
    """
    digest = blake3()
    for frame in frames:
        view = memoryview(frame)
        # blake3 takes only flat byte buffers; hashlib took any buffer, so callers may
        # still pass a zmq.Frame or a typed array.
        digest.update(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
    return digest.digest()


def wire_dtype(array: np.ndarray) -> str:
    for name, dtype in DTYPES.items():
        if array.dtype == dtype:
            return name
    raise ValueError(f"dtype {array.dtype} cannot travel; allowed: {', '.join(DTYPES)}")


def make_blob(
    identity: Identity,
    round_no: int,
    kind: str,
    arrays: Mapping[str, np.ndarray],
    schema: bytes = b"",
    meta: Mapping[str, Any] | None = None,
) -> Blob:
    """Sign `arrays` as a blob of `identity`; hashes the bytes once and copies them only
    when an array is not C-contiguous."""
    frames, index = [], []
    for name, array in arrays.items():
        dtype = wire_dtype(array)
        # ascontiguousarray turns a 0-d array into shape (1,): keep the original shape.
        array = np.ascontiguousarray(array, dtype=DTYPES[dtype]).reshape(array.shape)
        # The memoryview of a flat uint8 view, not memoryview.cast: cast refuses shapes with
        # a zero in them.
        frames.append(array.reshape(-1).view(np.uint8).data)
        index.append(TensorInfo(name, dtype, tuple(array.shape), array.nbytes))
    digest = frames_digest(frames)
    meta = dict(meta or {})
    record = msgpack.packb(
        [identity.public_key, round_no, kind, schema, digest, [i.packed() for i in index], meta]
    )
    signature = identity.sign(RECORD_CONTEXT + record)
    return Blob(
        identity.public_key, round_no, kind, schema, digest, index, meta, record, signature, frames
    )


def blob_body(blob: Blob) -> dict[str, Any]:
    return {"record": blob.record, "sig": blob.signature}


def announce_body(blob: Blob) -> dict[str, Any]:
    """What an `announce` of `blob` says: its id, and its record's claims restated."""
    return {
        "id": blob.id,
        "origin": blob.origin,
        "round": blob.round,
        "kind": blob.kind,
        "digest": blob.digest,
        "size": blob.size,
    }


def encode(
    identity: Identity,
    mesh_id: bytes,
    kind: str,
    seq: int,
    round_no: int,
    body: Mapping[str, Any],
    *,
    instance: bytes,
    blob: Blob | None = None,
) -> list[Any]:
    """Frames of one signed message. For blob kinds pass `blob`: its digest is reused."""
    frames = blob.frames if blob is not None else []
    if blob is not None:
        body = {**body, **blob_body(blob)}
    header = msgpack.packb(
        {
            "v": PROTOCOL_VERSION,
            "mesh": mesh_id,
            "kind": kind,
            "from": identity.public_key,
            "inst": instance,
            "seq": seq,
            "round": round_no,
            "body": dict(body),
            "digest": blob.digest if blob is not None else frames_digest(frames),
        }
    )
    envelope = msgpack.packb([header, identity.sign(HEADER_CONTEXT + header)])
    return [envelope, *frames]


def new_instance() -> bytes:
    return os.urandom(INSTANCE_BYTES)


def signed_by_sender(message: Message, header_bytes: bytes, signature: bytes) -> bool:
    return verify(message.sender, signature, HEADER_CONTEXT + header_bytes)
