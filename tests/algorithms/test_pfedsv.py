"""pFedSV's math against brute force, and the rule driven by hand without a network."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from meshfl.algorithms import Context, PeerModel, parse_params
from meshfl.algorithms.base import MODEL
from meshfl.algorithms.pfedsv import (
    PFedSV,
    PFedSVParams,
    _guard_verdict,
    accuracy,
    batched_logits,
    cached_utility,
    clip_and_noise,
    dynamic_k,
    exact_shapley,
    monte_carlo_shapley,
    positive_peers,
    scores_settled,
    select_top_k,
    shapley_values,
    shapley_weights,
    uniform_average,
)
from tests.algorithms.config_lines import params_error


def permutation_shapley(players, utility):
    """Eq. 2 literally: the mean marginal contribution over all |N|! orders."""
    totals = dict.fromkeys(players, 0.0)
    orders = list(itertools.permutations(players))
    for order in orders:
        for position, player in enumerate(order):
            before = frozenset(order[:position])
            totals[player] += utility(before | {player}) - utility(before)
    return {player: total / len(orders) for player, total in totals.items()}


def table_game(players, seed):
    """A game with an arbitrary value for every coalition (v(∅) included)."""
    rng = np.random.default_rng(seed)
    values = {
        frozenset(subset): float(rng.normal())
        for size in range(len(players) + 1)
        for subset in itertools.combinations(players, size)
    }
    return values.__getitem__


def glove_game(coalition):
    """One left glove (L) and two right gloves: a pair is worth 1."""
    return float("L" in coalition and bool({"R1", "R2"} & coalition))


def label_game(players, target=(0, 1)):
    """Accuracy-like: a coalition scores the share of the target labels its relevant
    members hold, diluted by the share of irrelevant members in its average."""
    holdings = {player: {index % 5, (index + 2) % 5} for index, player in enumerate(players)}

    def value(coalition):
        if not coalition:
            return 0.0
        relevant = [p for p in coalition if holdings[p] & set(target)]
        covered = set().union(*(holdings[p] for p in relevant)) & set(target) if relevant else set()
        return len(covered) / len(target) * (len(relevant) / len(coalition)) ** 0.5

    return value


# --------------------------------------------------------------------------- exact Shapley


def test_exact_shapley_of_the_glove_game_is_the_textbook_answer():
    values = exact_shapley(["L", "R1", "R2"], glove_game)
    assert values == pytest.approx({"L": 2 / 3, "R1": 1 / 6, "R2": 1 / 6})


@pytest.mark.parametrize("size", [1, 2, 4, 6])
def test_exact_shapley_equals_enumeration_of_all_orders(size):
    players = [f"p{i}" for i in range(size)]
    game = table_game(players, seed=size)
    assert exact_shapley(players, game) == pytest.approx(permutation_shapley(players, game))


@pytest.mark.parametrize("seed", range(5))
def test_shapley_values_sum_to_the_grand_coalition_minus_the_empty_one(seed):
    players = [f"p{i}" for i in range(5)]
    game = table_game(players, seed)
    total = sum(exact_shapley(players, game).values())
    assert total == pytest.approx(game(frozenset(players)) - game(frozenset()))
    # The coalition game of pFedSV fixes v(∅) = 0, so its values share out v(S).
    assert sum(exact_shapley(players, cached_utility(game)).values()) == pytest.approx(
        game(frozenset(players))
    )


def test_interchangeable_players_get_equal_values_and_a_null_player_gets_zero():
    base = label_game([f"p{i}" for i in range(4)])

    def game(coalition):  # "twin" copies p1 exactly; "null" never changes anything
        as_base = frozenset("p1" if p == "twin" else p for p in coalition if p != "null")
        return base(as_base) if as_base else 0.0

    players = ["p0", "p1", "twin", "p2", "null"]
    values = exact_shapley(players, game)
    assert values["p1"] == pytest.approx(values["twin"])
    assert values["null"] == pytest.approx(0.0, abs=1e-12)


def test_cached_utility_evaluates_each_coalition_once_and_fixes_the_empty_one_at_zero():
    calls = []

    def game(coalition):
        calls.append(coalition)
        return 5.0

    value = cached_utility(game)
    exact_shapley(["a", "b", "c"], value)
    assert value(frozenset()) == 0.0
    assert len(calls) == len(set(calls)) == 7, "every non-empty subset exactly once"


# --------------------------------------------------------------------------- Monte Carlo


def test_monte_carlo_with_three_orders_per_player_is_within_five_points_of_exact():
    players = [f"p{i}" for i in range(10)]
    game = cached_utility(label_game(players))
    exact = exact_shapley(players, game)
    errors, estimates = [], []
    for seed in range(20):
        estimate = monte_carlo_shapley(players, game, 3 * len(players), np.random.default_rng(seed))
        errors.append(np.mean([abs(estimate[p] - exact[p]) for p in players]))
        estimates.append(estimate)
    assert np.mean(errors) <= 0.05
    # Unbiased: the mean over seeds is closer still.
    mean_estimate = {p: np.mean([e[p] for e in estimates]) for p in players}
    assert max(abs(mean_estimate[p] - exact[p]) for p in players) <= 0.03
    # Every single estimate is efficient: each order distributes v(S) exactly.
    assert sum(estimates[0].values()) == pytest.approx(game(frozenset(players)))


def test_monte_carlo_is_reproducible_from_its_seed():
    players = [f"p{i}" for i in range(6)]
    game = label_game(players)
    first = monte_carlo_shapley(players, game, 18, np.random.default_rng(3))
    assert first == monte_carlo_shapley(players, game, 18, np.random.default_rng(3))


def test_shapley_values_is_exact_up_to_eight_players_and_samples_three_orders_per_player_above():
    eight = [f"p{i}" for i in range(8)]
    game = label_game(eight)
    assert shapley_values(eight, game, np.random.default_rng(0)) == pytest.approx(
        exact_shapley(eight, game)
    )
    nine = [f"p{i}" for i in range(9)]
    game = label_game(nine)
    sampled = shapley_values(nine, game, np.random.default_rng(1))
    assert sampled == monte_carlo_shapley(nine, game, 27, np.random.default_rng(1))


# --------------------------------------------------------------------------- weights


def test_weights_divide_positive_values_by_distance_and_self_takes_the_nearest_peers():
    shapley = {"me": 0.3, "a": 0.2, "b": -0.1, "c": 0.1}
    distances = {"a": 2.0, "b": 1.0, "c": 0.5}  # b counts for self's distance though negative
    # raw: me 0.3/0.5 = 0.6, a 0.1, c 0.2; b is dropped
    assert shapley_weights(shapley, "me", distances) == pytest.approx(
        {"me": 0.6 / 0.9, "a": 0.1 / 0.9, "c": 0.2 / 0.9}
    )


def test_weights_without_distance_are_the_positive_values_normalized():
    shapley = {"me": 0.3, "a": 0.2, "b": -0.1, "c": 0.1}
    assert shapley_weights(shapley, "me") == pytest.approx({"me": 0.5, "a": 1 / 3, "c": 1 / 6})


def test_no_positive_value_gives_no_weights_and_a_zero_distance_wins_without_error():
    assert shapley_weights({"me": 0.0, "a": -0.2}, "me", {"a": 1.0}) == {}
    weights = shapley_weights({"me": 0.1, "a": 0.1, "b": 0.1}, "me", {"a": 0.0, "b": 1.0})
    assert sum(weights.values()) == pytest.approx(1.0)
    assert weights["b"] < 1e-9, "identical models (me, a) take all the weight"


def test_a_lone_node_keeps_all_the_weight():
    assert shapley_weights({"me": 0.8}, "me", {}) == {"me": 1.0}


# --------------------------------------------------------------------------- top-k and k


def test_top_k_ranks_positive_then_unscored_then_negative():
    scores = {"good": 0.4, "ok": 0.1, "bad": -0.2, "worse": -0.5}
    candidates = ["bad", "good", "new1", "ok", "worse", "new2"]
    for seed in range(20):
        chosen = select_top_k(scores, candidates, 4, np.random.default_rng(seed))
        assert chosen[:2] == ["good", "ok"]
        assert set(chosen[2:]) == {"new1", "new2"}
    assert select_top_k(scores, candidates, 5, np.random.default_rng(0))[-1] == "bad"


def test_ties_are_broken_at_random_but_reproducibly_and_independent_of_input_order():
    candidates = [f"p{i}" for i in range(6)]
    picks = [
        tuple(select_top_k({}, candidates, 2, np.random.default_rng(seed))) for seed in range(300)
    ]
    counts = {p: sum(p in pick for pick in picks) for p in candidates}
    assert all(60 <= count <= 140 for count in counts.values()), counts  # 100 expected each
    assert len(set(picks)) > 10
    again = select_top_k({}, list(reversed(candidates)), 2, np.random.default_rng(7))
    assert tuple(again) == picks[7]


def test_top_k_takes_what_there_is_when_fewer_are_offered():
    assert select_top_k({"a": 1.0}, ["a"], 5, np.random.default_rng(0)) == ["a"]
    assert select_top_k({}, [], 3, np.random.default_rng(0)) == []


def test_scores_settle_once_every_offered_peer_is_scored_and_the_positive_set_holds():
    positive = frozenset({"a"})
    assert not scores_settled(["a", "b", "c"], {"a", "b"}, positive, positive), "c unscored"
    assert not scores_settled(["a", "b"], {"a", "b"}, positive, frozenset({"a", "b"}))
    assert scores_settled(["a", "b"], {"a", "b", "gone"}, positive, positive)


def test_dynamic_k_counts_positive_peers_within_bounds_once_settled():
    scores = {"a": 0.2, "b": 0.1, "c": -0.3, "d": 0.0}
    assert positive_peers(scores) == {"a", "b"}
    assert dynamic_k(scores, settled=True, start_k=5, k_min=1, k_max=5) == 2
    assert dynamic_k(scores, settled=False, start_k=5, k_min=1, k_max=5) == 5
    assert dynamic_k({"c": -1.0}, settled=True, start_k=5, k_min=1, k_max=5) == 1
    many = {f"p{i}": 0.1 for i in range(8)}
    assert dynamic_k(many, settled=True, start_k=4, k_min=1, k_max=5) == 5


# --------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"alpha": 1.0}, "'algorithm.alpha': got 1.0; allowed: a number >= 0 and < 1"),
        ({"k": 9}, "'algorithm.k': got 9; allowed: k_min <= k <= k_max (1..8)"),
        ({"k_min": 0}, "'algorithm.k_min': got 0; allowed: an integer >= 1"),
        ({"k_max": 2}, "'algorithm.k': got 5; allowed: k_min <= k <= k_max (1..2)"),
        ({"k_min": 6}, "'algorithm.k': got 5; allowed: k_min <= k <= k_max (6..8)"),
        ({"dp_clip": -1}, "'algorithm.dp_clip': got -1; allowed: a finite number > 0, or null"),
        ({"dp_sigma": 0.5}, "'algorithm.dp_sigma': got 0.5; allowed: 0 unless dp_clip is set"),
        ({"distance": "yes"}, "'algorithm.distance': got 'yes'; allowed: true or false"),
    ],
)
def test_bad_parameters_name_the_field_the_value_and_what_is_allowed(raw, message):
    assert params_error("pfedsv", raw).startswith("config field " + message)


def test_default_parameters_are_the_papers_plus_the_val_guard_exploration_and_a_wider_k():
    params = parse_params("pfedsv", {})
    assert params == PFedSVParams(
        alpha=0.5,
        k=5,
        k_min=1,
        k_max=8,
        explore=True,
        distance=True,
        val_guard=True,
        shared_body=False,
        dp_clip=None,
        dp_sigma=0.0,
    )


# --------------------------------------------------------------------------- the rule by hand

CENTRES = torch.tensor([[2.0, 2.0], [-2.0, 2.0], [-2.0, -2.0], [2.0, -2.0]])


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(2, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.body(x))


def blobs(labels, n, seed):
    generator = torch.Generator().manual_seed(seed)
    y = torch.tensor(labels).repeat(n // len(labels))
    return CENTRES[y] + 0.7 * torch.randn(len(y), 2, generator=generator), y


def trained_state(labels, seed):
    model = TinyNet()
    x, y = blobs(labels, 200, seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(100):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


@pytest.fixture(scope="module")
def world():
    """Node "me" holds labels 0 and 1; "good" the same; the "bad" peers hold 2 and 3."""
    peers = {
        "good": trained_state([0, 1], 1),
        "bad1": trained_state([2, 3], 2),
        "bad2": trained_state([2, 3], 3),
        "bad3": trained_state([3, 2], 4),
    }
    x_val, y_val = blobs([0, 1], 60, 9)
    return SimpleNamespace(
        own=trained_state([0, 1], 0), peers=peers, data=SimpleNamespace(x_val=x_val, y_val=y_val)
    )


def make_rule(**params):
    """The paper's rule unless a test turns the val guard or exploration on."""
    params.setdefault("val_guard", False)
    params.setdefault("explore", False)
    params.setdefault("k_max", max(5, params.get("k", 5)))
    model = TinyNet()
    context = Context(
        "me",
        seed=3,
        num_classes=4,
        body_keys=tuple(k for k in model.state_dict() if k.startswith("body.")),
        head_keys=tuple(k for k in model.state_dict() if k.startswith("head.")),
        new_model=TinyNet,
    )
    return PFedSV(PFedSVParams(**params), context)


def play_round(rule, world, round_no):
    offered = {MODEL: sorted(world.peers)}
    pulled = rule.wanted(round_no, offered)[MODEL]
    received = {MODEL: {peer: PeerModel(world.peers[peer], 100) for peer in pulled}}
    return pulled, rule.aggregate(round_no, PeerModel(world.own, 100), received, world.data)


def test_the_rule_finds_the_relevant_peer_and_shrinks_k_to_it(world):
    rule = make_rule(k=2, k_min=1, k_max=3)
    history = [play_round(rule, world, round_no) for round_no in range(1, 6)]
    for pulled, outcome in history:
        assert outcome.diagnostics["downloaded"] == sorted(pulled)
        assert len(pulled) == outcome.diagnostics["k"]
        assert sum(outcome.weights.values()) == pytest.approx(1.0)
        assert all(outcome.weights.get(peer, 0) == 0 for peer in ("bad1", "bad2", "bad3"))
    assert rule.relevance["good"] > 0
    # A bad peer scores at most nothing: below zero, or zero where the game's draw of
    # orders found it a null player beside "good".
    assert all(rule.relevance[peer] <= 0 for peer in ("bad1", "bad2", "bad3"))
    assert [outcome.diagnostics["k"] for _, outcome in history][-1] == 1
    assert history[-1][0] == ["good"], "settled on the one relevant peer"
    last = history[-1][1]
    assert set(last.weights) == {"me", "good"}
    assert set(last.diagnostics["shapley"]) == {"me", "good"}


@pytest.mark.parametrize("explore", [False, True])
def test_where_every_peer_helps_exploring_grows_k_to_them(world, explore):
    """The paper ranks a peer never scored at 0, below every relevant one, and holds k at
    its start until every peer on offer is scored: where all peers help, the first k it
    downloads are all it ever scores. Exploring downloads one peer more than those that
    help, from the first round, so k grows by one a round while the spare helps too."""
    helpful = {f"good{seed}": trained_state([0, 1], seed) for seed in range(1, 5)}
    everyone_helps = SimpleNamespace(own=world.own, peers=helpful, data=world.data)
    rule = make_rule(k=2, k_max=4, explore=explore)
    history = [play_round(rule, everyone_helps, round_no) for round_no in range(1, 6)]
    if explore:
        assert [outcome.diagnostics["k"] for _, outcome in history] == [2, 3, 4, 4, 4]
        assert set(history[-1][1].weights) == {"me", *helpful}
    else:
        first = set(history[0][0])
        assert all(set(pulled) == first for pulled, _ in history), "the first two, always"
        assert history[-1][1].diagnostics["k"] == 2


def test_exploring_settles_on_the_relevant_peers_and_one_spare_download(world):
    """k is the relevant peers and one more: the best of the rest, scored again each
    round, so a helpful peer a noisy round put below 0 can come back, while it gets no
    weight where its value is not positive."""
    rule = make_rule(k=2, k_max=4, explore=True)
    history = [play_round(rule, world, round_no) for round_no in range(1, 7)]
    pulled, last = history[-1]
    assert last.diagnostics["k"] == 2
    assert "good" in pulled and len(pulled) == 2
    assert all(last.weights.get(peer, 0) == 0 for peer in ("bad1", "bad2", "bad3"))


def play_screened_round(rule, world, round_no, harmful=("bad1", "bad2", "bad3")):
    """A round as screening plays it: the harmful peers pulled are kept out of the game,
    and the rule is told so before it aggregates."""
    offered = {MODEL: sorted(world.peers)}
    pulled = rule.wanted(round_no, offered)[MODEL]
    rule.kept_out({peer for peer in pulled if peer in harmful})
    received = {
        MODEL: {peer: PeerModel(world.peers[peer], 100) for peer in pulled if peer not in harmful}
    }
    return pulled, rule.aggregate(round_no, PeerModel(world.own, 100), received, world.data)


def test_peers_screening_keeps_out_count_as_scored_and_irrelevant_so_k_shrinks(world):
    """The game never scores a peer screening keeps out; k must still settle on the
    relevant peers, not stay at the start k and download peers only to throw them away."""
    rule = make_rule(k=3, k_min=1, k_max=3)
    history = [play_screened_round(rule, world, round_no) for round_no in range(1, 9)]
    assert rule.explored == set(world.peers)
    assert rule.relevance["good"] > 0
    assert all(rule.relevance[peer] == 0 for peer in ("bad1", "bad2", "bad3"))
    assert history[-1][1].diagnostics["k"] == 1
    assert history[-1][0] == ["good"], "settled on the one relevant peer"


def test_a_relevant_peer_screening_keeps_out_counts_as_irrelevant_that_round(world):
    rule = make_rule(k=1, k_max=1)
    play_round(rule, world, 1)
    rule.relevance = {"good": 0.4, "bad1": -0.2}
    rule.kept_out({"good"})
    rule.aggregate(2, PeerModel(world.own, 100), {MODEL: {}}, world.data)
    assert rule.relevance == {"good": 0.0, "bad1": -0.2}, "a negative score stands"
    rule.relevance["good"] = 0.4
    rule.aggregate(3, PeerModel(world.own, 100), {MODEL: {}}, world.data)
    assert rule.relevance["good"] == 0.4, "told afresh each round: nothing carries over"


def test_the_aggregate_is_the_weighted_average_of_the_snapshot(world):
    rule = make_rule(k=4, k_max=4)
    own_before = {key: value.clone() for key, value in world.own.items()}
    _, outcome = play_round(rule, world, 1)
    for key, tensor in outcome.state.items():
        expected = sum(
            weight * (world.own if name == "me" else world.peers[name])[key]
            for name, weight in outcome.weights.items()
        )
        assert torch.allclose(tensor, expected, atol=1e-6), key
    assert all(torch.equal(world.own[key], own_before[key]) for key in own_before), (
        "the inputs are not averaged in place"
    )


def test_nothing_positive_keeps_the_own_model(world):
    rule = make_rule(k=1, k_max=1)
    silent = SimpleNamespace(x_val=torch.zeros(0, 2), y_val=torch.zeros(0, dtype=torch.long))
    pulled = rule.wanted(1, {MODEL: ["bad1"]})[MODEL]
    received = {MODEL: {peer: PeerModel(world.peers[peer], 100) for peer in pulled}}
    outcome = rule.aggregate(1, PeerModel(world.own, 100), received, silent)
    assert outcome.weights == {"me": 1.0}
    assert all(torch.equal(outcome.state[key], world.own[key]) for key in world.own)


def noisy_copies(state, scale, seeds):
    """Copies of `state` with Gaussian noise: worse alone, but not useless."""
    copies = {}
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        copies[f"noisy{seed}"] = {
            key: value + scale * torch.randn(value.shape, generator=generator)
            for key, value in state.items()
        }
    return copies


def aggregate_with(rule, own, peers, data):
    rule.wanted(1, {MODEL: sorted(peers)})
    received = {MODEL: {peer: PeerModel(state, 100) for peer, state in peers.items()}}
    return rule.aggregate(1, PeerModel(own, 100), received, data)


def part(state, keys):
    """The tensors of `state` under `keys` (a body or a head)."""
    return {key: state[key] for key in keys}


def half_sharing_peers():
    """Two peers that each hold one of the node's labels (0 and 1) and one it lacks."""
    return {"half0": trained_state([0, 2], 5), "half1": trained_state([1, 3], 6)}


def test_the_val_guard_keeps_the_own_model_when_the_average_ties_on_accuracy_but_loses_on_loss(
    world,
):
    peers = half_sharing_peers()
    plain = aggregate_with(make_rule(k=2, k_max=2), world.own, peers, world.data)
    guarded = aggregate_with(make_rule(k=2, k_max=2, val_guard=True), world.own, peers, world.data)
    # The paper's rule: a peer that knows half of the labels scores half of the val split
    # alone, so its Shapley value is positive and it gets weight.
    assert all(plain.diagnostics["shapley"][peer] > 0.2 for peer in peers)
    assert set(plain.weights) == {"me", *peers}
    assert guarded.diagnostics["shapley"] == plain.diagnostics["shapley"]
    verdict = guarded.diagnostics
    assert verdict["v_aggregate"] == verdict["v_own"] == 1.0, "accuracy cannot tell them apart"
    assert verdict["val_loss_aggregate"] > verdict["val_loss_own"]
    assert guarded.weights == {"me": 1.0}
    assert all(torch.equal(guarded.state[key], world.own[key]) for key in world.own)
    # Only the adoption changes: the scores, and so the next downloads, are the rule's.
    for key in ("relevance", "k_next", "selected"):
        assert guarded.diagnostics[key] == plain.diagnostics[key], key


def test_the_val_guard_keeps_the_own_model_when_the_average_is_lower_in_loss_but_wrong_more():
    """Confidently wrong on 2 of 40 costs the own model more loss than being unsure on
    10 costs the average: loss alone would adopt the average, 8 errors more do not (twice
    their noise, sqrt(12), and more)."""
    y = torch.zeros(40, dtype=torch.long)
    own = torch.tensor([[0.0, 15.0]] * 2 + [[3.0, 0.0]] * 38)
    average = torch.tensor([[0.3, 0.0]] * 2 + [[0.0, 0.3]] * 10 + [[0.3, 0.0]] * 28)
    adopt, figures = _guard_verdict(own, average, y)
    assert figures["val_loss_aggregate"] < figures["val_loss_own"]
    assert figures["val_errors_aggregate"] == 10 and figures["val_errors_own"] == 2
    assert not adopt


def test_the_val_guard_adopts_the_average_when_it_lowers_the_val_loss(world):
    worse_own = noisy_copies(world.own, 1.0, (20,))["noisy20"]
    peers = {"good": world.peers["good"], "good2": trained_state([0, 1], 5)}
    plain = aggregate_with(make_rule(k=2, k_max=2), worse_own, peers, world.data)
    guarded = aggregate_with(make_rule(k=2, k_max=2, val_guard=True), worse_own, peers, world.data)
    assert guarded.diagnostics["val_loss_aggregate"] < guarded.diagnostics["val_loss_own"]
    assert set(guarded.weights) == {"me", *peers}
    assert guarded.weights == plain.weights
    assert all(torch.equal(guarded.state[key], plain.state[key]) for key in plain.state)
    model = TinyNet().eval()
    model.load_state_dict(guarded.state)
    with torch.no_grad():
        adopted_accuracy = accuracy(model(world.data.x_val), world.data.y_val)
    assert guarded.diagnostics["v_aggregate"] == adopted_accuracy > guarded.diagnostics["v_own"]


def test_each_model_passes_over_the_val_split_once_and_the_guard_adds_only_the_average(world):
    passes = []

    class CountingNet(TinyNet):
        def forward(self, x):
            passes.append(len(x))
            return super().forward(x)

    rule = make_rule(k=2, k_max=2, val_guard=True)
    rule.context = replace(rule.context, new_model=CountingNet)
    outcome = aggregate_with(rule, world.own, half_sharing_peers(), world.data)
    assert outcome.diagnostics["utility_evaluations"] == 7, "3 players: 7 coalitions"
    assert len(passes) == 7 + 1


def test_the_val_guard_never_adopts_an_average_spoilt_by_a_peer_with_nan_weights(world):
    spoilt = {key: torch.full_like(value, float("nan")) for key, value in world.own.items()}
    peers = {"good": world.peers["good"], "spoilt": spoilt}
    # NaN logits argmax to class 0, three quarters of this val split: a positive value.
    x_val, y_val = blobs([0, 0, 0, 1], 120, 9)
    data = SimpleNamespace(x_val=x_val, y_val=y_val)
    plain = aggregate_with(make_rule(k=2, k_max=2, distance=False), world.own, peers, data)
    assert plain.diagnostics["shapley"]["spoilt"] > 0
    assert any(torch.isnan(tensor).any() for tensor in plain.state.values())
    guarded = aggregate_with(
        make_rule(k=2, k_max=2, distance=False, val_guard=True), world.own, peers, data
    )
    assert guarded.weights == {"me": 1.0}
    assert all(torch.equal(guarded.state[key], world.own[key]) for key in world.own)


def test_with_a_shared_body_the_guard_keeps_the_own_head_on_the_mesh_body(world):
    rule = make_rule(k=2, k_max=2, val_guard=True, shared_body=True)
    peers = half_sharing_peers()
    pulls = rule.wanted(1, {"body": sorted(peers), "head": sorted(peers)})
    body_keys, head_keys = rule.context.body_keys, rule.context.head_keys
    received = {
        "body": {p: PeerModel(part(peers[p], body_keys), 100) for p in peers},
        "head": {p: PeerModel(part(peers[p], head_keys), 100) for p in pulls["head"]},
    }
    outcome = rule.aggregate(1, PeerModel(world.own, 100), received, world.data)
    assert all(outcome.diagnostics["shapley"][peer] > 0 for peer in peers)
    assert outcome.diagnostics["val_loss_aggregate"] > outcome.diagnostics["val_loss_own"]
    assert outcome.weights == {"me": 1.0}
    # The guard weighs heads: the body is the mesh's average whatever it decides.
    for key in body_keys:
        mesh_body = (world.own[key] + peers["half0"][key] + peers["half1"][key]) / 3
        assert torch.allclose(outcome.state[key], mesh_body, atol=1e-6), key
    assert all(torch.equal(outcome.state[key], world.own[key]) for key in head_keys)


def test_val_logits_come_in_batches_equal_to_one_pass_and_an_empty_split_gives_none():
    model = TinyNet().eval()
    x = torch.randn(10, 2)
    with torch.no_grad():
        whole = model(x)
    assert torch.allclose(batched_logits(model, x, batch_size=3), whole, atol=1e-6)
    assert batched_logits(model, x[:0]).shape == (0, 4)
    assert accuracy(whole[:0], torch.zeros(0, dtype=torch.long)) == 0.0


def test_state_survives_a_json_checkpoint_and_repeats_the_next_selection(world):
    rule = make_rule(k=2, k_max=3)
    for round_no in (1, 2):
        play_round(rule, world, round_no)
    saved = json.loads(json.dumps(rule.state_dict()))
    restored = make_rule(k=2, k_max=3)
    restored.load_state_dict(saved)
    assert restored.state_dict() == rule.state_dict()
    offered = {MODEL: sorted(world.peers)}
    assert restored.wanted(3, offered) == rule.wanted(3, offered)


def test_shared_body_publishes_two_parts_pulls_every_body_and_top_k_heads(world):
    rule = make_rule(k=2, k_max=2, shared_body=True)
    published = rule.publish(1, world.own, world.data)
    assert set(published) == {"body", "head"}
    assert set(published["body"]) == set(rule.context.body_keys)
    assert set(published["head"]) == set(rule.context.head_keys)
    offered = {"body": sorted(world.peers), "head": sorted(world.peers)}
    pulls = rule.wanted(1, offered)
    assert pulls["body"] == sorted(world.peers) and len(pulls["head"]) == 2

    received = {
        "body": {
            p: PeerModel(part(world.peers[p], rule.context.body_keys), 50) for p in world.peers
        },
        "head": {
            p: PeerModel(part(world.peers[p], rule.context.head_keys), 50) for p in pulls["head"]
        },
    }
    outcome = rule.aggregate(1, PeerModel(world.own, 100), received, world.data)
    for key in rule.context.body_keys:  # sample-weighted: own 100, four peers 50 each
        expected = (100 * world.own[key] + sum(50 * s[key] for s in world.peers.values())) / 300
        assert torch.allclose(outcome.state[key], expected, atol=1e-6), key
    assert set(outcome.diagnostics["shapley"]) == {"me", *pulls["head"]}
    assert outcome.diagnostics["bodies"] == sorted(world.peers)
    # The head-only shortcut plays the same game as whole models on the averaged body.
    body = {key: outcome.state[key] for key in rule.context.body_keys}
    heads = {"me": world.own, **{p: world.peers[p] for p in pulls["head"]}}
    whole = {p: {**body, **part(state, rule.context.head_keys)} for p, state in heads.items()}
    model = TinyNet()

    def whole_model_accuracy(coalition):
        model.load_state_dict(uniform_average([whole[p] for p in sorted(coalition)]))
        with torch.no_grad():
            return accuracy(model.eval()(world.data.x_val), world.data.y_val)

    expected = exact_shapley(["me", *sorted(pulls["head"])], cached_utility(whole_model_accuracy))
    assert outcome.diagnostics["shapley"] == pytest.approx(expected)
    head_bytes = sum(world.own[k].numel() * 4 for k in rule.context.head_keys)
    body_bytes = sum(world.own[k].numel() * 4 for k in rule.context.body_keys)
    assert outcome.diagnostics["bytes_downloaded"] == 4 * body_bytes + 2 * head_bytes


# --------------------------------------------------------------------------- DP


def test_clipping_bounds_the_update_and_noise_has_the_asked_scale():
    reference = {"w": torch.zeros(20_000), "steps": torch.tensor(3)}
    state = {"w": torch.full((20_000,), 0.1), "steps": torch.tensor(3)}
    clipped, norm = clip_and_noise(
        state, reference, clip=1.0, sigma=0.0, generator=torch.Generator().manual_seed(0)
    )
    assert norm == pytest.approx(0.1 * math.sqrt(20_000), rel=1e-5)
    assert float(clipped["w"].norm()) == pytest.approx(1.0, rel=1e-5)
    assert torch.equal(clipped["steps"], state["steps"]), "integer buffers pass untouched"
    small = {"w": torch.full((20_000,), 1e-4), "steps": torch.tensor(3)}
    kept, _ = clip_and_noise(small, reference, 1.0, 0.0, torch.Generator().manual_seed(0))
    assert torch.allclose(kept["w"], small["w"]), "an update inside the bound is not scaled"
    noised, _ = clip_and_noise(state, reference, 2.0, 0.5, torch.Generator().manual_seed(0))
    noise = noised["w"] - clipped["w"] * 2.0
    assert float(noise.std()) == pytest.approx(0.5 * 2.0, rel=0.03)
    again, _ = clip_and_noise(state, reference, 2.0, 0.5, torch.Generator().manual_seed(0))
    assert torch.equal(noised["w"], again["w"])


def test_dp_publishes_a_noised_model_but_keeps_the_own_model_clean(world):
    rule = make_rule(k=1, k_max=1, dp_clip=0.5, dp_sigma=0.1)
    published = rule.publish(1, world.own, world.data)[MODEL]
    initial = TinyNet().state_dict()
    update = math.sqrt(sum(float((published[k] - initial[k]).pow(2).sum()) for k in initial))
    assert update > 0.5, "clipped to 0.5, then noise of std 0.05 on 82 coordinates"
    assert update < 0.5 + 0.05 * math.sqrt(82) * 2
    assert rule.publish(1, world.own, world.data)[MODEL]["head.bias"].equal(
        published["head.bias"]
    ), "seeded"
    pulled = rule.wanted(1, {MODEL: ["good"]})[MODEL]
    received = {MODEL: {p: PeerModel(world.peers[p], 100) for p in pulled}}
    outcome = rule.aggregate(1, PeerModel(world.own, 100), received, world.data)
    assert outcome.diagnostics["dp"]["clip"] == 0.5
    assert rule._round_start is outcome.state, "the next round's updates start here"


def test_a_checkpoint_keeps_the_dp_reference_so_a_resumed_node_clips_the_true_update(
    world, tmp_path
):
    rule = make_rule(k=1, k_max=1, dp_clip=0.5, dp_sigma=0.1)
    rule.publish(1, world.own, world.data)
    pulled = rule.wanted(1, {MODEL: ["good"]})[MODEL]
    received = {MODEL: {p: PeerModel(world.peers[p], 100) for p in pulled}}
    rule.aggregate(1, PeerModel(world.own, 100), received, world.data)
    torch.save(rule.state_dict(), tmp_path / "checkpoint.pt")  # as the node does
    restored = make_rule(k=1, k_max=1, dp_clip=0.5, dp_sigma=0.1)
    restored.load_state_dict(torch.load(tmp_path / "checkpoint.pt", weights_only=True))
    assert restored.publish(2, world.own, world.data)[MODEL]["head.bias"].equal(
        rule.publish(2, world.own, world.data)[MODEL]["head.bias"]
    )
