"""Whom a node of a bounded mesh drops after a round (node/neighbours.py)."""

from __future__ import annotations

import random

import torch

from meshfl.node.config import MeshConfig, apply_overrides
from meshfl.node.neighbours import (
    EXPLORE_EVERY,
    MOST_DROPPED,
    MOST_DROPPED_SEARCHING,
    MeshKeeper,
    ViewKeeper,
    caught_copying,
    neighbours_to_drop,
)
from meshfl.node.runtime import Node
from meshfl.protocol.views import ViewSettings
from tests.nodes import node_from


def test_benefit_now_and_then_drops_the_neighbour_that_did_least():
    benefit = {"a": 0.5, "b": -0.2, "c": 1.0}
    drops = [
        neighbours_to_drop(benefit, benefit, set(), "benefit", random.Random(s)) for s in range(300)
    ]
    assert {tuple(dropped) for dropped in drops} == {(), ("b",)}
    assert abs(sum(bool(dropped) for dropped in drops) / 300 - 1 / EXPLORE_EVERY) < 0.1


def test_every_shunned_neighbour_is_dropped_and_none_besides():
    benefit = {"a": 0.5, "b": -3.5, "c": -5.0}
    dropped = neighbours_to_drop(benefit, benefit, {"b", "c", "x"}, "benefit", random.Random(0))
    assert dropped == ["b", "c", "x"]  # x: linked during the round, shunned already


def test_neighbours_that_did_nothing_go_first_a_few_at_a_time():
    benefit = {"a": 0.5, "b": 0.2, "c": 0.0, "d": 0.0}  # half of the view has helped
    drops = [
        neighbours_to_drop(benefit, {"a", "b"}, set(), "benefit", random.Random(seed))
        for seed in range(20)
    ]
    assert all(len(dropped) == MOST_DROPPED and {*dropped} <= {"c", "d"} for dropped in drops)
    assert {peer for dropped in drops for peer in dropped} == {"c", "d"}, "ties drawn"


def test_a_view_where_fewer_than_half_have_helped_drops_more_that_did_nothing():
    # On a skew where most peers help a little, a view still searching tries more
    # candidates; a neighbour taken in this round is not idle, whatever its record.
    searching = {"a": 0.5, "b": -0.9, "c": 0.0, "d": -0.1, "e": -0.4}
    for seed in range(20):
        dropped = neighbours_to_drop(searching, {"a", "b"}, set(), "benefit", random.Random(seed))
        assert dropped == ["e", "d", "c"][:MOST_DROPPED_SEARCHING]
    assert MOST_DROPPED_SEARCHING > MOST_DROPPED
    # A relay's record is not help: caught copying, it leaves the view searching.
    relayed = {"a": 0.5, "relay": 1.5, "c": 0.0, "d": -0.1}
    dropped = neighbours_to_drop(
        relayed, {"a"}, set(), "benefit", random.Random(0), copied={"relay"}
    )
    assert dropped == ["relay", "d", "c"][: 1 + MOST_DROPPED_SEARCHING]


def test_a_neighbour_with_a_record_of_help_is_kept_when_the_rule_passed_it_over():
    # pFedSV took only a and b this round; c helped in earlier rounds, d never did.
    benefit = {"a": 0.5, "b": 0.2, "c": 1.5, "d": 0.0}
    for seed in range(20):
        dropped = neighbours_to_drop(benefit, {"a", "b"}, set(), "benefit", random.Random(seed))
        assert dropped == ["d"]


def test_a_neighbour_caught_copying_did_nothing_whatever_its_record():
    # The relay earned credit where its source was out of sight; caught copying now, it
    # goes before the idle peer with the worse record, and the helper stays.
    benefit = {"helper": 0.5, "relay": 1.5, "idle": -0.3, "other": 0.8}
    for seed in range(20):
        dropped = neighbours_to_drop(
            benefit, {"helper", "other"}, set(), "benefit", random.Random(seed), copied={"relay"}
        )
        assert dropped == ["relay", "idle"]


def test_every_neighbour_caught_copying_goes_with_those_that_did_nothing():
    # Identities relaying others' models hold places until dropped: all go at once, and
    # their records of help do not count, so the view searches.
    benefit = {"helper": 0.5, "r1": 1.0, "r2": 0.2, "r3": -0.1, "idle": -0.3, "other": 0.0}
    for seed in range(20):
        dropped = neighbours_to_drop(
            benefit, {"helper"}, set(), "benefit", random.Random(seed), copied={"r1", "r2", "r3"}
        )
        assert sorted(dropped[:3]) == ["r1", "r2", "r3"]
        assert dropped[3:] == ["idle", "other"][:MOST_DROPPED_SEARCHING]


def test_a_neighbour_on_trial_whose_model_came_late_is_judged_next_round():
    # The round did not wait for the newcomer: unjudged, it is not idle; a copy still is.
    benefit = {"a": 0.5, "new": 0.0, "idle": 0.0, "relay": 0.0}
    for seed in range(20):
        dropped = neighbours_to_drop(
            benefit,
            {"a"},
            set(),
            "benefit",
            random.Random(seed),
            late={"new", "relay"},
            copied={"relay"},
        )
        assert dropped == ["relay", "idle"]
        no_copy = {"a": 0.5, "new": 0.0, "idle": 0.0}
        rng = random.Random(seed)
        assert neighbours_to_drop(no_copy, {"a"}, set(), "benefit", rng, late={"new"}) == ["idle"]


class _Endpoint:
    """What a keeper asks of its endpoint, and the last drop it was told of."""

    views = ViewSettings.keeping(2)

    def __init__(self) -> None:
        self.dropped: list[bytes] = []
        self.vouched: list[bytes] = []

    def shuns(self, name: str) -> bool:
        return name == "bad"

    def greetable_candidates(self) -> int:
        return 4

    def unlink(self, keys, vouched=()):
        self.dropped, self.vouched = list(keys), list(vouched)


class _Rule:
    ranks_offers = False

    def benefits(self, peers, weights):
        return {peer: weights.get(peer, 0.0) for peer in peers}


def _keeper() -> ViewKeeper:
    cfg = apply_overrides(MeshConfig(), ["rounds=100", "topology.neighbours=2"])
    return ViewKeeper(_Endpoint(), _Rule(), cfg, "me")


def test_a_node_tells_its_endpoint_whom_it_found_helpful():
    keeper = _keeper()
    current = {"good": b"G", "zero": b"Z", "bad": b"B"}
    keeper.drop(1, list(current), current, {"good": 0.7, "zero": 0.0, "bad": 0.9})
    assert keeper.endpoint.vouched == [b"G"]  # not the idle one, nor the one it shuns


def test_a_newcomer_whose_model_the_rule_did_not_get_is_kept_for_its_next_round():
    # Its model came and did nothing: dropped every round. It did not come: dropped only
    # when the round explores (the least useful, now and then), as anyone would be.
    current = {"good": b"G", "new": b"N"}

    def drops(arrived: list[str]) -> int:
        dropped = 0
        for round_no in range(1, 31):
            keeper = _keeper()
            keeper.drop(round_no, list(current), current, {"good": 0.7}, arrived=arrived)
            dropped += keeper.endpoint.dropped == [b"N"]
        return dropped

    assert drops(["good", "new"]) == 30
    assert drops(["good"]) <= 30 * (1 / EXPLORE_EVERY + 0.2)


def test_a_view_past_its_places_learns_from_its_best_then_from_its_newcomers():
    keeper = _keeper()  # two places; without screening, the rule's weights rate them
    keys = {b"G": "good", b"F": "fair", b"B": "bad"}
    current = {name: key for key, name in keys.items()}
    assert len(keeper.learning_from(keys, 1)) == 2
    keeper.drop(1, list(current), current, {"good": 0.9, "fair": 0.2, "bad": -0.5})
    keeper.record(keys, current, [])
    assert keeper.learning_from(keys, 2) == {b"G", b"F"}
    with_new = {**keys, b"N": "new"}
    assert keeper.learning_from(with_new, 2) == {b"G", b"F"}, "the proven first"
    keeper.drop(2, list(current), current, {"good": 0.9, "fair": 0.0, "bad": -0.5})
    keeper.record(keys, current, [])
    assert keeper.learning_from(with_new, 3) == {b"G", b"N"}, "of those level, the new"
    assert keeper.learning_from({b"G": "good", b"B": "bad"}, 3) == {b"G", b"B"}, "not past"


def test_a_neighbour_past_the_places_without_a_record_of_help_goes_as_idle():
    # Two places, three neighbours; the one that did nothing when last taken in is
    # passed over, did nothing again, and goes: the view comes back to its places.
    keeper = _keeper()
    current = {"good": b"G", "fair": b"F", "least": b"L"}
    keys = {key: name for name, key in current.items()}
    keeper.drop(1, list(current), current, {"good": 0.5, "fair": 0.3, "least": 0.0})
    keeper.record(keys, current, [])  # as a round's record does: no newcomer from now on
    assert keeper.learning_from(keys, 2) == {b"G", b"F"}
    assert keeper.record(keys, current, [])["past_places"] == ["least"]
    weights = {"good": 0.5, "fair": 0.3}
    assert keeper.drop(2, list(current), current, weights, arrived=list(weights)) == ["least"]


def test_random_views_full_meshes_and_top_k_rules_learn_from_every_neighbour():
    keys = {b"G": "good", b"F": "fair", b"N": "new"}
    keeper = _keeper()
    keeper.cfg = apply_overrides(keeper.cfg, ["topology.select=random"])
    assert keeper.learning_from(keys, 2) == set(keys)
    keeper = _keeper()
    keeper.algorithm.ranks_offers = True
    assert keeper.learning_from(keys, 2) == set(keys)
    mesh = MeshKeeper(_Endpoint(), _Rule(), keeper.cfg, "me")
    assert mesh.learning_from(keys, 2) == set(keys)


def test_the_copies_a_round_caught_are_read_from_its_screening():
    diagnostics = {"screened_out": {"a": "copy", "b": "replay", "c": "val_loss"}}
    assert caught_copying(diagnostics) == {"a", "b"}
    assert caught_copying({}) == set()  # a rule without screening


def test_of_those_that_did_nothing_the_worst_record_goes_first():
    # Round 1: nobody taken in; the attacker's first measurement fell short of a shun.
    benefit = {"honest": -0.3, "late": 0.0, "attacker": -2.9, "other": 0.8}
    for seed in range(20):
        dropped = neighbours_to_drop(benefit, (), set(), "benefit", random.Random(seed))
        assert dropped == ["attacker", "honest", "late"][:MOST_DROPPED_SEARCHING]


def test_a_view_not_full_drops_only_shunned_neighbours():
    benefit = {"a": 0.5, "b": -0.2, "c": -4.0}
    assert (
        neighbours_to_drop(benefit, benefit, set(), "benefit", random.Random(0), explore=False)
        == []
    )
    assert neighbours_to_drop(
        benefit, benefit, {"c"}, "random", random.Random(0), explore=False
    ) == ["c"]


def test_ties_are_broken_at_random_not_by_name():
    benefit = {name: 0.0 for name in "abcdef"}
    drawn = {
        neighbours_to_drop(benefit, (), set(), "benefit", random.Random(s))[0] for s in range(40)
    }
    assert len(drawn) > 3


def test_random_drops_one_whatever_the_benefit():
    benefit = {"a": 9.0, "b": -9.0, "c": 0.0}
    drawn = {
        neighbours_to_drop(benefit, benefit, set(), "random", random.Random(s))[0]
        for s in range(40)
    }
    assert drawn == {"a", "b", "c"}


def test_nobody_rated_nobody_dropped():
    assert neighbours_to_drop({}, (), set(), "benefit", random.Random(0)) == []


def test_a_restarted_node_keeps_out_the_machines_it_kept_out(tmp_path):
    """The machines of dropped neighbours a node keeps out (protocol/overlay.py) go
    into its checkpoint, those still kept out when its next round begins, and a
    resumed node takes them back to hand to its endpoint."""

    class Endpoint:  # what saving and resuming ask of it: a full mesh's keeper, no peers
        views = None
        asked: int | None = None

        def peers(self) -> list:
            return []

        def dropped_machines(self, in_round: int) -> dict[str, int]:
            self.asked = in_round
            return {"203.0.113.5/32": 4}

    class Rule:
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    class Metrics:
        def keep_until(self, round_no: int) -> None:
            pass

    def node(endpoint: Endpoint) -> Node:
        parts = {"model": torch.nn.Linear(2, 1), "algorithm": Rule(), "metrics": Metrics()}
        return node_from(endpoint=endpoint, checkpoint_path=tmp_path / "checkpoint.pt", **parts)

    before = Endpoint()
    node(before)._save(5)
    assert before.asked == 6
    resumed = node(Endpoint())
    assert resumed._resume() == 6
    assert resumed._dropped_machines == {"203.0.113.5/32": 4}
