"""A node's neighbours between rounds: in a full mesh its members, kept as they are
(`MeshKeeper`); in a bounded one (WIRE.md 7.7) the view it refills and drops from
(`ViewKeeper`), as follows.

Each round a node rates the neighbours it began the round with by what they did for it
(the rule's `benefits`: screening's evidence records, which add up over rounds, or else
the rule's own weights); a neighbour whose model the rule did not take in, and whose
record shows no help, did nothing this round. One with a record of help is kept though
the rule passed it over this round (pFedSV downloads only its top k): on a label skew
without clusters most neighbours help a little, and each drop hands a round to a
newcomer not yet measured. A neighbour whose model screening kept out as a copy of
another's did nothing this round, whatever its record: an identity that relays others'
models earns credit where a node cannot see the source, and would keep it while caught
copying. The node drops every neighbour it shuns (a record of clear harm that repeats,
or a rule's own verdict), and when its view is full and it shuns none: every one
caught copying and one that did nothing, or two while fewer than half of its view has
helped it (the worst records first: an attacker that did clear harm once goes before an
honest peer that was late), else, in one round
of EXPLORE_EVERY (drawn at random), the one that did least. The endpoint then greets
as many candidates from its passive view, so exploring never stops: a node recovers
from a bad start, and newcomers get tried (PENS, Onoszko et al. 2021). With `random`
a random neighbour is dropped instead: gossip learning, the baseline to beat: nothing
is shunned, and candidates are drawn at random. A view chosen by benefit that holds
more neighbours than its places (greeters past them) learns from its places' worth of
them, the best records first (`learning_from`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from meshfl.algorithms import PeerAlgorithm
from meshfl.algorithms.base import draw_seed
from meshfl.algorithms.copies import COPY, REPLAY
from meshfl.protocol.endpoint import Endpoint

from .config import MeshConfig

# Neighbours that did nothing dropped after a round: one, as a random view drops one, once
# at least half of the view has a record of help; two while fewer have (a view still
# searching). Two always (with one round's harm shunned) made a node of the 100-node
# Dirichlet(0.1) table meet 4.6 new neighbours a round against 1.9 at random, for 1.2x
# random's time; one always cost that table's FedC2I 0.5 points against random views,
# all of it on nodes with little data, and so did searching only in a view's first
# rounds, or every other round. Against one always, alternated, the second drop showed
# no cost in time that two cores can measure (docs/big-meshes.md).
# Those shunned, and those caught copying, go at once, however many: with the copies
# among the one a round, Sybils relaying honest models held 0.32 of the honest places
# from ten networks, against 0.22 (docs/defences.md).
MOST_DROPPED = 1
MOST_DROPPED_SEARCHING = 2
# How long a round of a bounded mesh waits for the candidates it greeted for free places,
# in heartbeat periods. In a crowded mesh half the answers to a hello turn the greeter
# away (their views full) with others to greet, so a place takes two or three round
# trips to fill; with one period, a few views of the fault bench began every round short
# (docs/measurements.md, "When a fifth of the nodes die at once").
VIEW_PATIENCE_BEATS = 3
# A node whose neighbours all help still drops the one that helps least, one round in
# this many: often enough to find better ones, seldom enough to keep good ones.
EXPLORE_EVERY = 3
# A node's anchors: up to ANCHORS neighbours that stayed ANCHOR_ROUNDS rounds or more and
# helped it, the longest-staying first. Its checkpoint keeps them, and a resumed node
# greets them before its other contacts: a restart does not hand its view to whoever
# greets it first (many identities on few machines, docs/defences.md).
ANCHORS = 2
ANCHOR_ROUNDS = 3


def neighbours_to_drop(
    benefit: Mapping[str, float],
    taken_in: Collection[str],
    shunned: Collection[str],
    select: str,
    rng: random.Random,
    explore: bool = True,
    copied: Collection[str] = (),
    late: Collection[str] = (),
) -> list[str]:
    """The neighbours to drop: every one `shunned`, else (when `explore`: the view is
    full) by `select` among the rated ones, given each one's `benefit` (higher is
    better) and whose model the rule `taken_in`: of the others, every one `copied` and
    up to `most_dropped` with no record of help, but those on trial whose models came
    `late` (not judged yet), else now and then the least useful."""
    if shunned or not explore or not benefit:
        return sorted(shunned)
    if select == "random":
        return [rng.choice(sorted(benefit))]
    # Ties (a round that told neighbours apart by nothing) are broken at random.
    ranked = sorted(
        benefit,
        key=lambda peer: (peer in taken_in, peer not in copied, benefit[peer], rng.random()),
    )
    caught = [peer for peer in ranked if peer in copied and peer not in taken_in]
    idle = [
        peer
        for peer in ranked
        if peer not in taken_in
        and peer not in copied
        and not helped(benefit, peer)
        and peer not in late
    ]
    if caught or idle:
        return caught + idle[: most_dropped(benefit, copied)]
    return ranked[:1] if rng.random() < 1 / EXPLORE_EVERY else []


def most_dropped(benefit: Mapping[str, float], copied: Collection[str] = ()) -> int:
    """How many neighbours that did nothing a round drops: MOST_DROPPED_SEARCHING while
    fewer than half of those rated have a record of help (copies' records aside), else
    MOST_DROPPED."""
    helpers = sum(1 for peer in benefit if helped(benefit, peer) and peer not in copied)
    return MOST_DROPPED_SEARCHING if 2 * helpers < len(benefit) else MOST_DROPPED


def helped(benefit: Mapping[str, float], peer: str) -> bool:
    """Whether `peer` has a record of help: its `benefit` (credit less harm) is above
    nothing. A neighbour with none did nothing for the node, however long it stayed."""
    return benefit[peer] > 0


def caught_copying(diagnostics: Mapping[str, Any]) -> set[str]:
    """The peers whose models a round's screening kept out as copies (or replays) of
    another's, from the aggregate's `diagnostics`; none where nothing was screened."""
    screened_out = diagnostics.get("screened_out") or {}
    return {peer for peer, why in screened_out.items() if why in (COPY, REPLAY)}


def keeper_for(
    endpoint: Endpoint, algorithm: PeerAlgorithm, cfg: MeshConfig, name: str
) -> MeshKeeper:
    """The keeper of the neighbours `endpoint`'s overlay gives the node."""
    keeper = ViewKeeper if endpoint.views is not None else MeshKeeper
    return keeper(endpoint, algorithm, cfg, name)


class MeshKeeper:
    """A full mesh's neighbours are its members: the node waits for them as the mesh
    starts (they start together), and keeps, tries, drops and records none."""

    def __init__(
        self, endpoint: Endpoint, algorithm: PeerAlgorithm, cfg: MeshConfig, name: str
    ) -> None:
        self.endpoint = endpoint
        self.algorithm = algorithm
        self.cfg = cfg
        self.name = name

    @property
    def patience(self) -> float:
        """How long a wait for the node's neighbours lasts at most."""
        return self.cfg.round_timeout

    def waits_at_start(self) -> bool:
        """Whether a fresh node waits for its neighbours before its first round."""
        return bool(self.endpoint.alive_peers())

    def refill(self, wait: Callable[[], object]) -> dict[str, float]:
        """Before a round's models: the places freed since the last round filled (`wait`
        waits for them), and the seconds it took, for the round's record."""
        return {}

    def neighbours_now(self) -> dict[str, bytes]:
        """The neighbours a round ends with, by name."""
        return {}

    def learning_from(self, neighbours: Mapping[bytes, str], round_no: int) -> set[bytes]:
        """Of the `neighbours` a round began with (key -> name), those whose models it
        takes in: every one in a full mesh."""
        return set(neighbours)

    def anchors(self) -> list[str]:
        """The names of the node's anchors (see ANCHORS); none in a full mesh."""
        return []

    def drop(
        self,
        round_no: int,
        began_with: Collection[str],
        current: Mapping[str, bytes],
        weights: Mapping[str, float],
        copied: Collection[str] = (),
        arrived: Collection[str] | None = None,
    ) -> list[str]:
        return []

    def record(
        self, began_with: Mapping[bytes, str], ended_with: Collection[str], dropped: list[str]
    ) -> dict[str, Any]:
        """The round record's fields about the view."""
        fields = ("neighbours", "neighbours_at_end", "tried", "past_places", "dropped", "anchors")
        return dict.fromkeys(fields)


class ViewKeeper(MeshKeeper):
    """What a node of a bounded mesh does with its neighbours between rounds: it refills
    its free places, notes whom each round tries, and drops those `neighbours_to_drop`
    names, so that its endpoint greets candidates in their place."""

    def __init__(
        self, endpoint: Endpoint, algorithm: PeerAlgorithm, cfg: MeshConfig, name: str
    ) -> None:
        super().__init__(endpoint, algorithm, cfg, name)
        self._last_neighbours: set[str] = set()  # when the last round began
        self._stayed: dict[str, int] = {}  # neighbour -> rounds in a row it was one
        self._anchors: list[str] = []
        self._weights: dict[str, float] = {}  # the rule's, of the last round
        self._past_places: set[str] = set()  # of this round's neighbours, passed over

    @property
    def patience(self) -> float:
        """Only a few round trips: a place its contacts keep refusing (or whose hello was
        lost) is filled in a later round, not waited for by all."""
        return VIEW_PATIENCE_BEATS * self.cfg.heartbeat_interval

    def waits_at_start(self) -> bool:
        """Always: nodes that start together may turn away every first hello of one of
        them (their views full), and it then greets candidates, whose answers are worth
        the wait."""
        return True

    def refill(self, wait: Callable[[], object]) -> dict[str, float]:
        clock = time.perf_counter()
        wait()
        return {"view_wait": time.perf_counter() - clock}

    def neighbours_now(self) -> dict[str, bytes]:
        return {peer.name: peer.public_key for peer in self.endpoint.alive_peers()}

    def learning_from(self, neighbours: Mapping[bytes, str], round_no: int) -> set[bytes]:
        """Every neighbour, but where a view chosen by benefit begins a round with more
        than its places (greeters past them), as many as its places: the best by
        benefit, and of those level (a newcomer has no record yet) the ones new since
        the last round; ties drawn at random. A contested place goes to the proven before the
        newly arrived: many identities can greet, few can prove help. The rest did
        nothing this round: one without a record of help goes as an idle neighbour
        does, and the view, back at its places, goes on searching (kept, they stalled
        the search and cost the small nodes accuracy: docs/big-meshes.md). Each model
        taken in costs CPU at both ends, and a benefit view took in 8.7 a round against
        a random view's 7.7: it fetches a candidate where a random view keeps a
        neighbour whose record shows harm and skips its model."""
        views = self.endpoint.views
        assert views is not None, "a bounded mesh's keeper"
        self._past_places = set()
        if (
            self.cfg.topology.select != "benefit"
            or len(neighbours) <= views.neighbours
            or self.algorithm.ranks_offers  # a top k of its own (pFedSV) sees every offer
        ):
            return set(neighbours)
        benefit = self.algorithm.benefits(neighbours.values(), self._weights)
        rng = random.Random(draw_seed(self.cfg.seed, self.name, round_no, "learning_from"))
        by_name = sorted(neighbours, key=neighbours.__getitem__)
        ranked = sorted(
            by_name,
            key=lambda key: (
                -benefit[neighbours[key]],
                neighbours[key] in self._last_neighbours,
                rng.random(),
            ),
        )
        self._past_places = {neighbours[key] for key in ranked[views.neighbours :]}
        return set(ranked[: views.neighbours])

    def record(
        self, began_with: Mapping[bytes, str], ended_with: Collection[str], dropped: list[str]
    ) -> dict[str, Any]:
        return {
            "neighbours": sorted(began_with.values()),
            "neighbours_at_end": sorted(ended_with),
            "tried": self.tried(began_with.values()),
            "past_places": sorted(self._past_places),
            "dropped": dropped,
            "anchors": self.anchors(),
        }

    def tried(self, neighbours: Collection[str]) -> list[str]:
        """The neighbours this round tries: those that were not neighbours when the last
        round began (every one, in a node's first round here)."""
        tried = sorted(set(neighbours) - self._last_neighbours)
        self._last_neighbours = set(neighbours)
        return tried

    def anchors(self) -> list[str]:
        return list(self._anchors)

    def drop(
        self,
        round_no: int,
        began_with: Collection[str],
        current: Mapping[str, bytes],
        weights: Mapping[str, float],
        copied: Collection[str] = (),
        arrived: Collection[str] | None = None,
    ) -> list[str]:
        """Drop the neighbours (of `current`, name -> key) the node shuns, and when its
        view is full the neighbours it began the round with that did least for it
        (`topology.select`; those `copied`, kept out as copies, did nothing; a candidate
        on trial whose model had not `arrived` for the rule, which linked late or which
        the rule did not fetch, is judged next round); none after the last round.
        Without a candidate to try instead, only shunned ones are dropped."""
        views = self.endpoint.views
        assert views is not None, "a bounded mesh's keeper"
        if round_no >= self.cfg.rounds:
            return []  # after the last round there is nothing left to explore for
        shunned = {name for name in current if self.endpoint.shuns(name)}
        still = [name for name in began_with if name in current]
        self._stayed = {name: self._stayed.get(name, 0) + 1 for name in still}
        self._weights = dict(weights)
        benefit = self.algorithm.benefits(still, weights)
        explore = len(current) >= views.neighbours and self.endpoint.greetable_candidates() > 0
        rng = random.Random(draw_seed(self.cfg.seed, self.name, round_no, "neighbours"))
        select = self.cfg.topology.select
        on_trial = set(still) - self._last_neighbours
        late = on_trial - set(arrived) if arrived is not None else set()
        dropped = neighbours_to_drop(benefit, weights, shunned, select, rng, explore, copied, late)
        helpful = [
            name
            for name in benefit
            if helped(benefit, name) and name not in dropped and name not in shunned
        ]
        self.endpoint.unlink(
            [current[name] for name in dropped], vouched=[current[name] for name in helpful]
        )
        proven = [name for name in helpful if self._stayed.get(name, 0) >= ANCHOR_ROUNDS]
        self._anchors = sorted(proven, key=lambda name: -self._stayed[name])[:ANCHORS]
        return dropped
