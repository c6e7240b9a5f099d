"""Models that are nobody's work of their round (screening's step 2): a copy of another
peer's model of the same round ("copy"), or of a model another peer sent or this node
adopted in one of the last MEMORY_ROUNDS rounds ("replay"), bit for bit or within a
little noise.

Bit for bit is not enough: a relay that adds noise to a model it got elsewhere changes
every bit and looks as helpful as its source, and one process can run many such
identities for the cost of none of their training. Distance gives it away. Two honest
peers that trained from nearby starts on data of their own lie about as far from each
other as each lies from this node's model; a relay lies within its noise of its source.
So a model is a copy where it lies closer to another than NEAR_COPY times the round's
spread: the lower median distance of the round's models from the model the node began
the round with (its own model in its first round here), a distance a round of training
makes. A lower median, so that far models (which step 3 keeps out) cannot stretch it
unless they are more than half the round's (a bounded view holds few places for one
network, WIRE.md 7.7). Every model of a pair is kept out, as bit-for-bit copies always
were: neither earns credit for the other's work, and benefit-chosen views drop them. A
peer's own earlier models count only bit for bit: a node settled on a skewed shard
moves less in a round than nodes lie apart, and its model is still its own work.

Distances are measured between sketches, so that a model of an earlier round costs
SKETCH_SIZE numbers to remember rather than a model, and a sketch a few thousand reads
rather than a pass over the model: about SAMPLED floats at positions drawn at random,
each tensor read at least MIN_SAMPLED times (a small head beside a large frozen body is
not missed) and weighted by how many floats each read stands for, each added with a
random sign to one of SKETCH_SIZE sums (a count sketch of a random sample): an estimate
of a distance spread over the model to within about a tenth. Positions, signs and sums
are drawn from the node's seed and name: a relay that knew them could put its noise
where the sketch does not look (a seed of its own keeps a node's draws to itself).
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Collection, Mapping
from typing import NamedTuple

import torch

from .base import State, draw_seed

MEMORY_ROUNDS = 3
SAMPLED = 4096  # floats a sketch reads, about, at positions drawn by the node
MIN_SAMPLED = 16  # ...and at least this many of every tensor (all of a smaller one)
SKETCH_SIZE = 256
# Below this share of the round's spread, two models are one model. Honest models lie
# further apart: the nearest honest pair of each run measured (docs/defences.md, "Many
# identities on few machines") at 0.19 to 0.50 of the spread. A relay adding noise of a
# thousandth of the weights' scale lies at about a hundredth.
NEAR_COPY = 0.05
# Why screening keeps a copy out: one of this round's models, or a remembered one.
COPY, REPLAY = "copy", "replay"
OWN = ""  # the origin of the node's own outcomes in its memory
Remembered = list[tuple[str, torch.Tensor]]  # (whose, sketch) of earlier rounds


class Sketcher:
    """A node's sketches of models (see above), drawn from `seed`."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self, state: State) -> torch.Tensor | None:
        """The sketch of `state`'s float tensors (see above; integer buffers are no
        one's work); None for a model without floats. The same positions, signs and sums
        for every model of one layout."""
        floats = [(key, state[key].detach()) for key in sorted(state)]
        floats = [(key, tensor) for key, tensor in floats if tensor.is_floating_point()]
        if not floats:
            return None
        layout = tuple((key, tensor.numel()) for key, tensor in floats)
        sums = torch.zeros(SKETCH_SIZE, dtype=torch.float64)
        for (_, tensor), reads in zip(floats, _reads(self.seed, layout), strict=True):
            values = tensor.reshape(-1)[reads.positions].double()
            sums.index_add_(0, reads.buckets, values * reads.weighted_signs)
        return sums


class _Reads(NamedTuple):
    """One tensor's reads in a sketch: where each is read, the sum it goes to, and its
    sign times its weight (the floats each read stands for, size / reads, square-rooted)."""

    positions: torch.Tensor
    buckets: torch.Tensor
    weighted_signs: torch.Tensor


# Kept per node and layout, outside the rule (a rule holds no state but its own): the
# same for every model, and drawn for each one they were most of a sketch's time. About
# 66 kB each, for a few hundred nodes to a process.
@functools.lru_cache(maxsize=1024)
def _reads(seed: int, layout: tuple[tuple[str, int], ...]) -> tuple[_Reads, ...]:
    """Where each tensor of `layout` is read, into which sum, with which sign and weight:
    about SAMPLED reads in all, at least MIN_SAMPLED of each tensor."""
    total = sum(size for _, size in layout)
    draws = []
    for key, size in layout:
        reads = min(size, max(MIN_SAMPLED, round(SAMPLED * size / total)))
        generator = torch.Generator().manual_seed(draw_seed(seed, key, size, "sketch"))
        positions = (
            torch.arange(size)
            if reads == size
            else torch.randint(size, (reads,), generator=generator)
        )
        buckets = torch.randint(SKETCH_SIZE, (reads,), generator=generator)
        signs = torch.randint(2, (reads,), generator=generator).double() * 2 - 1
        draws.append(_Reads(positions.int(), buckets.int(), signs * math.sqrt(size / reads)))
    return tuple(draws)


def spread(reference: torch.Tensor, sketches: Mapping[str, torch.Tensor]) -> float:
    """The lower median distance of the round's models from `reference` (0 without any)."""
    distances = [float(torch.dist(reference, sketch)) for sketch in sketches.values()]
    return statistics.median_low(distances) if distances else 0.0


def near_pairs(
    sketches: Mapping[str, torch.Tensor], remembered: Remembered, scale: float
) -> dict[str, tuple[str, float]]:
    """For each peer, its nearest other model, as ("replay", share) for a remembered one
    or ("copy", share) for another of this round's, share being their distance over
    `scale`; a tie goes to the replay. Bit-for-bit copies are at share 0 at any scale. A
    peer's own earlier models count only bit for bit: a node whose model has settled
    (skewed shards, late rounds) moves less in a round than nodes lie apart, and it is
    still its own work."""
    nearest: dict[str, tuple[str, float]] = {}

    def note(peer: str, why: str, distance: float) -> None:
        share = 0.0 if distance == 0 else distance / scale if scale > 0 else math.inf
        if peer not in nearest or share < nearest[peer][1]:
            nearest[peer] = (why, share)

    peers = sorted(sketches)
    for peer in peers:
        for origin, old in remembered:
            distance = float(torch.dist(sketches[peer], old))
            if origin != peer or distance == 0:
                note(peer, REPLAY, distance)
    for i, peer in enumerate(peers):
        for other in peers[i + 1 :]:
            distance = float(torch.dist(sketches[peer], sketches[other]))
            note(peer, COPY, distance)
            note(other, COPY, distance)
    return nearest


def copies(nearest: Mapping[str, tuple[str, float]]) -> dict[str, str]:
    """{peer: "copy" or "replay"} for the peers whose nearest model lies within NEAR_COPY
    of the scale (`near_pairs`)."""
    return {peer: why for peer, (why, share) in nearest.items() if share <= NEAR_COPY}


def nearest_share(
    nearest: Mapping[str, tuple[str, float]], kept_out: Collection[str]
) -> float | None:
    """How near the nearest peer not kept out came to being called a copy (None
    without one): what NEAR_COPY was chosen by."""
    shares = [share for peer, (_, share) in nearest.items() if peer not in kept_out]
    return min(shares) if shares else None


class Memory:
    """The sketches of the models received or adopted in the last MEMORY_ROUNDS rounds,
    by whose they were (OWN: the node's own outcome). A value: `remember` returns the
    memory with a round's sketches added and leaves this one as it was."""

    def __init__(self, rounds: Mapping[int, Mapping[str, torch.Tensor]] | None = None) -> None:
        self.rounds: Mapping[int, Mapping[str, torch.Tensor]] = dict(rounds or {})

    def before(self, round_no: int) -> Remembered:
        """Sketches of earlier rounds only: a step the node re-runs (node/containment.py)
        must not find this round's own models there."""
        return [
            (origin, sketch)
            for seen, sketches in self.rounds.items()
            if seen < round_no
            for origin, sketch in sketches.items()
        ]

    def remember(self, round_no: int, sketches: Mapping[str, torch.Tensor]) -> Memory:
        merged = {**self.rounds, round_no: {**self.rounds.get(round_no, {}), **sketches}}
        return Memory({r: kept for r, kept in merged.items() if r > round_no - MEMORY_ROUNDS})

    def state_dict(self) -> dict[int, dict[str, list[float]]]:
        return {
            r: {origin: s.tolist() for origin, s in sketches.items()}
            for r, sketches in self.rounds.items()
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[object, object]) -> Memory:
        """What `state_dict` wrote; a checkpoint of an older version (digests, not
        sketches) gives an empty memory."""
        return cls(
            {
                int(str(round_no)): {
                    str(origin): torch.tensor(s, dtype=torch.float64)
                    for origin, s in sketches.items()
                }
                for round_no, sketches in state.items()
                if isinstance(sketches, dict)
                and all(isinstance(s, list) and len(s) == SKETCH_SIZE for s in sketches.values())
            }
        )
