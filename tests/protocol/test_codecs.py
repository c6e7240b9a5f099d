"""Blobs that travel compressed: each codec decodes to float32 tensors near the sent
ones at the bytes it promises, and every lie in a codec's own fields is refused by name."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshfl.node.blobs import UnusableBlob, layout_of, peer_model, signed_blob
from meshfl.node.deltas import (
    DELTA,
    PUBLIC,
    TOPK_FRACTION,
    DeltaGossip,
    copy_named_by,
    is_public_copy,
    named,
    read_as,
)
from meshfl.node.models import build_model
from meshfl.node.trainer import state_to_arrays
from meshfl.protocol import codecs
from meshfl.protocol.identity import Identity
from meshfl.protocol.wire import make_blob
from tests.rogue_peer import CODEC_LIES, codec_lie

PEER = Identity.generate()
MODEL = build_model("cnn", (1, 28, 28), 10, seed=0)
ARRAYS = state_to_arrays(MODEL)
LAYOUT = layout_of(ARRAYS)
FLOAT_BYTES = sum(array.nbytes for array in ARRAYS.values())
FLOATS = sum(array.size for array in ARRAYS.values() if array.dtype == np.float32)

# codec -> (bytes against float32 at most, largest error against the largest |value|)
PROMISES = {
    "none": (1.0, 0.0),
    "fp16": (0.5, 2**-11),
    "bf16": (0.5, 2**-8),
    "int8": (0.27, 1 / 254),
}


def received(codec: str):
    return peer_model(signed_blob(PEER, 1, "model", ARRAYS, b"", {"n": 3}, codec), (LAYOUT,))


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_each_codec_arrives_as_float32_tensors_near_the_sent_ones_at_its_bytes(codec):
    blob = signed_blob(PEER, 1, "model", ARRAYS, b"", {"n": 3}, codec)
    most_bytes, most_error = PROMISES[codec]
    assert blob.size <= most_bytes * FLOAT_BYTES
    model = peer_model(blob, (LAYOUT,))
    assert model.n_samples == 3 and layout_of(state_to_arrays(model.state)) == LAYOUT
    for name, array in ARRAYS.items():
        error = float(np.abs(model.state[name].numpy() - array).max(initial=0.0))
        assert error <= most_error * float(np.abs(array).max(initial=0.0)) + 1e-12, name


def test_the_codec_is_in_the_signed_record_and_the_signature_covers_the_bytes_sent():
    blob = signed_blob(PEER, 1, "model", ARRAYS, b"", {"n": 3}, "int8")
    assert blob.meta == {"n": 3, "codec": "int8", "block": codecs.INT8_BLOCK}
    again = make_blob(PEER, 1, "model", codecs.encode(ARRAYS, "int8")[0], b"", blob.meta)
    assert again.record == blob.record, "the record names the encoded tensors"


def test_a_received_tensor_is_writable_memory_of_its_own():
    for codec in codecs.CODECS:
        for tensor in received(codec).state.values():
            tensor.add_(0)  # the bytes a socket received are read-only


def test_half_keeps_a_tensor_beyond_its_range_whole_rather_than_send_infinity():
    arrays = {"big": np.array([1e6, -3.0], dtype=np.float32), "small": np.ones(2, np.float32)}
    encoded, meta = codecs.encode(arrays, "fp16")
    assert encoded["big"].dtype == np.float32 and encoded["small"].dtype == np.float16
    assert codecs.decode(encoded, meta)["big"].tolist() == [1e6, -3.0]


def test_bfloat16_rounds_to_nearest_even():
    values = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5, 0.0], dtype=np.float32)
    encoded, meta = codecs.encode({"x": values}, "bf16")
    assert codecs.decode(encoded, meta)["x"].tolist() == [1.0, 1.0, 1 + 2**-6, -2.5, 0.0]


def test_int8_keeps_a_zero_block_zero_and_integer_tensors_as_they_are():
    arrays = {"w": np.zeros(300, np.float32), "count": np.array([7], dtype=np.int64)}
    encoded, meta = codecs.encode(arrays, "int8")
    decoded = codecs.decode(encoded, meta)
    assert not decoded["w"].any() and decoded["count"].dtype == np.int64


@pytest.mark.parametrize("lie", sorted(CODEC_LIES))
def test_a_lie_in_a_codecs_fields_is_refused_as_codec(lie):
    arrays, meta = codec_lie(ARRAYS, lie)
    with pytest.raises(UnusableBlob) as refused:
        peer_model(make_blob(PEER, 1, "model", arrays, b"", {"n": 3, **meta}), (LAYOUT,))
    assert refused.value.reason == "codec"


def forged(what: str):
    """A forger of one int8 field of the first tensor (its scales, its values, the block)."""
    scales = FIRST + codecs.SCALES

    def forge(arrays: dict, meta: dict) -> None:
        if what == "negative scale":
            arrays[scales] = -arrays[scales] - 1
        elif what == "one scale short":
            arrays[scales] = arrays[scales][:-1]
        elif what == "float64 scales":
            arrays[scales] = arrays[scales].astype(np.float64)
        elif what == "a scale that overflows":
            arrays[scales][0] = np.finfo(np.float32).max / 127  # 127 times it overflows
        elif what == "int16 values":
            arrays[FIRST] = arrays[FIRST].astype(np.int16)
        elif what == "tiny block":
            meta["block"] = 3
        elif what == "boolean block":
            meta["block"] = True

    return forge


FIRST = list(ARRAYS)[0]


@pytest.mark.parametrize(
    "what, words",
    [
        ("negative scale", "negative"),
        ("one scale short", r"scales are float32 \(\d+,\)"),
        ("float64 scales", "float64"),
        ("a scale that overflows", "overflow"),
        ("int16 values", "not int8"),
        ("tiny block", "block is 3"),
        ("boolean block", "block is True"),
    ],
)
def test_forged_int8_fields_are_refused_with_what_is_wrong(what, words):
    arrays, meta = codecs.encode(ARRAYS, "int8")
    forged(what)(arrays, meta)
    with pytest.raises(codecs.CodecError, match=words):
        codecs.decode(arrays, meta)


def test_an_unknown_codec_to_send_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown codec 'zip'"):
        codecs.encode(ARRAYS, "zip")


@settings(max_examples=200, deadline=None)
@given(
    codec=st.sampled_from(codecs.CODECS[1:]),
    block=st.one_of(st.integers(-5, 1 << 17), st.booleans(), st.text(max_size=3), st.none()),
    scale=st.floats(allow_nan=True, allow_infinity=True, width=32),
    cut=st.integers(0, 3),
    rename=st.booleans(),
)
def test_whatever_a_codecs_fields_say_decoding_gives_float32_or_a_codec_error(
    codec, block, scale, cut, rename
):
    arrays = {"w": np.linspace(-1, 1, 300, dtype=np.float32), "b": np.ones(3, np.float32)}
    encoded, meta = codecs.encode(arrays, codec)
    if codec == "int8":
        meta["block"] = block
        scales = encoded["w" + codecs.SCALES]
        encoded["w" + codecs.SCALES] = np.append(scales[: len(scales) - cut], scale)
        if rename:
            encoded["x" + codecs.SCALES] = encoded.pop("b" + codecs.SCALES)
    try:
        decoded = codecs.decode(encoded, meta)
    except codecs.CodecError:
        return
    assert set(decoded) == set(arrays)
    for name, array in decoded.items():
        assert array.dtype == np.float32 and array.shape == arrays[name].shape
        assert np.isfinite(array).all(), "a scale that passed is finite"


# --------------------------------------------------------------------------- top-k deltas


def changed(arrays, seed=1, scale=0.01):
    rng = np.random.default_rng(seed)
    return {
        name: array + (scale * rng.standard_normal(array.shape)).astype(array.dtype)
        if array.dtype == np.float32
        else array + 1
        for name, array in arrays.items()
    }


def changes_in(delta) -> int:
    return int(np.unpackbits(delta[codecs.MASK]).sum())


def test_a_delta_carries_a_few_bytes_and_the_largest_changes_of_each_tensor():
    after = changed(ARRAYS)
    delta, meta = codecs.encode_delta(after, ARRAYS, TOPK_FRACTION, codecs.base_digest(ARRAYS))
    assert sum(array.nbytes for array in delta.values()) <= 0.1 * FLOAT_BYTES
    applied = codecs.apply_delta(delta, meta, ARRAYS, codecs.base_digest(ARRAYS))
    for name, array in ARRAYS.items():
        change = (after[name] - array).reshape(-1)
        kept = (applied[name] - array).reshape(-1) != 0
        if array.dtype == np.float32:
            assert np.abs(change[kept]).min() >= np.abs(change[~kept]).max(initial=0.0)
        else:
            assert np.array_equal(applied[name], after[name]), "integer tensors whole"


def test_a_large_tensor_keeps_its_largest_changes_within_a_percent_of_the_fraction():
    """Past twice THRESHOLD_SAMPLE entries the threshold comes from a sample: still a
    threshold (no kept change smaller than one left out), the count near the fraction."""
    size = 4 * codecs.THRESHOLD_SAMPLE + 3
    base = {"big": np.zeros(size, dtype=np.float32)}
    after = changed(base, seed=5)
    delta, meta = codecs.encode_delta(after, base, TOPK_FRACTION, codecs.base_digest(base))
    count = changes_in(delta)
    assert abs(count / math.ceil(TOPK_FRACTION * size) - 1) < 0.01
    kept = codecs.apply_delta(delta, meta, base, codecs.base_digest(base))["big"] != 0
    assert kept.sum() == count
    assert np.abs(after["big"][kept]).min() >= np.abs(after["big"][~kept]).max()


def test_a_delta_carries_no_entry_that_did_not_change():
    """A frozen layer, or one the round left alone, costs a delta its mask bits only."""
    after = {**ARRAYS, FIRST: changed({FIRST: ARRAYS[FIRST]})[FIRST]}
    delta, meta = codecs.encode_delta(after, ARRAYS, TOPK_FRACTION, codecs.base_digest(ARRAYS))
    assert changes_in(delta) == math.ceil(TOPK_FRACTION * ARRAYS[FIRST].size)
    applied = codecs.apply_delta(delta, meta, ARRAYS, codecs.base_digest(ARRAYS))
    assert all(np.array_equal(applied[name], ARRAYS[name]) for name in ARRAYS if name != FIRST)


def test_error_feedback_sends_what_a_delta_left_out_in_later_rounds():
    node = DeltaGossip()
    node.start(1, ARRAYS)
    target = changed(ARRAYS)
    gaps = []
    for _ in range(10):  # the model stands still: its public copy closes in on it
        public, _ = node.publish(target)
        gaps.append(max(float(np.abs(public.arrays[k] - target[k]).max()) for k in ARRAYS))
    assert gaps[-1] < 0.01 * gaps[0]


def test_a_receiver_rebuilds_the_senders_public_copy_bit_for_bit_hashing_none(monkeypatch):
    """A copy a delta made is named by its base's name and the delta's bytes, so the
    receiver names what it rebuilt, and checks the next delta's base, hashing no copy
    (a tenth of a 45 MB model's decoding)."""
    sender, receiver = DeltaGossip(), DeltaGossip()
    sender.start(1, ARRAYS)
    receiver.start(1, ARRAYS)  # round 1's base, the initial model: hashed once a run
    hashed: list[list[str]] = []  # the tensor names of what the receiver hashes

    def recording(arrays, real=codecs.base_digest):
        hashed.append(list(arrays))
        return real(arrays)

    model = ARRAYS
    for round_no in (1, 2, 3):
        model = changed(model, seed=round_no)
        public, (delta, meta) = sender.publish(model)
        blob = make_blob(PEER, round_no, DELTA, delta, b"", {"n": 3, **meta})
        base = receiver.base_for("peer", round_no)
        with monkeypatch.context() as receiving:
            receiving.setattr(codecs, "base_digest", recording)
            got = peer_model(blob, (LAYOUT,), base=base, delta=True)
            rebuilt = {name: tensor.numpy() for name, tensor in got.state.items()}
            copy = copy_named_by(blob, rebuilt)
        assert all(np.array_equal(rebuilt[name], public.arrays[name]) for name in public.arrays)
        assert copy is not None and copy.name == public.name, "named as the sender names it"
        receiver.took_in(round_no, {"peer": copy})
    assert hashed and not [names for names in hashed if FIRST in names], "a model's tensors hashed"
    assert receiver.base_for("peer", 5) is None, "a round missed: no base"


def delta_lie(what: str):
    delta, meta = codecs.encode_delta(changed(ARRAYS), ARRAYS, 0.06, codecs.base_digest(ARRAYS))
    mask, values, scales = (
        delta[key].copy() for key in (codecs.MASK, codecs.VALUES, codecs.SCALES)
    )
    if what == "another base":
        meta["base"] = bytes(32)
    elif what == "a mask of another length":
        mask = mask[:-1]
    elif what == "a mask bit past the model":
        assert FLOATS % 8, "the model's float entries must leave bits of the mask unused"
        mask[-1] |= 0x80  # the last bit of the last byte: past the float entries
    elif what == "a value too few":
        values = values[:-1]
    elif what == "values of another dtype":
        values = values.view(np.int8)
    elif what == "a value of -8":
        values[0] = (values[0] & 0xF0) | 0x08
    elif what == "bits past the last value":
        assert changes_in(delta) % 2, "the change count must leave a high nibble unused"
        values[-1] |= 0x10
    elif what == "a scale not finite":
        scales[0] = np.inf
    elif what == "a negative scale":
        scales[0] = -1.0
    elif what == "a block out of range":
        meta["block"] = 3
    elif what == "a tensor missing":
        del delta[codecs.SCALES]
        return delta, meta
    delta |= {codecs.MASK: mask, codecs.VALUES: values, codecs.SCALES: scales}
    return delta, meta


@pytest.mark.parametrize(
    "what",
    [
        "another base",
        "a mask of another length",
        "a mask bit past the model",
        "a value too few",
        "values of another dtype",
        "a value of -8",
        "bits past the last value",
        "a scale not finite",
        "a negative scale",
        "a block out of range",
        "a tensor missing",
    ],
)
def test_a_lying_delta_is_refused_as_codec(what):
    delta, meta = delta_lie(what)
    blob = make_blob(PEER, 1, DELTA, delta, b"", {"n": 3, **meta})
    with pytest.raises(UnusableBlob) as refused:
        peer_model(blob, (LAYOUT,), base=named(ARRAYS), delta=True)
    assert refused.value.reason == "codec"


def test_four_bit_changes_round_trip_in_twos_complement():
    values = np.array([-7, 7, 0, -1, 1, 3, -4], dtype=np.int8)  # an odd count
    packed = codecs._nibbles(values)
    assert packed.tolist() == [0x79, 0xF0, 0x31, 0x0C]
    assert np.array_equal(codecs._from_nibbles(packed, values.size), values)


def mutated(array: np.ndarray, flip: tuple[int, int] | None, cut: int) -> np.ndarray:
    """`array` with one byte XORed (`flip`: position, bits) and `cut` bytes taken off."""
    array = array.copy()
    if flip is not None and array.size:
        array[flip[0] % array.size] ^= flip[1]
    return array[: array.size - cut]


FLIPS = st.one_of(st.none(), st.tuples(st.integers(0, 1 << 16), st.integers(1, 255)))


@settings(max_examples=300, deadline=None)
@given(
    mask_flip=FLIPS,
    values_flip=FLIPS,
    values_cut=st.sampled_from([0, 0, 1]),
    scale=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True, width=32)),
    block=st.one_of(st.just(codecs.INT8_BLOCK), st.integers(-5, 1 << 17), st.booleans()),
)
def test_whatever_a_deltas_fields_say_applying_it_gives_the_bases_layout_or_a_codec_error(
    mask_flip, values_flip, values_cut, scale, block
):
    # A base of 21 float entries: mask bits past them, and an odd count of changes.
    base = {"w": np.linspace(-1, 1, 21, dtype=np.float32), "steps": np.arange(2)}
    delta, meta = codecs.encode_delta(changed(base), base, TOPK_FRACTION, codecs.base_digest(base))
    delta[codecs.MASK] = mutated(delta[codecs.MASK], mask_flip, 0)
    delta[codecs.VALUES] = mutated(delta[codecs.VALUES], values_flip, values_cut)
    if scale is not None:
        delta[codecs.SCALES] = np.array([scale], np.float32)
    meta["block"] = block
    try:
        applied = codecs.apply_delta(delta, meta, base, codecs.base_digest(base))
    except codecs.CodecError:
        return
    assert list(applied) == list(base)
    for name, array in applied.items():
        assert array.dtype == base[name].dtype and array.shape == base[name].shape


def test_a_whole_blob_under_topk_travels_as_float32():
    """Only a gossiped model has a base its peers hold: a coordinator's model, or any
    other whole blob of a topk node, goes as it is."""
    blob = signed_blob(PEER, 1, "personal", ARRAYS, b"", {}, "topk")
    assert "codec" not in blob.meta and layout_of(blob.arrays()) == layout_of(ARRAYS)


def test_the_next_delta_names_as_its_base_the_copy_a_sender_published_whole():
    sender = DeltaGossip()
    first, _ = sender.publish(ARRAYS)  # no copy before it (a resumed node): hashed whole
    assert first.name == codecs.base_digest(ARRAYS)
    second, (delta, meta) = sender.publish(changed(ARRAYS))
    assert meta["base"] == first.name
    _, (_, after) = sender.publish(changed(ARRAYS, seed=2))
    assert after["base"] == second.name == codecs.delta_copy_name(first.name, delta)


def test_a_whole_copy_is_a_base_only_under_the_name_its_blob_gives():
    """A receiver that takes a peer's whole public copy in hashes it no more than a
    delta's: it keeps it under `meta.copy`, and one without a name is no base."""
    name = codecs.base_digest(ARRAYS)
    named_blob = make_blob(PEER, 2, "model", ARRAYS, b"", {PUBLIC: True, codecs.COPY: name})
    copy = copy_named_by(named_blob, ARRAYS)
    assert copy is not None and copy.name == name and copy.arrays is ARRAYS
    for nameless in ({PUBLIC: True}, {PUBLIC: True, codecs.COPY: name[:31]}):
        assert copy_named_by(make_blob(PEER, 2, "model", ARRAYS, b"", nameless), ARRAYS) is None


def test_a_delta_against_a_base_never_held_is_refused_as_codec():
    delta, meta = codecs.encode_delta(changed(ARRAYS), ARRAYS, 0.06, codecs.base_digest(ARRAYS))
    blob = make_blob(PEER, 4, DELTA, delta, b"", {"n": 3, **meta})
    with pytest.raises(UnusableBlob, match="does not hold") as refused:
        peer_model(blob, (LAYOUT,), base=DeltaGossip().base_for("peer", 4), delta=True)
    assert refused.value.reason == "codec"


@pytest.mark.parametrize("how", ["scales first", "scales of scales"])
def test_int8_scales_come_right_after_their_tensor_and_nowhere_else(how):
    arrays, meta = codecs.encode(ARRAYS, "int8")
    scales = FIRST + codecs.SCALES
    if how == "scales first":
        arrays = {scales: arrays.pop(scales), **arrays}
    else:
        arrays[scales + codecs.SCALES] = np.array([np.nan], dtype=np.float32)
    with pytest.raises(codecs.CodecError, match="scales of no tensor"):
        codecs.decode(arrays, meta)


def test_a_compressed_blob_of_another_model_is_refused_before_it_is_decoded(monkeypatch):
    other = state_to_arrays(build_model("mlp", (1, 28, 28), 10, seed=0))
    blob = signed_blob(PEER, 1, "model", other, b"", {"n": 3}, "int8")
    monkeypatch.setattr(codecs, "decode", lambda *_: pytest.fail("decoded"))
    with pytest.raises(UnusableBlob) as refused:
        peer_model(blob, (LAYOUT,))
    assert refused.value.reason == "layout"


def test_only_public_copies_are_read_with_the_nodes_lag():
    lag = {FIRST: torch.ones_like(torch.from_numpy(ARRAYS[FIRST]))}
    state = {name: torch.from_numpy(array) for name, array in ARRAYS.items()}
    read = read_as(state, lag)
    assert torch.equal(read[FIRST], state[FIRST] + 1)
    whole = make_blob(PEER, 1, "model", ARRAYS, b"", {"n": 3})
    public = make_blob(PEER, 1, "model", ARRAYS, b"", {"n": 3, PUBLIC: True})
    assert not is_public_copy(whole) and is_public_copy(public)
