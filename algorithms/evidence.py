"""What a node has learned about each peer's models, added up across rounds.

Screening measures, each round and for each peer, whether mixing the peer's model into
the node's own one hurts the node's validation loss (screening.py, step 4): the
per-sample differences d of val loss, mixed minus own. On a small val split one round's
mean of d is noise as often as signal (30 val samples: one sample moves it by 3 points),
so a verdict on one round either admits harm or shuts out help. A peer's *record*
carries the evidence from round to round instead:

    z   = mean(d) / max(standard error of mean(d), NEGLIGIBLE_LOSS),
          clipped to [-BENEFIT_CLIP, HARM_CLIP]
    s  <- DECAY * s + z                         (s = 0 for a peer never measured)

and the peer is kept out while s > HARM_BOUND. What that gives:

- A peer met for the first time is judged as one round allows: out when its model
  hurts by more than two standard errors (HARM_BOUND): evidence of harm, not a hint.
  An attacker that shows itself (a sign flip, noise, a scaled model: z far above the
  clip) is out the round it shows.
- A peer that has been helping keeps its place through an unlucky round: its record
  stands near -2 * BENEFIT_CLIP, so only a round of z above 3 (or harm that repeats)
  puts it out, where a one-round test would shut it out at z above 2.
- Slight harm that repeats adds up: a steady z settles at 2z, so a peer that hurts by
  more than one standard error round after round is out within a few rounds.
- Good behaviour cannot be banked to cover an attack: benefit is clipped at
  BENEFIT_CLIP, so the best record, -2 * BENEFIT_CLIP, is outweighed by one round of
  clear harm.
- A change too small to matter is no evidence, however consistent: where a node's
  model is already near certain on its val split (one label per node, say), mixing in
  a peer trained on the same label moves every sample's loss by 1e-4 nats in the same
  direction, a hundred standard errors and no harm at all. NEGLIGIBLE_LOSS puts a floor
  under the noise.
- The past fades: a peer whose data or training changes (or that mended its ways) is
  judged mostly by its last few rounds.

A peer whose record shows clear harm that repeats (above PASS_OVER_BOUND, and above
HARM_BOUND before its last round of evidence) is not even downloaded (screening.py): a
round passed over is a round of no evidence, so its record fades, and a few rounds on it
is fetched and measured again. An attacker is back out the round it is measured; a peer
whose data has become useful gets in. One round of clear harm is measured again: in a
mesh's first round every model trained apart hurts the node it is mixed into. Passing
over keeps what screening costs near the paper rule's bytes where most peers do harm
(pFedSV on a pathological split).

The record is part of the node's checkpoint (`state_dict`), so a resumed node does not
admit a peer it had kept out. It is also the node's knowledge of who helps it, which
choosing neighbours by measured benefit will read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

DECAY = 0.5
# One round's z above it puts a peer with no record out: evidence of harm, a one-sided
# test at about 2%, as the guard's (screening.py). At one standard error, one honest peer
# in six was kept out of its first round by noise alone: on small shards (ten seeds)
# screened FedAvg lost 0.6 points to the bound of two on iid ones, 0.8 on Dirichlet(0.3).
HARM_BOUND = 2.0
# Above this (where harm repeats) a peer is not even fetched: only clear harm (an
# attacker, or data of another kind altogether) saves the download; a peer near the
# bound is measured every round, for its next model may help (not fetching those cost
# the small-shard table 0.6 to 1 point).
PASS_OVER_BOUND = 3.0
HARM_CLIP = 4.0
BENEFIT_CLIP = 1.0
NEGLIGIBLE_LOSS = 0.01  # nats per val sample: a mean change below it is not evidence


def harm_z(differences: torch.Tensor, negligible: float = NEGLIGIBLE_LOSS) -> float:
    """One round's evidence from the per-sample loss differences (mixed minus own): their
    mean in standard errors (at least `negligible` each), clipped; anything not finite
    is the worst harm."""
    d = differences.double()
    if len(d) == 0:
        return 0.0
    if not torch.isfinite(d).all():
        return HARM_CLIP
    mean = float(d.mean())
    noise = float(d.std()) / math.sqrt(len(d)) if len(d) > 1 else 0.0
    scale = max(noise, negligible)
    if scale == 0:  # every difference the same: its sign is all the evidence there is
        return HARM_CLIP if mean > 0 else (-BENEFIT_CLIP if mean < 0 else 0.0)
    return min(max(mean / scale, -BENEFIT_CLIP), HARM_CLIP)


def sign_z(differences: torch.Tensor, negligible: float = NEGLIGIBLE_LOSS) -> float:
    """The evidence of the signs alone: how many samples the other model does worse on,
    less how many it does better on, in standard deviations of that count were each a
    coin flip; 0 where the mean difference is not above `negligible` (consistent, but
    too small to matter). The mean's test (`harm_z`) misses a model worse on nearly every
    sample when it is much better on a few: a node's own model confidently wrong on two
    val samples inflates the standard error of the mean differences, and an average of
    models that trained apart, 0.5 nats worse in mean loss and worse on 26 samples of 30,
    passed it at 1.5 standard errors and cost that node 24 test points."""
    d = differences.double()
    if len(d) == 0 or not float(d.mean()) > negligible:
        return 0.0
    return coin_flip_z(int((d > 0).sum()), int((d < 0).sum()))


def coin_flip_z(worse: int, better: int) -> float:
    """How far `worse` exceeds `better`, in standard deviations of worse - better were
    each of the worse + better samples a coin flip; 0 where there are none."""
    return (worse - better) / math.sqrt(worse + better) if worse + better else 0.0


class PeerRecords:
    """Each peer's decayed sum of evidence of harm (positive) or help (negative).

    A value: `observe`, `convict` and `pass_over` return the records with one more
    round's evidence and leave these as they were, so that a step the node runs only to
    see its outcome (node/containment.py, a trial) changes no record it rewinds."""

    def __init__(self, by_peer: Mapping[str, tuple[int, float, float]] | None = None) -> None:
        # peer -> (round of its last measurement, score before it, score after it): a
        # round measured again (a step the node re-runs) replaces that round's evidence.
        self._records: Mapping[str, tuple[int, float, float]] = dict(by_peer or {})

    def observe(self, peer: str, round_no: int, differences: torch.Tensor) -> PeerRecords:
        """With round `round_no`'s measurement of `peer` (per-sample val loss differences,
        its model mixed in minus the own model alone)."""
        return self._add(peer, round_no, harm_z(differences))

    def convict(self, peer: str, round_no: int) -> PeerRecords:
        """With `peer`'s model of round `round_no` found no model of the task
        (screening.py's distance check): the worst one round's evidence can say, as a
        clipped z."""
        return self._add(peer, round_no, HARM_CLIP)

    def pass_over(self, peer: str, round_no: int) -> PeerRecords:
        """With `peer` kept out unmeasured in round `round_no` (its model not even
        fetched): its record fades as after a round of no evidence, so that it is
        measured again a few rounds on, and stays out only if it still does harm."""
        return self._add(peer, round_no, 0.0)

    def _add(self, peer: str, round_no: int, z: float) -> PeerRecords:
        last_round, before, after = self._records.get(peer, (0, 0.0, 0.0))
        base = before if last_round == round_no else after
        return PeerRecords({**self._records, peer: (round_no, base, DECAY * base + z)})

    def score(self, peer: str) -> float:
        """The evidence so far: above HARM_BOUND the peer is kept out; 0 when unmeasured."""
        return self._records[peer][2] if peer in self._records else 0.0

    def harmful(self, peer: str) -> bool:
        return self.score(peer) > HARM_BOUND

    def not_worth_fetching(self, peer: str) -> bool:
        """Whether the record shows clear harm that repeats, so that the peer's next
        model is not even fetched (see `pass_over`): above PASS_OVER_BOUND, and above
        HARM_BOUND before its last round of evidence. One round of harm, however clear,
        is measured again: in a mesh's first round every model trained apart hurts a
        node it is mixed into, and the next may help (passing such peers over the round
        after cost screened FedAvg 1.4 points on MNIST Dirichlet(1), docs/defences.md)."""
        if peer not in self._records:
            return False
        _, before, after = self._records[peer]
        return after > PASS_OVER_BOUND and before > HARM_BOUND

    def state_dict(self) -> dict[str, list[float]]:
        return {peer: list(self._records[peer]) for peer in sorted(self._records)}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> PeerRecords:
        return cls(
            {
                str(peer): (int(last_round), float(before), float(after))
                for peer, (last_round, before, after) in state.items()
            }
        )
