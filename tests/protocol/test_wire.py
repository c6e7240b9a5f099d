"""The signed message format: encode/decode, blobs, what the signatures cover, layering."""

from __future__ import annotations

import ast
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from blake3 import blake3

import meshfl.protocol
from meshfl.protocol import decoder as decoding
from meshfl.protocol import wire
from meshfl.protocol.decoder import Decoder
from meshfl.protocol.identity import Identity, verify
from meshfl.protocol.wire import (
    HEADER_CONTEXT,
    RECORD_CONTEXT,
    Rejected,
    encode,
    frames_digest,
    make_blob,
    new_instance,
)

MESH = hashlib.sha256(b"test mesh").digest()[:16]
EMPTY_DIGEST_HEX = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
SCHEMA = hashlib.sha256(b"test model schema").digest()
PROTOCOL_DIR = Path(meshfl.protocol.__file__).resolve().parent


@pytest.fixture
def alice():
    return Identity.generate()


def sample_arrays():
    rng = np.random.default_rng(7)
    return {
        "layer.weight": rng.standard_normal((8, 4)).astype(np.float32),
        "layer.bias": rng.standard_normal(8).astype(np.float32),
        "steps": np.array(12, dtype=np.int64),
        "mask": rng.random(5) > 0.5,
    }


def split_envelope(frames):
    header_bytes, signature = msgpack.unpackb(frames[0])
    return header_bytes, signature


def with_envelope(frames, header_bytes, signature):
    return [msgpack.packb([header_bytes, signature]), *frames[1:]]


def decode_error(decoder, frames) -> str:
    with pytest.raises(Rejected) as caught:
        decoder.decode(frames)
    return caught.value.reason


# --- encode / decode ----------------------------------------------------------


def test_round_trip_of_a_plain_message(alice):
    instance = new_instance()
    frames = encode(
        alice,
        MESH,
        "hello",
        41,
        3,
        {"name": "alice", "addr": "tcp://10.0.0.1:1"},
        instance=instance,
    )
    assert len(frames) == 1
    message = Decoder(MESH).decode(frames)
    assert message.kind == "hello"
    assert message.sender == alice.public_key and message.sender_id == alice.id
    assert (message.seq, message.round, message.instance) == (41, 3, instance)
    assert message.body == {"name": "alice", "addr": "tcp://10.0.0.1:1"}
    assert message.blob is None


def test_round_trip_of_a_blob_gives_equal_read_only_views_of_the_frames(alice):
    arrays = sample_arrays()
    blob = make_blob(alice, 5, "model", arrays, schema=SCHEMA, meta={"samples": 300})
    frames = [
        bytes(frame)
        for frame in encode(alice, MESH, "blob", 1, 5, {}, instance=new_instance(), blob=blob)
    ]
    message = Decoder(MESH, schema=SCHEMA).decode(frames)
    got = message.blob
    assert got is not None
    assert (got.origin, got.round, got.kind, got.schema) == (alice.public_key, 5, "model", SCHEMA)
    assert got.digest == blob.digest and got.meta == {"samples": 300}
    assert verify(alice.public_key, got.signature, RECORD_CONTEXT + got.record)
    decoded = got.arrays()
    assert list(decoded) == list(arrays)
    for (name, original), frame in zip(arrays.items(), frames[1:], strict=True):
        view = decoded[name]
        assert view.dtype == original.dtype and view.shape == original.shape
        np.testing.assert_array_equal(view, original)
        # Zero copy: the array is a view of the received frame, and it is read-only.
        assert np.shares_memory(view, np.frombuffer(frame, dtype=np.uint8))
        assert not view.flags.writeable
        with pytest.raises(ValueError):
            view.reshape(-1)[:1] = 0


def test_blob_over_zeromq_is_decoded_without_copying(alice):
    arrays = {"w": np.arange(4096, dtype=np.float32)}
    blob = make_blob(alice, 1, "model", arrays)
    frames = encode(alice, MESH, "blob", 1, 1, {}, instance=new_instance(), blob=blob)
    context = zmq.Context()
    sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    try:
        receiver.bind("inproc://wire-test")
        sender.connect("inproc://wire-test")
        sender.send_multipart(frames, copy=False)
        assert receiver.poll(5000), "nothing arrived"
        received = receiver.recv_multipart(copy=False)
        message = Decoder(MESH).decode(received)
        view = message.blob.arrays()["w"]
        np.testing.assert_array_equal(view, arrays["w"])
        assert np.shares_memory(view, np.frombuffer(received[1].buffer, dtype=np.uint8))
        assert not view.flags.writeable
    finally:
        sender.close(linger=0)
        receiver.close(linger=0)
        context.term()


def test_frames_are_raw_array_bytes_not_pickles(alice):
    arrays = sample_arrays()
    frames = encode(
        alice,
        MESH,
        "blob",
        1,
        0,
        {},
        instance=new_instance(),
        blob=make_blob(alice, 0, "model", arrays),
    )
    for frame, array in zip(frames[1:], arrays.values(), strict=True):
        assert bytes(frame) == np.ascontiguousarray(array).tobytes()


# --- blobs ----------------------------------------------------------------------


def test_make_blob_digest_is_blake3_over_the_frames(alice):
    blob = make_blob(alice, 2, "model", sample_arrays())
    expected = blake3(b"".join(bytes(frame) for frame in blob.frames)).digest()
    assert blob.digest == expected == frames_digest(blob.frames)


def test_frames_digest_takes_any_buffer_of_the_same_bytes():
    weights = np.arange(12, dtype="<f4").reshape(3, 4)
    flat = weights.reshape(-1).view(np.uint8)
    expected = blake3(weights.tobytes()).digest()
    assert frames_digest([weights]) == frames_digest([memoryview(flat)]) == expected
    assert frames_digest([zmq.Frame(weights.tobytes())]) == expected


def test_make_blob_origin_signature_covers_its_record(alice):
    blob = make_blob(alice, 2, "head", sample_arrays(), schema=SCHEMA, meta={"loss": 0.5})
    origin, round_no, kind, schema, digest, index, meta = msgpack.unpackb(blob.record)
    assert (origin, round_no, kind, schema, digest) == (
        alice.public_key,
        2,
        "head",
        SCHEMA,
        blob.digest,
    )
    assert index == [info.packed() for info in blob.index]
    assert meta == {"loss": 0.5}
    assert verify(alice.public_key, blob.signature, RECORD_CONTEXT + blob.record)
    assert not verify(alice.public_key, blob.signature, blob.record)  # context is signed too


def test_make_blob_does_not_copy_contiguous_arrays(alice):
    arrays = sample_arrays()
    blob = make_blob(alice, 0, "model", arrays)
    for frame, array in zip(blob.frames, arrays.values(), strict=True):
        assert np.shares_memory(np.frombuffer(frame, dtype=np.uint8), array)


def test_make_blob_copies_a_non_contiguous_array_in_c_order(alice):
    matrix = np.arange(12, dtype=np.float64).reshape(3, 4)
    blob = make_blob(alice, 0, "model", {"t": matrix.T})
    assert bytes(blob.frames[0]) == np.ascontiguousarray(matrix.T).tobytes()
    assert blob.index[0].shape == (4, 3)


def test_tensor_index_fields(alice):
    arrays = {
        "a": np.zeros((2, 3), dtype=np.float16),
        "b": np.zeros(7, dtype=np.int8),
        "scalar": np.array(2.5, dtype=np.float64),
        "empty": np.zeros((0, 5), dtype=np.int32),
        "flags": np.zeros(3, dtype=bool),
    }
    blob = make_blob(alice, 0, "model", arrays)
    assert [(i.name, i.dtype, i.shape, i.nbytes) for i in blob.index] == [
        ("a", "float16", (2, 3), 12),
        ("b", "int8", (7,), 7),
        ("scalar", "float64", (), 8),
        ("empty", "int32", (0, 5), 0),
        ("flags", "bool", (3,), 3),
    ]
    assert blob.size == 12 + 7 + 8 + 0 + 3
    assert blob.origin_id == alice.id
    assert blob.index[0].packed() == ["a", "float16", [2, 3], 12]


@pytest.mark.parametrize("dtype", [np.complex64, np.uint64, object, "U3"])
def test_make_blob_refuses_dtypes_that_cannot_travel(alice, dtype):
    with pytest.raises(ValueError, match="cannot travel"):
        make_blob(alice, 0, "model", {"x": np.zeros(2, dtype=dtype)})


# --- what the signatures cover ----------------------------------------------------


def test_header_signature_is_over_the_context_and_the_exact_header_bytes(alice):
    instance = new_instance()
    blob = make_blob(alice, 4, "model", sample_arrays())
    frames = encode(alice, MESH, "blob", 9, 4, {"note": "x"}, instance=instance, blob=blob)
    header_bytes, signature = split_envelope(frames)
    assert verify(alice.public_key, signature, HEADER_CONTEXT + header_bytes)
    assert not verify(alice.public_key, signature, header_bytes)
    header = msgpack.unpackb(header_bytes)
    assert header == {
        "v": wire.PROTOCOL_VERSION,
        "mesh": MESH,
        "kind": "blob",
        "from": alice.public_key,
        "inst": instance,
        "seq": 9,
        "round": 4,
        "body": {"note": "x", "record": blob.record, "sig": blob.signature},
        "digest": frames_digest(frames[1:]),
    }


def test_flipping_one_header_byte_is_a_bad_signature(alice):
    frames = encode(
        alice,
        MESH,
        "hello",
        1,
        0,
        {"name": "alice", "addr": "tcp://10.0.0.2:1"},
        instance=new_instance(),
    )
    header_bytes, signature = split_envelope(frames)
    at = header_bytes.index(b"alice")
    forged = header_bytes[:at] + b"b" + header_bytes[at + 1 :]  # still valid msgpack
    decoder = Decoder(MESH)
    assert decode_error(decoder, with_envelope(frames, forged, signature)) == "bad_signature"
    assert decoder.rejections == {"bad_signature": 1}


def test_no_single_byte_change_of_the_header_is_accepted(alice):
    blob = make_blob(alice, 1, "model", {"w": np.ones(3, dtype=np.float32)})
    frames = encode(alice, MESH, "blob", 1, 1, {}, instance=new_instance(), blob=blob)
    header_bytes, signature = split_envelope(frames)
    for at in range(len(header_bytes)):
        forged = header_bytes[:at] + bytes([header_bytes[at] ^ 0x01]) + header_bytes[at + 1 :]
        with pytest.raises(Rejected):
            Decoder(MESH).decode(with_envelope(frames, forged, signature))
    Decoder(MESH).decode(frames)  # and the untouched message is fine


def test_wire_md_states_the_version_contexts_and_empty_digest_the_code_uses():
    spec = (PROTOCOL_DIR / "WIRE.md").read_text()
    assert f"# meshfl wire protocol, version {wire.PROTOCOL_VERSION}\n" in spec
    for context in (wire.HEADER_CONTEXT, wire.RECORD_CONTEXT):
        assert " ".join(f"{byte:02x}" for byte in context) in spec
    assert EMPTY_DIGEST_HEX in spec


def test_a_message_without_frames_carries_the_digest_of_nothing(alice):
    frames = encode(alice, MESH, "heartbeat", 1, 0, {}, instance=new_instance())
    header = msgpack.unpackb(split_envelope(frames)[0])
    # WIRE.md section 3 spells this value out for independent clients.
    assert header["digest"].hex() == EMPTY_DIGEST_HEX == blake3(b"").hexdigest()


def test_unknown_header_fields_are_accepted_and_signed(alice):
    frames = encode(alice, MESH, "heartbeat", 1, 0, {}, instance=new_instance())
    header = msgpack.unpackb(split_envelope(frames)[0])
    header["future"] = "field"
    header_bytes = msgpack.packb(header)
    signature = alice.sign(HEADER_CONTEXT + header_bytes)
    assert Decoder(MESH).decode(with_envelope(frames, header_bytes, signature)).kind == "heartbeat"
    tampered = header_bytes.replace(b"field", b"fiel!")
    assert decode_error(Decoder(MESH), with_envelope(frames, tampered, signature)) == (
        "bad_signature"
    )


def test_changed_frame_bytes_are_a_digest_mismatch(alice):
    blob = make_blob(alice, 1, "model", {"w": np.ones(16, dtype=np.float32)})
    frames = [
        bytes(f) for f in encode(alice, MESH, "blob", 1, 1, {}, instance=new_instance(), blob=blob)
    ]
    frames[1] = bytes([frames[1][0] ^ 0x80]) + frames[1][1:]
    assert decode_error(Decoder(MESH), frames) == "digest_mismatch"


def test_signature_by_another_key_is_rejected(alice):
    mallory = Identity.generate()
    frames = encode(alice, MESH, "heartbeat", 1, 0, {}, instance=new_instance())
    header_bytes, _ = split_envelope(frames)
    forged = with_envelope(frames, header_bytes, mallory.sign(HEADER_CONTEXT + header_bytes))
    assert decode_error(Decoder(MESH), forged) == "bad_signature"


# --- sequence numbers ---------------------------------------------------------------


def test_sequence_numbers_must_rise(alice):
    decoder = Decoder(MESH)
    instance = new_instance()

    def beat(seq):
        return encode(alice, MESH, "heartbeat", seq, 0, {}, instance=instance)

    decoder.decode(beat(10))
    assert decode_error(decoder, beat(10)) == "replay"
    assert decode_error(decoder, beat(3)) == "replay"
    decoder.decode(beat(11))
    assert decoder.rejections == {"replay": 2}


def test_a_forged_message_does_not_move_the_senders_counter(alice):
    decoder = Decoder(MESH)
    instance = new_instance()
    decoder.decode(encode(alice, MESH, "heartbeat", 5, 0, {}, instance=instance))
    forged = encode(alice, MESH, "heartbeat", 2**62, 0, {}, instance=instance)
    header_bytes, signature = split_envelope(forged)
    broken = bytes([signature[0] ^ 1]) + signature[1:]
    assert decode_error(decoder, with_envelope(forged, header_bytes, broken)) == "bad_signature"
    decoder.decode(encode(alice, MESH, "heartbeat", 6, 0, {}, instance=instance))


def test_fresh_keys_push_out_strangers_numbers_never_a_peers(alice, monkeypatch):
    monkeypatch.setattr(decoding, "MAX_SENDERS", 4)
    stranger = Identity.generate()
    decoder = Decoder(MESH, kept=lambda key: key == alice.public_key)

    def beat(identity, seq):
        return encode(identity, MESH, "heartbeat", seq, 0, {}, instance=new_instance())

    decoder.decode(beat(alice, 10))  # the peer, heard first: the oldest in the memory
    decoder.decode(beat(stranger, 10))
    for _ in range(8):  # a flood of fresh keys
        decoder.decode(beat(Identity.generate(), 1))
    assert len(decoder.last_seq) == 4
    assert decode_error(decoder, beat(alice, 10)) == "replay", "the peer's number is kept"
    decoder.decode(beat(stranger, 10))  # a stranger's is forgotten: its old seq passes


def test_counters_are_per_sender(alice):
    bob = Identity.generate()
    decoder = Decoder(MESH)
    decoder.decode(encode(alice, MESH, "heartbeat", 100, 0, {}, instance=new_instance()))
    decoder.decode(encode(bob, MESH, "heartbeat", 1, 0, {}, instance=new_instance()))


def test_non_blob_kinds_carry_no_frames(alice):
    frames = encode(alice, MESH, "heartbeat", 1, 0, {}, instance=new_instance())
    # Sign a header whose digest does cover the extra frame, so only the kind is wrong.
    header = msgpack.unpackb(split_envelope(frames)[0])
    header["digest"] = frames_digest([b"extra"])
    header_bytes = msgpack.packb(header)
    forged = [msgpack.packb([header_bytes, alice.sign(HEADER_CONTEXT + header_bytes)]), b"extra"]
    assert decode_error(Decoder(MESH), forged) == "bad_header"


# --- layering -----------------------------------------------------------------------

_IMPORT_EVERYTHING = """
import importlib, json, pkgutil, sys
import meshfl.protocol as package
names = [m.name for m in pkgutil.iter_modules(package.__path__, package.__name__ + ".")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names, "loaded": sorted(sys.modules)}))
"""


def test_importing_the_protocol_does_not_import_torch_or_upper_layers():
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EVERYTHING],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(done.stdout)
    assert {
        "meshfl.protocol.identity",
        "meshfl.protocol.wire",
        "meshfl.protocol.decoder",
        "meshfl.protocol.transport",
        "meshfl.protocol.membership",
        "meshfl.protocol.offers",
        "meshfl.protocol.endpoint",
    } <= set(report["modules"])
    # (pickle itself is loaded by numpy; that it is never *used* is the source check below)
    forbidden = ("torch", "meshfl.node", "meshfl.algorithms", "meshfl.launch")
    loaded = [
        name
        for name in report["loaded"]
        if any(name == bad or name.startswith(bad + ".") for bad in forbidden)
    ]
    assert loaded == []


def _imported_modules(path: Path) -> list[str]:
    """Absolute names of every module a protocol source file imports."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = "meshfl.protocol".split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
            names += [arg.value for arg in node.args if isinstance(arg, ast.Constant)]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            names += [arg.value for arg in node.args if isinstance(arg, ast.Constant)]
    return names


@pytest.mark.parametrize("path", sorted(PROTOCOL_DIR.glob("*.py")), ids=lambda p: p.name)
def test_protocol_source_never_imports_pickle_torch_or_upper_layers(path):
    forbidden = (
        "torch",
        "pickle",
        "_pickle",
        "cloudpickle",
        "dill",
        "meshfl.node",
        "meshfl.algorithms",
        "meshfl.launch",
    )
    bad = [
        name
        for name in _imported_modules(path)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]
    assert bad == [], f"{path.name} imports {bad}"


def test_the_layering_check_sees_relative_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from ..node import trainer\nfrom .wire import encode\nimport pickle\n")
    names = _imported_modules(sample)
    assert "meshfl.node.trainer" in names and "meshfl.protocol.wire" in names
    assert "pickle" in names


def test_a_blob_id_names_its_signed_record_not_just_its_tensors(alice):
    bob = Identity.generate()
    arrays = sample_arrays()
    blobs = [
        make_blob(origin, round_no, kind, arrays, SCHEMA)
        for origin, round_no, kind in [
            (alice, 1, "model"),
            (bob, 1, "model"),
            (alice, 2, "model"),
            (alice, 1, "head"),
        ]
    ]
    assert len({blob.digest for blob in blobs}) == 1
    assert len({blob.id for blob in blobs}) == len(blobs)
    assert blobs[0].id == hashlib.sha256(blobs[0].record).digest()
    # Relayed by anyone, a blob keeps its id: it is the origin's record that is hashed.
    relayed = (
        Decoder(MESH)
        .decode(encode(bob, MESH, "blob", 1, 1, {}, instance=new_instance(), blob=blobs[0]))
        .blob
    )
    assert relayed.id == blobs[0].id
