"""A peer's blob as the tensors a rule may take in, or a refusal with a named reason.

A signature proves who sent a blob, not that it is usable. Before any rule sees a
peer's tensors the node checks, in this order (the first failure names the reason):

    codec         the tensors decode under the codec the signed meta names
                  (protocol/codecs.py): a known codec, scales that are finite, not
                  negative and as many as the blocks. Every later check, and every
                  rule, sees the decoded float32 tensors.
    layout        the tensors (names, order, wire dtypes, shapes) are one of the
                  layouts the rule expects for the blob's kind: the mesh's model, a
                  part of it, or the rule's own small tensors. The schema digest in
                  the signed record only claims the model; this checks the claim.
    sample_count  the sample count `n` is an integer in 1..2**53 (absent: 1); it weighs
                  the averages. A count that is merely inflated cannot be told from a
                  big dataset.
    not_finite    no floating-point tensor holds NaN or inf (averaged in, one such
                  value spoils every weight).

Two more reasons: `meta`, an `upload` or `personal` message whose signed record or
meta does not fit it (node/coordinator.py `checked_direct`), and `rule_error`, given
by the round itself (node/containment.py) when a peer's tensors passed these checks and
still made the rule raise.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from meshfl.algorithms import PeerModel
from meshfl.algorithms.base import Layout
from meshfl.protocol import codecs
from meshfl.protocol.identity import Identity
from meshfl.protocol.wire import Blob, make_blob, wire_dtype

from .deltas import Copy

# Beyond 2**53 a float weight no longer holds the count exactly; no node has that many
# samples. (A count merely inflated below it cannot be told from a big dataset.)
MAX_SAMPLE_COUNT = 2**53
RULE_ERROR = "rule_error"
REFUSAL_REASONS = ("codec", "layout", "sample_count", "not_finite", "meta", RULE_ERROR)


class UnusableBlob(ValueError):
    """A peer's blob no rule should take in; `reason` is one of REFUSAL_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REFUSAL_REASONS, reason
        super().__init__(detail)
        self.reason = reason


def layout_of(arrays: Mapping[str, np.ndarray]) -> Layout:
    """The layout of tensors as they travel without a codec (what `make_blob` would
    index for them)."""
    return tuple((name, wire_dtype(array), tuple(array.shape)) for name, array in arrays.items())


def whole_blob_codec(compression: str) -> str:
    """The codec of a node's whole blobs under its `compression`: under `topk` float32,
    for only a gossiped model has a base its peers hold (node/deltas.py)."""
    return "none" if compression == codecs.TOPK else compression


def signed_blob(
    identity: Identity,
    round_no: int,
    kind: str,
    arrays: Mapping[str, np.ndarray],
    schema: bytes,
    meta: Mapping[str, Any],
    compression: str,
) -> Blob:
    """`arrays` signed as a blob under the node's `compression`, the codec named in its
    meta (`whole_blob_codec`)."""
    encoded, named = codecs.encode(arrays, whole_blob_codec(compression))
    return make_blob(identity, round_no, kind, encoded, schema, {**meta, **named})


def decoded_arrays(blob: Blob) -> dict[str, np.ndarray]:
    """The blob's tensors decoded by the codec its meta names, each in memory of its own
    (one copy at most: what needed no decoding is a view of the received bytes), or
    UnusableBlob."""
    received = blob.arrays()
    try:
        decoded = codecs.decode(received, blob.meta)
    except codecs.CodecError as error:
        what = f"{reprlib.repr(blob.kind)} blob of round {blob.round}"
        raise UnusableBlob("codec", f"{what}: {error}") from None
    return {
        name: np.array(array) if array is received.get(name) else array
        for name, array in decoded.items()
    }


def describe_mismatch(got: Layout, expected: tuple[Layout, ...]) -> str:
    """Where a layout first departs from the nearest expected one, in a few words."""
    if not expected:
        return "no blob of this kind is expected"
    nearest = max(expected, key=lambda layout: _common_prefix(got, layout))
    at = _common_prefix(got, nearest)
    if at == len(got) == len(nearest):
        return "layout matches"  # not reached for a refused blob
    theirs = reprlib.repr(got[at]) if at < len(got) else "nothing"
    ours = reprlib.repr(nearest[at]) if at < len(nearest) else "nothing"
    return (
        f"{len(got)} tensors where {len(nearest)} are expected; tensor {at} is "
        f"{theirs}, expected {ours}"
    )


def _common_prefix(a: Layout, b: Layout) -> int:
    count = 0
    for left, right in zip(a, b, strict=False):
        if left != right:
            break
        count += 1
    return count


def _check_layout(
    what: str,
    layout: Layout,
    expected: tuple[Layout, ...],
    fits: Callable[[Layout], bool] | None,
) -> None:
    if not (fits(layout) if fits is not None else layout in expected):
        raise UnusableBlob(
            "layout",
            f"{what}: its tensors are not the mesh's schema: {describe_mismatch(layout, expected)}",
        )


def delta_arrays(blob: Blob, base: Copy | None) -> dict[str, np.ndarray]:
    """A delta blob's model (node/deltas.py): `base` with its changes, or UnusableBlob."""
    try:
        if base is None:
            raise codecs.CodecError("a delta against a base this node does not hold")
        return codecs.apply_delta(blob.arrays(), blob.meta, base.arrays, base.name)
    except codecs.CodecError as error:
        what = f"{reprlib.repr(blob.kind)} blob of round {blob.round}"
        raise UnusableBlob("codec", f"{what}: {error}") from None


def peer_model(
    blob: Blob,
    expected: tuple[Layout, ...],
    fits: Callable[[Layout], bool] | None = None,
    base: Copy | None = None,
    delta: bool = False,
) -> PeerModel:
    """The blob's tensors and sample count, or UnusableBlob (see the module docstring).
    The blob's layout must be one of `expected`, or pass `fits` where one is given (the
    refusal still says where it departs from `expected`). A `delta` blob's tensors are
    its changes to `base` (node/deltas.py), checked as the model they make."""
    what = f"{reprlib.repr(blob.kind)} blob of round {blob.round}"
    index = tuple((info.name, info.dtype, tuple(info.shape)) for info in blob.index)
    if not delta:  # a delta's layout is its base's, checked once applied
        try:
            layout = codecs.decoded_layout(index, blob.meta)
        except codecs.CodecError as error:
            raise UnusableBlob("codec", f"{what}: {error}") from None
        _check_layout(what, layout, expected, fits)
    arrays = delta_arrays(blob, base) if delta else decoded_arrays(blob)
    _check_layout(what, layout_of(arrays), expected, fits)
    n = blob.meta.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLE_COUNT:
        raise UnusableBlob(
            "sample_count",
            f"{what}: its sample count n is {reprlib.repr(n)}, not an integer in 1..2**53",
        )
    tensors = {name: torch.from_numpy(array) for name, array in arrays.items()}
    spoilt = [
        name
        for name, tensor in tensors.items()
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]
    if spoilt:
        raise UnusableBlob(
            "not_finite", f"{what} holds NaN or inf in {reprlib.repr(', '.join(spoilt))}"
        )
    return PeerModel(tensors, n)
