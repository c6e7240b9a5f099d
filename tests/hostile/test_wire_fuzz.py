"""Property tests: whatever arrives, Decoder.decode either returns a message or raises
wire.Rejected, and the memory it allocates while deciding stays within the size limit."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import sys
import tracemalloc
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from meshfl.protocol.decoder import _BODY_FIELDS, Decoder
from meshfl.protocol.identity import Identity
from meshfl.protocol.wire import (
    BLOB_KINDS,
    DTYPES,
    HEADER_CONTEXT,
    KINDS,
    PROTOCOL_VERSION,
    RECORD_CONTEXT,
    REJECTION_REASONS,
    Limits,
    Message,
    Rejected,
    encode,
    frames_digest,
    make_blob,
    new_instance,
)

MESH = hashlib.sha256(b"fuzz mesh").digest()[:16]
SCHEMA = hashlib.sha256(b"fuzz schema").digest()
# Small limits, so that the worst a hostile envelope can make msgpack build (about 70
# bytes of Python objects per envelope byte) still fits in max_message_bytes.
LIMITS = Limits(
    max_message_bytes=96 << 10, max_frames=8, max_envelope_bytes=1 << 10, max_str=256, max_items=64
)
SLACK = 8 << 10  # exception objects, tracebacks, the odd small buffer
SENDER, ORIGIN = Identity.generate(), Identity.generate()
INSTANCE = new_instance()

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def template() -> list[bytes]:
    arrays = {
        "layer.w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "layer.b": np.ones(3, dtype=np.float16),
        "steps": np.array(7, dtype=np.int64),
    }
    blob = make_blob(ORIGIN, 3, "model", arrays, schema=SCHEMA, meta={"samples": 5})
    frames = encode(SENDER, MESH, "blob", 1000, 3, {}, instance=INSTANCE, blob=blob)
    return [bytes(frame) for frame in frames]


TEMPLATE = template()


@contextlib.contextmanager
def traced_alone() -> Iterator[None]:
    """Python allocations traced while the code under test runs alone, as far as this
    process allows: tracemalloc counts every thread's allocations and those of the
    finalizers a garbage collection runs (earlier tests' leftovers), so no collection runs
    meanwhile, and other threads get the interpreter only when the code waits."""
    gc.disable()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()
        sys.setswitchinterval(interval)
        gc.enable()


def decode_bounded(frames: list[bytes]) -> Message | Rejected:
    """Decode with a fresh decoder; fail on any exception but Rejected or on too much memory."""
    decoder = Decoder(MESH, LIMITS, SCHEMA)
    with traced_alone():
        tracemalloc.reset_peak()
        baseline = tracemalloc.get_traced_memory()[0]
        try:
            result: Message | Rejected = decoder.decode(frames)
        except Rejected as rejection:
            result = rejection
        peak = tracemalloc.get_traced_memory()[1] - baseline
    assert peak <= LIMITS.max_message_bytes + SLACK, f"decode allocated {peak} bytes"
    if isinstance(result, Rejected):
        assert result.reason in REJECTION_REASONS
        assert decoder.rejections == {result.reason: 1}
    if currently_in_test_context():  # for --hypothesis-show-statistics
        event(f"rejected: {result.reason}" if isinstance(result, Rejected) else "accepted")
    return result


def same_message(a: Message, b: Message) -> bool:
    def key(m: Message):
        blob = m.blob
        return (
            m.kind,
            m.sender,
            m.seq,
            m.round,
            m.instance,
            m.body,
            None if blob is None else (blob.digest, [bytes(f) for f in blob.frames]),
        )

    return key(a) == key(b)


ORIGINAL = Decoder(MESH, LIMITS, SCHEMA).decode(TEMPLATE)

# --- strategies -----------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=40)
)
msgpack_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)
data_frames = st.lists(st.binary(max_size=64), max_size=4) | st.lists(
    st.binary(max_size=8), min_size=LIMITS.max_frames, max_size=LIMITS.max_frames + 1
)
header_keys = st.sampled_from(
    ["v", "mesh", "kind", "from", "inst", "seq", "round", "body", "digest"]
) | st.text(max_size=6)
body_keys = st.sampled_from(
    [
        "name",
        "addr",
        "peers",
        "reason",
        "status",
        "origin",
        "round",
        "kind",
        "digest",
        "size",
        "record",
        "sig",
    ]
) | st.text(max_size=6)
dtype_names = st.sampled_from([*DTYPES, "complex64", "object", "float128", "", "<f4"])
index_entries = st.lists(
    st.tuples(
        st.text(max_size=8),
        dtype_names,
        st.lists(st.integers(min_value=-2, max_value=2**64 - 1) | st.booleans(), max_size=4),
        st.integers(min_value=-1, max_value=2**64 - 1),
    ).map(list)
    | msgpack_values,
    max_size=4,
)


def pack(value) -> bytes:
    return msgpack.packb(value)


def signed_envelope(header: dict) -> bytes:
    header_bytes = pack(header)
    return pack([header_bytes, SENDER.sign(HEADER_CONTEXT + header_bytes)])


unsigned = st.integers(min_value=0, max_value=2**64 - 1)
counters = unsigned | st.sampled_from([-1, True, 1.5, "7"])


def field_values(kind: type, length: int | None) -> st.SearchStrategy:
    """Values of the msgpack type a header or body field must have."""
    if kind is bytes:
        return st.binary(min_size=length, max_size=length) if length else st.binary(max_size=40)
    return {
        str: st.text(max_size=16),
        int: st.integers(min_value=0, max_value=2**64 - 1),
        list: st.lists(msgpack_values, max_size=4),
        dict: st.dictionaries(st.text(max_size=8), msgpack_values, max_size=4),
    }[kind]


@st.composite
def bodies(draw, kind: str) -> dict:
    """The fields `kind` requires, well typed, then a few dropped, replaced or added."""
    required = _BODY_FIELDS.get(kind, {})
    body = {name: draw(field_values(*spec)) for name, spec in required.items()}
    for _ in range(draw(st.integers(min_value=0, max_value=2)) if rarely(draw) else 0):
        name = draw(body_keys)
        if name in body and draw(st.booleans()):
            del body[name]
        else:
            body[name] = draw(msgpack_values)
    return body


@st.composite
def tensor_index(draw, frames: list[bytes]) -> list:
    """Mostly an index that fits the frames but for one field, so the dtype, shape and
    length checks all run; sometimes anything at all."""
    if rarely(draw):
        return draw(index_entries)
    index = [[f"t{i}", "uint8", [len(frame)], len(frame)] for i, frame in enumerate(frames)]
    if index and draw(st.booleans()):
        at = draw(st.integers(min_value=0, max_value=len(index) - 1))
        field = draw(st.sampled_from(["dtype", "shape", "nbytes", "entry"]))
        if field == "dtype":
            index[at][1] = draw(dtype_names)
        elif field == "shape":
            index[at][2] = draw(
                st.lists(st.integers(min_value=-2, max_value=2**64 - 1) | st.booleans(), max_size=4)
            )
        elif field == "nbytes":
            index[at][3] = draw(st.integers(min_value=-1, max_value=2**64 - 1))
        else:
            index[at] = draw(msgpack_values)
    return index


def rarely(draw) -> bool:
    return draw(st.integers(min_value=0, max_value=9)) == 5  # hypothesis favours 0


@st.composite
def signed_messages(draw) -> list[bytes]:
    """Authentic messages (good header signature) with random bodies and blob records,
    so the checks after the signature see hostile input too. Mostly well-formed up to
    the part being fuzzed, so that every later check gets its share."""
    if rarely(draw):
        kind = draw(st.text(max_size=8))
    else:
        kind = draw(st.sampled_from(BLOB_KINDS) if draw(st.booleans()) else st.sampled_from(KINDS))
    frames = []
    if kind in BLOB_KINDS or rarely(draw):
        frames = draw(data_frames if rarely(draw) else st.lists(st.binary(max_size=64), max_size=4))
    digest = frames_digest(frames)
    body = draw(bodies(kind))
    if kind in BLOB_KINDS and not rarely(draw):
        record = pack(
            [
                ORIGIN.public_key,
                -1 if rarely(draw) else draw(st.integers(0, 5)),
                "model",
                draw(st.sampled_from([SCHEMA, b"other"])) if rarely(draw) else SCHEMA,
                draw(st.binary(max_size=32)) if rarely(draw) else digest,
                draw(tensor_index(frames)),
                draw(st.dictionaries(st.text(max_size=4), scalars, max_size=3)),
            ]
        )
        body["record"] = record
        body["sig"] = ORIGIN.sign(RECORD_CONTEXT + (b"x" if rarely(draw) else record))
    header = {
        "v": PROTOCOL_VERSION,
        "mesh": MESH,
        "kind": kind,
        "from": SENDER.public_key,
        "inst": INSTANCE,
        "seq": draw(counters if rarely(draw) else unsigned),
        "round": draw(counters if rarely(draw) else unsigned),
        "body": body,
        "digest": digest,
    }
    return [signed_envelope(header), *frames]


@st.composite
def mutations(draw) -> list[bytes]:
    """A valid message with one to four bit flips, truncations, extra, removed,
    swapped, duplicated or replaced frames."""
    frames = list(TEMPLATE)
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        op = draw(
            st.sampled_from(
                [
                    "flip",
                    "flip",
                    "truncate",
                    "extend",
                    "append",
                    "remove",
                    "swap",
                    "duplicate",
                    "replace",
                ]
            )
        )
        if not frames:
            op = "append"
        at = draw(st.integers(min_value=0, max_value=max(len(frames) - 1, 0)))
        if op == "flip" and frames[at]:
            frame = bytearray(frames[at])
            bit = draw(st.integers(min_value=0, max_value=len(frame) * 8 - 1))
            frame[bit // 8] ^= 1 << (bit % 8)
            frames[at] = bytes(frame)
        elif op == "truncate":
            frames[at] = frames[at][: draw(st.integers(0, max(len(frames[at]) - 1, 0)))]
        elif op == "extend":
            frames[at] = frames[at] + draw(st.binary(min_size=1, max_size=16))
        elif op == "append":
            frames.insert(draw(st.integers(0, len(frames))), draw(st.binary(max_size=64)))
        elif op == "remove":
            del frames[at]
        elif op == "swap":
            other = draw(st.integers(min_value=0, max_value=len(frames) - 1))
            frames[at], frames[other] = frames[other], frames[at]
        elif op == "duplicate":
            frames.insert(at, frames[at])
        elif op == "replace":
            frames[at] = draw(st.binary(max_size=len(frames[at]) + 8))
    return frames


# --- properties ------------------------------------------------------------------------


@FUZZ
@given(st.lists(st.binary(max_size=2048), max_size=12))
def test_random_frames(frames):
    assert isinstance(decode_bounded(frames), Rejected)


@FUZZ
@given(msgpack_values, data_frames)
def test_random_msgpack_envelopes(value, frames):
    assert isinstance(decode_bounded([pack(value), *frames]), Rejected)


@FUZZ
@given(
    st.dictionaries(header_keys, msgpack_values, max_size=10),
    st.binary(min_size=60, max_size=70),
    data_frames,
)
def test_random_headers_in_a_well_formed_envelope(header, signature, frames):
    envelope = pack([pack(header), signature])
    assert isinstance(decode_bounded([envelope, *frames]), Rejected)


@FUZZ
@given(signed_messages())
def test_authentic_messages_with_random_bodies_and_records(frames):
    result = decode_bounded(frames)
    if isinstance(result, Message) and result.kind in BLOB_KINDS:
        # Whatever got through is consistent: one frame per index entry, right lengths.
        blob = result.blob
        assert blob is not None and blob.schema == SCHEMA
        assert [f.nbytes for f in blob.frames] == [info.nbytes for info in blob.index]
        for array, info in zip(blob.arrays().values(), blob.index, strict=True):
            assert array.shape == info.shape and array.nbytes == info.nbytes


@FUZZ
@given(mutations())
def test_mutations_of_a_valid_message(frames):
    result = decode_bounded(frames)
    if isinstance(result, Message):  # only a mutation that changed nothing that matters
        assert same_message(result, ORIGINAL), "a tampered message was accepted"


# --- the worst cases, pinned -------------------------------------------------------------


def test_the_template_is_valid():
    assert same_message(decode_bounded(TEMPLATE), ORIGINAL)


def test_an_envelope_packed_with_tiny_containers_stays_within_the_limit():
    # 64 arrays of 15 empty arrays each: the most objects per byte msgpack allows here.
    inner = b"\x9f" + b"\x90" * 15
    envelope = (b"\xdc\x00\x40" + inner * 64)[: LIMITS.max_envelope_bytes]
    result = decode_bounded([envelope])
    assert isinstance(result, Rejected) and result.reason == "bad_msgpack"
    header = b"\xdc\x00\x37" + inner * 55  # a header that is a valid msgpack array
    envelope = pack([header, bytes(64)])
    assert len(envelope) <= LIMITS.max_envelope_bytes
    result = decode_bounded([envelope])
    assert isinstance(result, Rejected) and result.reason == "bad_header"


@pytest.mark.parametrize(
    "claim",
    [
        b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
        b"\xdd\xff\xff\xff\xff",  # array32 of 4 G items
        b"\xdf\xff\xff\xff\xff",  # map32 of 4 G pairs
        b"\xdb\xff\xff\xff\xff",  # str32 of 4 GiB
        b"\xc9\xff\xff\xff\xff\x01",  # ext32
    ],
    ids=["bin", "array", "map", "str", "ext"],
)
def test_length_claims_are_not_trusted(claim):
    result = decode_bounded([claim + bytes(16)])
    assert isinstance(result, Rejected) and result.reason == "bad_msgpack"


def test_a_declared_huge_tensor_allocates_nothing():
    frames = [bytes(16)]
    digest = frames_digest(frames)
    index = [["w", "float64", [2**32, 2**32, 2**32], 2**64 - 1]]
    record = pack([ORIGIN.public_key, 1, "model", SCHEMA, digest, index, {}])
    header = {
        "v": PROTOCOL_VERSION,
        "mesh": MESH,
        "kind": "blob",
        "from": SENDER.public_key,
        "inst": INSTANCE,
        "seq": 1,
        "round": 1,
        "digest": digest,
        "body": {"record": record, "sig": ORIGIN.sign(RECORD_CONTEXT + record)},
    }
    result = decode_bounded([signed_envelope(header), *frames])
    assert isinstance(result, Rejected) and result.reason == "shape_mismatch"


def test_decoding_a_large_blob_copies_none_of_its_bytes():
    big = np.zeros((LIMITS.max_message_bytes - 4096) // 4, dtype=np.float32)
    blob = make_blob(ORIGIN, 1, "model", {"w": big}, schema=SCHEMA)
    frames = [
        bytes(f) for f in encode(SENDER, MESH, "blob", 1, 1, {}, instance=INSTANCE, blob=blob)
    ]
    decoder = Decoder(MESH, LIMITS, SCHEMA)
    with traced_alone():
        message = decoder.decode(frames)
        peak = tracemalloc.get_traced_memory()[1]
    assert message.blob is not None and message.blob.size == big.nbytes
    assert peak < SLACK + 20 * LIMITS.max_envelope_bytes < big.nbytes


def test_a_boolean_byte_length_is_a_bad_header_not_a_shape_mismatch():
    frames = [bytes(1)]
    digest = frames_digest(frames)
    record = pack([ORIGIN.public_key, 1, "model", SCHEMA, digest, [["w", "uint8", [1], True]], {}])
    header = {
        "v": PROTOCOL_VERSION,
        "mesh": MESH,
        "kind": "blob",
        "from": SENDER.public_key,
        "inst": INSTANCE,
        "seq": 1,
        "round": 1,
        "digest": digest,
        "body": {"record": record, "sig": ORIGIN.sign(RECORD_CONTEXT + record)},
    }
    result = decode_bounded([signed_envelope(header), *frames])
    assert isinstance(result, Rejected) and result.reason == "bad_header"
