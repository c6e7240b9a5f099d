"""Whom a node of a bounded mesh drops from its neighbours after a round (WIRE.md 7.7).

Each round a node rates the neighbours it began the round with by what they did for it
(the rule's `benefits`: screening's evidence records, which add up over rounds, or else
the rule's own weights); a neighbour whose model the rule did not take in, and whose
record shows no help, did nothing this round. One with a record of help is kept though
the rule passed it over this round (pFedSV downloads only its top k): on a label skew
without clusters most neighbours help a little, and each drop hands a round to a
newcomer not yet measured. The node drops every neighbour it shuns (a record of clear
harm, or a rule's own verdict), and when its view is full and it shuns none: two that
did nothing (those with the worst record first: an attacker whose first measurement
fell short of clear harm goes before an honest peer that was late), else, in one round
of EXPLORE_EVERY (drawn at random), the one that did least. The endpoint then greets
as many candidates from its passive view, so exploring never stops: a node recovers
from a bad start, and newcomers get tried (PENS, Onoszko et al. 2021). With `random`
a random neighbour is dropped instead: gossip learning, the baseline to beat: nothing
is shunned, and candidates are drawn at random.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping

from meshfl.algorithms import PeerAlgorithm
from meshfl.algorithms.base import draw_seed
from meshfl.protocol.endpoint import Endpoint

from .config import MeshConfig

MOST_DROPPED = 2  # neighbours that did nothing dropped after one round
# A node whose neighbours all help still drops the one that helps least, one round in
# this many: often enough to find better ones, seldom enough to keep good ones.
EXPLORE_EVERY = 3


def neighbours_to_drop(
    benefit: Mapping[str, float],
    taken_in: Collection[str],
    shunned: Collection[str],
    select: str,
    rng: random.Random,
    explore: bool = True,
) -> list[str]:
    """The neighbours to drop: every one `shunned`, else (when `explore`: the view is
    full) by `select` among the rated ones, given each one's `benefit` (higher is
    better) and whose model the rule `taken_in`: up to MOST_DROPPED of the others with
    no record of help, else now and then the least useful."""
    if shunned or not explore or not benefit:
        return sorted(shunned)
    if select == "random":
        return [rng.choice(sorted(benefit))]
    # Ties (a round that told neighbours apart by nothing) are broken at random.
    ranked = sorted(benefit, key=lambda peer: (peer in taken_in, benefit[peer], rng.random()))
    idle = [peer for peer in ranked if peer not in taken_in and benefit[peer] <= 0]
    if idle:
        return idle[:MOST_DROPPED]
    return ranked[:1] if rng.random() < 1 / EXPLORE_EVERY else []


class ViewKeeper:
    """What a node of a bounded mesh does with its neighbours between rounds: it notes
    whom each round tries, and drops those `neighbours_to_drop` names, so that its
    endpoint greets candidates in their place."""

    def __init__(
        self, endpoint: Endpoint, algorithm: PeerAlgorithm, cfg: MeshConfig, name: str
    ) -> None:
        self.endpoint = endpoint
        self.algorithm = algorithm
        self.cfg = cfg
        self.name = name
        self._last_neighbours: set[str] = set()  # when the last round began

    def tried(self, neighbours: Collection[str]) -> list[str]:
        """The neighbours this round tries: those that were not neighbours when the last
        round began (every one, in a node's first round here)."""
        tried = sorted(set(neighbours) - self._last_neighbours)
        self._last_neighbours = set(neighbours)
        return tried

    def drop(
        self,
        round_no: int,
        began_with: Collection[str],
        current: Mapping[str, bytes],
        weights: Mapping[str, float],
    ) -> list[str]:
        """Drop the neighbours (of `current`, name -> key) the node shuns, and when its
        view is full the neighbour it began the round with that did least for it
        (`topology.select`); none in a full mesh or after the last round. Without a
        candidate to try instead, only shunned ones are dropped."""
        views = self.endpoint.views
        if views is None or round_no >= self.cfg.rounds:
            return []  # after the last round there is nothing left to explore for
        shunned = {name for name in current if self.endpoint.shuns(name)}
        still = [name for name in began_with if name in current]
        benefit = self.algorithm.benefits(still, weights)
        explore = len(current) >= views.neighbours and self.endpoint.passive_size() > 0
        rng = random.Random(draw_seed(self.cfg.seed, self.name, round_no, "neighbours"))
        select = self.cfg.topology.select
        dropped = neighbours_to_drop(benefit, weights, shunned, select, rng, explore)
        for name in dropped:
            self.endpoint.unlink(current[name])
        return dropped
