"""`compression: topk`: a node's model travels as the largest entries of its change.

CHOCO-style gossip of public copies. Every node keeps a *public* copy of its model: what
its peers hold of it. Each round it publishes two blobs of the same model: a delta
(kind `model~delta`: the top TOPK_FRACTION of each tensor's change from its public copy,
protocol/codecs.py `encode_delta`) and the whole public copy after that change (kind
`model`, float32). What the delta leaves out stays in the difference between the model
and its public copy, so it travels in a later round (error feedback, kept by the
sender). Announces are digests, so offering both costs a few bytes: a peer that holds
the origin's public copy of the round before fetches the delta and adds it; a peer that
does not (a newcomer, a new neighbour, one that missed a round) fetches the whole one.

In round 1 every node's base is the mesh's seeded initial model, which every node
builds alike, so no whole model travels in a mesh that starts together. A delta names
its base by digest, so a receiver whose base differs (a task whose model() is not
seeded) refuses it as `codec` and fetches that peer's whole model a round later. A
copy a delta made is named by its base's name and the delta's own bytes, a whole copy
by the name its blob gives, so the only copies hashed whole are the initial model
(once a run) and the first copy a node publishes after a resume or a join.

A peer's public copy lags its model by what its deltas have not carried yet, and
where a round's change is dense (an aggregate replaces the whole model) that lag is
most of the model's change. Every node's copy lags alike, by a part that is mostly the
mesh's common change, so a node reads a peer's copy as x̂_j + (x_i − x̂_i), its own lag
added (`read_as`): the rule then mixes x_i + Σ w_j (x̂_j − x̂_i), CHOCO-SGD's consensus
step, and the common lag cancels.

What a receiver keeps: each peer's public copy of the last round, for the peers whose
model it took in then (one model per such peer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

from meshfl.protocol import codecs
from meshfl.protocol.wire import Blob

DELTA = "model~delta"  # the blob kind of a model's delta; never one a rule publishes
PUBLIC = "public"  # meta of a `model` blob that is a public copy (true), not the model
TOPK_FRACTION = 0.30  # of each tensor's entries: a bit each, half a byte each of these: 0.07

Arrays = dict[str, np.ndarray]


def owned(arrays: Mapping[str, np.ndarray]) -> Arrays:
    return {name: np.array(array) for name, array in arrays.items()}


class Copy(NamedTuple):
    """A public copy and its name (WIRE.md 9.3): a delta's copy named by its base's
    name and the delta's bytes, a whole one by the name its blob gives, the initial
    model by its content digest."""

    arrays: Arrays
    name: bytes


def named(arrays: Arrays) -> Copy:
    return Copy(arrays, codecs.base_digest(arrays))


class DeltaGossip:
    """A node's public copy, and what it holds of each peer's."""

    def __init__(self, fraction: float = TOPK_FRACTION) -> None:
        self.fraction = fraction
        self.public: Copy | None = None  # what peers hold of this node's model
        self.initial: Copy | None = None  # the mesh's initial model, round 1's base
        self._peers: dict[str, tuple[int, Copy]] = {}  # name -> (round, public copy)

    def start(self, round_no: int, model: Mapping[str, np.ndarray]) -> None:
        """Before round `round_no` trains: a mesh's first round starts from its initial
        model, the base of round 1's deltas, on both sides (hashed once a run)."""
        if round_no == 1 and self.initial is None:
            self.initial = named(owned(model))
            self.public = self.initial

    def publish(self, model: Mapping[str, np.ndarray]) -> tuple[Copy, tuple[Arrays, dict] | None]:
        """The whole public copy to publish after this round's change, named, and the
        delta (its arrays and meta) that makes it from the last one; None where there is
        no last one (a node resumed or joined mid-run publishes whole models first)."""
        if self.public is None:
            self.public = named(owned(model))
            return self.public, None
        last = self.public
        delta, meta = codecs.encode_delta(model, last.arrays, self.fraction, last.name)
        copy = codecs.apply_delta(delta, meta, last.arrays, last.name)
        self.public = Copy(copy, codecs.delta_copy_name(last.name, delta))
        return self.public, (delta, meta)

    def base_for(self, peer: str, round_no: int) -> Copy | None:
        """The base of `peer`'s delta of round `round_no`: its public copy of the round
        before, where this node took it in, or the initial model in round 1."""
        held = self._peers.get(peer)
        if held is not None and held[0] == round_no - 1:
            return held[1]
        return self.initial if round_no == 1 else None

    def took_in(self, round_no: int, copies: Mapping[str, Copy]) -> None:
        """The public copies that arrived in round `round_no`, by peer: the bases of
        their next deltas. Peers not among them would need a base this node lacks.
        Kept as they are: a rule reads them only through `read_as`, which makes new
        float tensors, so nothing writes into them."""
        self._peers = {peer: (round_no, copy) for peer, copy in copies.items()}

    def lag(self, model: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This node's model less its public copy, float entries only: what its own
        deltas have not carried yet (nothing before its first publication)."""
        if self.public is None:
            return {}
        return {
            name: tensor - torch.from_numpy(self.public.arrays[name])
            for name, tensor in model.items()
            if tensor.is_floating_point() and name in self.public.arrays
        }


def read_as(copy: Mapping[str, torch.Tensor], lag: Mapping[str, torch.Tensor]) -> dict:
    """A peer's public copy as this node reads it: with this node's own `lag` added."""
    return {name: tensor + lag[name] if name in lag else tensor for name, tensor in copy.items()}


def is_public_copy(blob: Blob) -> bool:
    """Whether a peer's model blob is its public copy (a delta's, or one it says it is),
    read with this node's lag added; any other is the peer's model as it is."""
    return blob.kind == DELTA or blob.meta.get(PUBLIC) is True


def copy_named_by(blob: Blob, arrays: Arrays) -> Copy | None:
    """`arrays`, the public copy `blob` carried or made, under its name: a delta's copy
    by its base's name and its own tensors (codecs.delta_copy_name), a whole copy by the
    name its blob gives; None where that gives none: no delta can then be applied to it."""
    if blob.kind == DELTA:
        base = blob.meta.get("base")  # the name of the copy it was applied to
        return (
            Copy(arrays, codecs.delta_copy_name(base, blob.arrays()))
            if isinstance(base, bytes)
            else None
        )
    try:
        return Copy(arrays, codecs.named_copy(blob.meta))
    except codecs.CodecError:
        return None
