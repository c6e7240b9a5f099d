"""How a blob's float tensors travel: as they are, as half floats, or as blockwise int8.

The sender names the codec in the blob's signed `meta` (`codec`, and `block` for int8),
so a receiver decodes whatever it is sent and the signature covers the bytes as they
travel. Decoding turns a blob's arrays back into float32 ones; every field a codec adds
is checked like any other input (WIRE.md 9.2), and a blob that fails is refused with
`CodecError`. Integer tensors (counters, token tables) always travel as they are.

    none   float32 as float32
    fp16   float32 as IEEE half; a tensor with a value beyond half's range stays float32
    bf16   float32 as bfloat16 (the upper 16 bits, rounded to nearest even), wire dtype
           `bfloat16`: float32's range, 8 bits of mantissa
    int8   float32 as int8 q with a float32 scale per block of `block` values of the
           flattened tensor: x ≈ q * scale, scale = max |x| of the block / 127. The
           scales travel as a tensor of their own, named NAME#scales, after NAME.

A delta (`encode_delta`, `apply_delta`; WIRE.md 9.3) is another kind of blob: the
largest entries of a model's change against a base both sides hold, which it names, as
a bit mask of the entries and their changes in 4 bits each; the copy it makes is named
by its base's name and its own bytes (`delta_copy_name`). It is not one of CODECS, for
it decodes only beside its base.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from typing import Any

import numpy as np
from blake3 import blake3

from .wire import DIGEST_BYTES, wire_dtype

CODECS = ("none", "fp16", "bf16", "int8")
INT8_BLOCK = 128  # values per scale: 4 bytes of scale per 128 of data, 0.26 of float32
MIN_BLOCK, MAX_BLOCK = 8, 1 << 16
# The largest scale: int8's -128 times it is still finite (a float32 exactly, a power of
# two below float32's largest, so comparing float32 scales with it rounds nothing).
MAX_SCALE = np.float32(np.finfo(np.float32).max / 128)
SCALES = "#scales"  # suffix of an int8 tensor's scales; '#' is in no torch state-dict key
HALF_MAX = float(np.finfo(np.float16).max)

Arrays = Mapping[str, np.ndarray]


class CodecError(ValueError):
    """A blob whose codec fields do not decode (unknown codec, forged scales, ...)."""


def encode(arrays: Arrays, codec: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """`arrays` as they travel under `codec`, and the meta entries that name it."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    if codec == "none":
        return dict(arrays), {}
    if codec == "int8":
        encoded: dict[str, np.ndarray] = {}
        for name, array in arrays.items():
            if array.dtype == np.float32:
                encoded[name], encoded[name + SCALES] = _int8(array, INT8_BLOCK)
            else:
                encoded[name] = array
        return encoded, {"codec": codec, "block": INT8_BLOCK}
    narrow = _half if codec == "fp16" else _bfloat16
    return {
        name: narrow(array) if array.dtype == np.float32 else array
        for name, array in arrays.items()
    }, {"codec": codec}


Layout = tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, wire dtype, shape) each


def decoded_layout(layout: Layout, meta: Mapping[str, Any]) -> Layout:
    """The layout a blob's tensors will have once decoded, read off its index alone: a
    receiver refuses a blob of the wrong model before decoding makes it up to four times
    bigger. CodecError where the codec is unknown (the tensors' own fields are checked
    when they are decoded)."""
    codec = meta.get("codec", "none")
    if codec not in CODECS:
        raise CodecError(f"codec {str(codec)[:32]!r} is none of {', '.join(CODECS)}")
    narrow = {"fp16": "float16", "bf16": "bfloat16", "int8": "int8"}.get(codec)
    names = {name for name, _, _ in layout}
    return tuple(
        (name, "float32" if dtype == narrow and _widens(codec, name, names) else dtype, shape)
        for name, dtype, shape in layout
        if not (codec == "int8" and name.endswith(SCALES))
    )


def _widens(codec: str, name: str, names: set[str]) -> bool:
    """Whether a tensor of the codec's narrow dtype decodes to float32 (under int8 only
    one with scales: an int8 tensor without them is an integer tensor)."""
    return codec != "int8" or name + SCALES in names


def decode(arrays: Arrays, meta: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A received blob's arrays as float32 tensors again, or CodecError naming what is
    wrong. Arrays may be read-only views of the received bytes; what comes back may
    share memory with them where nothing needed decoding."""
    codec = meta.get("codec", "none")
    if codec not in CODECS:
        raise CodecError(f"codec {str(codec)[:32]!r} is none of {', '.join(CODECS)}")
    if codec == "none":
        return dict(arrays)
    if codec == "int8":
        return _decode_int8(arrays, meta.get("block"))
    wire = np.dtype("<f2") if codec == "fp16" else BFLOAT16
    return {name: _widen(array) if array.dtype == wire else array for name, array in arrays.items()}


# --------------------------------------------------------------------------- halves

BFLOAT16 = np.dtype("<u2")  # bfloat16's bits; numpy has no bfloat16 arithmetic


def _half(array: np.ndarray) -> np.ndarray:
    if array.size and not float(np.abs(array).max()) <= HALF_MAX:
        return array  # inf in half would be refused as not finite: keep it whole
    return array.astype("<f2")


def _bfloat16(array: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(array, dtype="<f4").view("<u4")
    # Round to nearest, ties to even: add 0x7FFF plus the lowest bit that survives.
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(BFLOAT16)


def _widen(array: np.ndarray) -> np.ndarray:
    if array.dtype == BFLOAT16:
        return (array.astype("<u4") << np.uint32(16)).view("<f4")
    return array.astype("<f4")


# --------------------------------------------------------------------------- int8


def _int8(array: np.ndarray, block: int, peak: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """`array` as int8 values within ±`peak`, with a float32 scale per `block` of them."""
    flat = np.ascontiguousarray(array, dtype="<f4").reshape(-1)
    full = flat.size - flat.size % block
    rows = [flat[:full].reshape(-1, block)] + ([flat[full:][None, :]] if full < flat.size else [])
    # max |x| as max and -min: no temporary array of absolute values
    peaks = [np.maximum(part.max(axis=1), -part.min(axis=1)) for part in rows if part.size]
    scales = (np.concatenate(peaks) if peaks else np.zeros(0, "<f4")) / np.float32(peak)
    inverse = np.divide(1, scales, out=np.zeros_like(scales), where=scales > 0)
    q = np.empty(flat.size, dtype=np.int8)
    for part, begin in zip(rows, (0, full), strict=False):
        factors = inverse[begin // block : begin // block + len(part), None]
        scaled = part * factors
        np.rint(scaled, out=scaled)  # within ±peak: the block's largest maps to it
        q[begin : begin + part.size] = scaled.reshape(-1)
    return q.reshape(array.shape), scales.astype("<f4")


def _check_block(block: Any) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or not MIN_BLOCK <= block <= MAX_BLOCK:
        raise CodecError(
            f"int8 block is {str(block)[:32]}, not an integer in {MIN_BLOCK}..{MAX_BLOCK}"
        )


def _decode_int8(arrays: Arrays, block: Any) -> dict[str, np.ndarray]:
    _check_block(block)
    decoded: dict[str, np.ndarray] = {}
    names = list(arrays)
    for at, name in enumerate(names):
        if name.endswith(SCALES):
            owner = name[: -len(SCALES)]
            if at == 0 or names[at - 1] != owner or owner.endswith(SCALES):
                raise CodecError(f"{name[:64]!r}: scales of no tensor right before them")
            continue
        array, scales = arrays[name], arrays.get(name + SCALES)
        decoded[name] = array if scales is None else _dequantize(name, array, scales, block)
    return decoded


def _dequantize(name: str, q: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """`q` times its blocks' scales, as float32, or CodecError where a field is forged.
    A scale may be at most the largest float32 over 128, so that every int8 value times
    its scale is finite (an encoder writes a larger one only for a tensor within 1% of
    float32's largest value, or a top-k change above about 1.9e37)."""
    where = repr(name[:64])
    if q.dtype != np.int8:
        raise CodecError(f"{where}: has scales but is {q.dtype}, not int8")
    blocks = -(-q.size // block)
    if scales.dtype != np.float32 or scales.shape != (blocks,):
        raise CodecError(
            f"{where}: scales are {scales.dtype} {scales.shape}, not float32 ({blocks},)"
        )
    if not ((scales >= 0) & (scales <= MAX_SCALE)).all():  # NaN passes neither
        raise CodecError(
            f"{where}: a scale is negative, not finite or above {MAX_SCALE:.4g} "
            "(its values would overflow)"
        )
    flat, values = q.reshape(-1), np.empty(q.size, dtype="<f4")
    full = q.size - q.size % block
    np.multiply(
        flat[:full].reshape(-1, block),
        scales[: full // block, None],
        out=values[:full].reshape(-1, block),
    )
    if full < q.size:
        np.multiply(flat[full:], scales[-1], out=values[full:])
    return values.reshape(q.shape)


# --------------------------------------------------------------------------- top-k deltas

TOPK = "topk"
# A delta's three tensors, over the model's float32 tensors flattened and laid end to
# end in the base's order: which entries changed (a bit each), their changes in 4 bits
# each, two to a byte, and the changes' scales (named SCALES, whole: a scale per
# INT8_BLOCK changes, as int8 has). '#' is in no torch state-dict key, so no tensor is
# named alike.
MASK, VALUES = "#mask", "#values"
# The meta entry of a whole public copy that names it: a receiver that took it in knows
# the name of the next delta's base without hashing the copy.
COPY = "copy"
# A change travels as a 4-bit two's-complement value within ±NIBBLE_PEAK; error
# feedback carries its rounding in a later delta, so 4 bits cost no more accuracy than 8
# did, and send a third more entries in the same bytes (docs/measurements.md).
NIBBLE_PEAK = 7
# Entries a large tensor's threshold is taken from: partitioning all of a 45 MB model's
# changes took a fifth of its encoding, and a sample this size counts the entries kept
# to within about half a percent (a binomial's spread at 30%). Every tensor of the
# built-in models is under twice this, so their deltas are exact.
THRESHOLD_SAMPLE = 1 << 17


def base_digest(arrays: Arrays) -> bytes:
    """BLAKE3 over every tensor's name, dtype, shape and bytes, in order: the name of a
    copy that no delta made (the initial model, a copy published whole first), and of
    a delta's own tensors in `delta_copy_name`."""
    digest = blake3()
    for name, array in arrays.items():
        shape = ",".join(str(size) for size in array.shape)
        digest.update(f"{name}|{wire_dtype(array)}|{shape}|".encode())
        digest.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    return digest.digest()


def encode_delta(
    arrays: Arrays, base: Arrays, fraction: float, base_named: bytes
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The change from `base` to `arrays` as it travels (WIRE.md 9.3): of each float32
    tensor its largest changes (those at least its ceil(fraction * size)-th largest,
    zeros never), all tensors' in one bit mask and one run of blockwise 4-bit changes;
    other tensors whole. A bit per entry and half a byte per change: at a fraction of
    0.3, 0.07 of float32's bytes. The meta names the codec, the block and the base (by
    `base_named`, the name the caller holds it under)."""
    floats = [name for name, array in arrays.items() if array.dtype == np.float32]
    sizes = [arrays[name].size for name in floats]
    chosen = np.empty(sum(sizes), dtype=bool)
    # Each tensor's change in turn, in one buffer: a model-sized array would cost its
    # fresh pages on every encoding.
    scratch = np.empty(max(sizes, default=0), dtype="<f4")
    changes, begin = [], 0
    for name, size in zip(floats, sizes, strict=True):
        change = np.subtract(
            np.asarray(arrays[name], "<f4").reshape(-1),
            np.asarray(base[name], "<f4").reshape(-1),
            out=scratch[:size],
        )
        mask = chosen[begin : begin + size]
        _mark_largest(change, math.ceil(fraction * size), out=mask)
        changes.append(change.take(np.flatnonzero(mask)))
        begin += size
    values, scales = _int8(np.concatenate(changes or [np.zeros(0, "<f4")]), INT8_BLOCK, NIBBLE_PEAK)
    encoded = {name: array for name, array in arrays.items() if array.dtype != np.float32}
    encoded |= {
        MASK: np.packbits(chosen, bitorder="little"),
        VALUES: _nibbles(values),
        SCALES: scales,
    }
    return encoded, {"codec": TOPK, "block": INT8_BLOCK, "base": base_named}


def _mark_largest(change: np.ndarray, keep: int, out: np.ndarray) -> None:
    """Sets in `out` (booleans) the entries of `change` whose magnitude is at least its
    `keep`-th largest and that are not zero. A threshold and a scan: a quarter of
    argpartition's time; the changes are then taken by index, for boolean indexing
    mispredicts its way through a random mask. Past 2 * THRESHOLD_SAMPLE entries the
    threshold is that of every stride-th entry, about THRESHOLD_SAMPLE of them, whose
    count is within about a percent of `keep`."""
    if keep <= 0 or change.size == 0:
        out[:] = False
        return
    stride = max(1, change.size // THRESHOLD_SAMPLE)
    sample = change[::stride]
    at = sample.size - min(math.ceil(keep * sample.size / change.size), sample.size)
    magnitude = np.abs(sample)
    magnitude.partition(at)  # in place: the scan below reads `change`
    threshold = magnitude[at]
    if threshold == 0:
        np.not_equal(change, 0, out=out)
        return
    np.greater_equal(change, threshold, out=out)
    out |= change <= -threshold


def apply_delta(
    delta: Arrays, meta: Mapping[str, Any], base: Arrays, base_named: bytes
) -> dict[str, np.ndarray]:
    """`base` with `delta`'s changes added (float32), or CodecError where the delta is
    not one of `base` (another digest, other tensors) or its fields do not hold.
    `base_named`: the name the caller holds `base` under (WIRE.md 9.3)."""
    if meta.get("codec") != TOPK or meta.get("base") != base_named:
        raise CodecError("a delta against a base this node does not hold")
    _check_block(meta.get("block"))
    floats = [name for name, array in base.items() if array.dtype == np.float32]
    if set(delta) != {MASK, VALUES, SCALES} | (set(base) - set(floats)):
        raise CodecError("a delta whose tensors are not its base's")
    # The base's float entries end to end, copied once; the changes added in place.
    flat = np.concatenate(
        [np.asarray(base[name], "<f4").reshape(-1) for name in floats] or [np.zeros(0, "<f4")]
    )
    at = np.flatnonzero(_chosen(delta[MASK], flat.size))
    values = _from_nibbles(delta[VALUES], at.size)
    flat[at] += _dequantize(VALUES, values, delta[SCALES], meta["block"])
    applied, begin = {}, 0
    for name, array in base.items():
        if array.dtype != np.float32:
            applied[name] = np.array(delta[name])
            continue
        applied[name] = flat[begin : begin + array.size].reshape(array.shape)
        begin += array.size
    return applied


def named_copy(meta: Mapping[str, Any]) -> bytes:
    """The name a whole public copy's blob gives the copy, `meta.copy` (WIRE.md 9.3), or
    CodecError where it gives none."""
    named = meta.get(COPY)
    if not isinstance(named, bytes) or len(named) != DIGEST_BYTES:
        raise CodecError(f"meta.{COPY} is {reprlib.repr(named)}, not a {DIGEST_BYTES}-byte digest")
    return named


def delta_copy_name(base_named: bytes, delta: Arrays) -> bytes:
    """The name of the copy a delta makes: BLAKE3 over its base's name and the digest of
    its own tensors as they travel. Sender and receiver each compute it from a few
    megabytes of delta, where hashing the copy would read the whole model."""
    return blake3(base_named + base_digest(delta)).digest()


def _nibbles(values: np.ndarray) -> np.ndarray:
    """int8 values within ±NIBBLE_PEAK, two to a byte: the even-numbered one in the low
    four bits, in two's complement; an odd count leaves the last high four bits zero."""
    low4 = np.zeros(values.size + values.size % 2, dtype=np.uint8)
    np.bitwise_and(values.view(np.uint8), np.uint8(0x0F), out=low4[: values.size])
    return low4[0::2] | (low4[1::2] << np.uint8(4))


def _from_nibbles(packed: np.ndarray, count: int) -> np.ndarray:
    """The `count` int8 values `_nibbles` packed, or CodecError where `packed` is not
    what it makes: another dtype or length, a value of -8, bits set past the last value."""
    size = -(-count // 2)
    if packed.dtype != np.uint8 or packed.shape != (size,):
        raise CodecError(f"values are {packed.dtype} {packed.shape}, not uint8 ({size},)")
    low4 = np.empty(2 * size, dtype=np.uint8)
    np.bitwise_and(packed, np.uint8(0x0F), out=low4[0::2])
    np.right_shift(packed, np.uint8(4), out=low4[1::2])
    if count % 2 and low4[-1]:
        raise CodecError("bits set past the last value")
    if (low4 == 8).any():
        raise CodecError(f"a value of -8, beyond ±{NIBBLE_PEAK}")
    # Sign extension of four bits: flip the sign bit, then take its weight off.
    return (low4[:count] ^ np.uint8(8)).view(np.int8) - np.int8(8)


def _chosen(mask: np.ndarray, size: int) -> np.ndarray:
    """The entries a delta's `mask` sets, as booleans over the `size` float entries."""
    if mask.dtype != np.uint8 or mask.shape != (-(-size // 8),):
        raise CodecError(f"mask is {mask.dtype} {mask.shape}, not uint8 ({-(-size // 8)},)")
    bits = np.unpackbits(mask, bitorder="little").view(bool)
    if bits[size:].any():
        raise CodecError(f"a mask bit set past the model's {size} float entries")
    return bits[:size]
