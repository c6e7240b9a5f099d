"""Validation screening around the peer rules, on real digits shards and a real MLP."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from meshfl.algorithms import (
    PeerAlgorithm,
    PeerModel,
    algorithm_class,
    build_rule,
    parse_params,
    screening_setting,
)
from meshfl.algorithms.base import Aggregate, Context, cloned, weighted_average
from meshfl.algorithms.copies import NEAR_COPY, Sketcher, copies, near_pairs
from meshfl.algorithms.evidence import PASS_OVER_BOUND, harm_z
from meshfl.algorithms.pfedsv import _guard_verdict as pfedsv_guard
from meshfl.algorithms.screening import TRIAL_ROUNDS, Screened
from meshfl.algorithms.verdicts import (
    ValScores,
    a_far_jump,
    beats_a_constant_guess,
    errors_and_loss_beyond_noise,
    far_models,
    guard_verdict,
    inflated_claims,
    path_shares,
    scores_of_logits,
    worse_beyond_noise,
)
from meshfl.node.attacks import flip_labels, noise_like, scaled_update, with_noise
from meshfl.node.checkpoint import load_checkpoint, save_checkpoint
from meshfl.node.models import body_keys, build_model, head_keys
from meshfl.node.splits import load_node_data
from meshfl.node.trainer import train_local

NODES = 4


def shard(index):
    return load_node_data("digits", None, "iid", NODES, index, 0)


def trained(start, data, labels=None, seed=0, epochs=2):
    model = build_model("mlp", data.input_shape, data.num_classes, "last", seed=0)
    model.load_state_dict(start)
    y = data.y_train if labels is None else labels
    train_local(model, data.x_train, y, epochs, 32, "sgd", 0.1, seed=seed, momentum=0.5)
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


@pytest.fixture(scope="module")
def world():
    """Node h0's own model, two honest peers and one attacker of each kind, all trained
    for a round from one start (a model some rounds into a run) on their digits shards."""
    shards = [shard(i) for i in range(NODES)]
    model = build_model("mlp", shards[0].input_shape, 10, "last", seed=0)
    initial = {key: value.detach().clone() for key, value in model.state_dict().items()}
    start = trained(initial, shards[0], seed=99, epochs=10)
    honest = {f"h{i}": trained(start, shards[i], seed=i) for i in range(3)}
    flipped = trained(start, shards[3], flip_labels(shards[3].y_train, 10), seed=3)
    attackers = {
        "labelflip": flipped,
        "scale": scaled_update(start, honest["h1"], 10.0),
        "signflip": scaled_update(start, honest["h1"], -1.0),
        "noise": noise_like(honest["h1"], torch.Generator().manual_seed(1)),
    }

    def context(rule_name):
        return Context(
            "h0",
            0,
            10,
            tuple(body_keys(model)),
            tuple(head_keys(model)),
            new_model=lambda: build_model("mlp", shards[0].input_shape, 10, "last", seed=0),
            train=lambda m, x, y, epochs, seed, max_steps=None: train_local(
                m, x, y, epochs or 1, 32, "sgd", 0.05, seed=seed, max_steps=max_steps
            ),
            data=shards[0],
        )

    return SimpleNamespace(
        data=shards[0],
        start=start,
        honest=honest,
        attackers=attackers,
        context=context,
        n=len(shards[0].y_train),
    )


def fresh(state, round_no):
    """`state` with noise of norm 0.2 drawn for `round_no`: a model of that round rather
    than a replay of another's, for the screening of a node whose peers' models are a
    round's training (about 0.55) apart (algorithms/copies.py)."""
    generator = torch.Generator().manual_seed(round_no)
    noise = {key: torch.randn(value.shape, generator=generator) for key, value in state.items()}
    norm = sum(float(each.pow(2).sum()) for each in noise.values()) ** 0.5
    return {key: value + 0.2 / norm * noise[key] for key, value in state.items()}


def screened(world, name, trials=False, **params):
    rounds = 10 if name == "pfedlia" else None
    rule = algorithm_class(name)(parse_params(name, params, rounds), world.context(name))
    return Screened(rule, trials)


def aggregate(rule, world, peers, round_no=2, counts=None):
    counts = counts or {}
    received = {"model": {p: PeerModel(s, counts.get(p, world.n)) for p, s in peers.items()}}
    return rule.aggregate(round_no, PeerModel(world.honest["h0"], world.n), received, world.data)


def test_the_guard_refuses_an_aggregate_only_on_evidence_of_harm_beyond_the_splits_noise():
    """The burden is on harm: a val loss higher than the own model's by less than two
    paired standard errors is the split's noise, and the aggregate stands; a split four
    times the size forgives a quarter as much (the test's power grows with it)."""
    own = torch.tensor([1.0, 0.5, 1.5, 1.0] * 5)
    noise = torch.tensor([0.3, -0.2, 0.1, -0.1] * 5)  # mean 0.025, standard error ~0.04
    assert not worse_beyond_noise(own, own), "a tie"
    assert not worse_beyond_noise(own, own - 0.5), "help"
    assert not worse_beyond_noise(own, own + noise + 0.05), "0.075 above, under two errors"
    assert worse_beyond_noise(own, own + noise + 0.1), "0.125 above: beyond two"
    assert worse_beyond_noise(own.repeat(4), (own + noise + 0.05).repeat(4)), "80 samples"
    assert not worse_beyond_noise(own, own + 1e-3), "a steady rise too small to matter"
    assert worse_beyond_noise(own, own + 0.05), "a steady rise of 0.05 nats is harm"
    assert worse_beyond_noise(own, torch.full_like(own, float("nan"))), "not finite"


def test_a_far_aggregate_must_not_be_worse_on_most_samples_as_well():
    """An average of models that trained apart for rounds can be worse on nearly every
    val sample and much better on the few the own model is confidently wrong on: the
    mean's standard error swells and its test passes. For an aggregate far from the own
    model, the signs are evidence too; for a near one, the mean alone decides."""
    own = torch.tensor([0.2] * 26 + [3.0] * 4)
    widely_worse = own + torch.tensor([0.8] * 26 + [-2.5] * 4)  # mean +0.36, 1.7 errors
    assert not worse_beyond_noise(own, widely_worse), "the mean's test alone passes it"
    assert worse_beyond_noise(own, widely_worse, by_signs=True), "worse on 26 samples of 30"
    mixed = own + torch.tensor([0.8] * 18 + [-0.5] * 12)  # worse on 18, better on 12
    assert not worse_beyond_noise(own, mixed - 0.2, by_signs=True)
    assert not worse_beyond_noise(own, own + 1e-3, by_signs=True), "too small to matter"


def test_an_aggregate_is_far_when_it_lies_many_rounds_of_training_away():
    start = {"w": torch.zeros(4)}
    own = {"w": torch.tensor([1.0, 0.0, 0.0, 0.0])}  # the round's training moved it by 1
    near = {"w": torch.tensor([0.5, 1.0, 0.0, 0.0])}
    far = {"w": torch.tensor([1.0, 4.0, 0.0, 0.0])}
    assert not a_far_jump(near, own, start) and a_far_jump(far, own, start)


def scores(losses, errors):
    return ValScores(torch.tensor(losses), torch.tensor(errors, dtype=torch.float64))


def guard_adopts(own, aggregate):
    return guard_verdict(own, aggregate)[0]


def test_the_guard_refuses_an_aggregate_lower_in_loss_but_wrong_on_more_samples():
    """The Digit-5 case: confidently wrong on a few samples costs more loss than being
    unsure on many, so mean loss alone took an aggregate 12 points worse in accuracy."""
    own = scores([6.0] * 2 + [0.1] * 38, [1] * 2 + [0] * 38)
    unsure = scores([0.6] * 2 + [0.9] * 10 + [0.1] * 28, [0] * 2 + [1] * 10 + [0] * 28)
    assert float(unsure.losses.mean()) < float(own.losses.mean())
    assert not guard_adopts(own, unsure), "20 points worse in accuracy"
    swapped = scores([2.0] * 2 + [0.1] * 38, [1, 0, 1] + [0] * 37)
    assert guard_adopts(own, swapped), "as many errors, lower loss"
    assert not guard_adopts(own, scores([9.0] * 40, [0] * 40)), "higher loss"
    assert guard_adopts(scores([], []), scores([], [])), "no val split: nothing to judge by"


def test_the_guard_adopts_an_aggregate_higher_in_loss_that_is_right_on_more_samples():
    """The mirror of the Digit-5 case, as an average of peers on other skews gives it on
    USPS Dirichlet(0.5): 0.46 nats up in val loss, 3.4 standard errors (beyond the
    loss's own test), but right on 3 samples of 30 that the own model gets wrong. Its
    errors speak for it, and its loss counts only added to them; with as many errors as
    the own model, or a loss not finite, the loss alone refuses it as before."""
    own = scores([0.4] * 23 + [1.2] * 7, [0] * 23 + [1] * 7)
    higher = [1.6, 0.2] * 11 + [0.9] + [0.6] * 3 + [2.2] * 4
    right_more = scores(higher, [0] * 26 + [1] * 4)
    assert worse_beyond_noise(own.losses, right_more.losses), "the loss alone refuses it"
    assert guard_adopts(own, right_more), "3 fewer errors (1.7 deviations) outweigh it"
    assert not guard_adopts(own, scores(higher, own.errors.tolist())), "as many errors"
    assert not guard_adopts(own, scores([float("nan")] * 30, [0] * 30)), "7 fewer, not finite"


def with_errors(size, wrong, loss):
    return scores([loss] * size, [1] * wrong + [0] * (size - wrong))


def beside(own, extra_errors, loss_z):
    """A model making `extra_errors` more val errors than `own` (none fewer), its
    per-sample losses apart from own's by noise whose mean is `loss_z` standard errors."""
    n = len(own.losses)
    noise = 0.5 * torch.tensor([1.0, -1.0] * (n // 2), dtype=torch.float64)
    differences = noise + loss_z * float(noise.std()) / n**0.5
    assert harm_z(differences) == pytest.approx(max(loss_z, -1.0))
    errors = own.errors.clone()
    errors[torch.nonzero(errors == 0)[:extra_errors]] = 1.0
    return ValScores(own.losses + differences, errors)


def test_extra_val_errors_and_a_higher_val_loss_add_up_as_evidence_of_harm():
    """On a split of 30: two more errors (1.4 deviations) are noise beside a val loss
    0.4 standard errors up, harm beside one 0.8 up; one more error is noise even then,
    and a loss three standard errors up is harm with no extra error (the spike check
    undoes such a round)."""
    own = with_errors(30, 0, 0.6)
    assert not errors_and_loss_beyond_noise(own, beside(own, 2, 0.4))
    assert errors_and_loss_beyond_noise(own, beside(own, 2, 0.8))
    assert not errors_and_loss_beyond_noise(own, beside(own, 1, 0.8))
    assert not errors_and_loss_beyond_noise(own, beside(own, 2, -1.0)), "the loss is lower"
    assert errors_and_loss_beyond_noise(own, beside(own, 0, 3.0)), "the loss alone, beyond"
    assert not errors_and_loss_beyond_noise(beside(own, 2, 0.8), own), "fewer errors"


def test_errors_that_the_loss_does_not_confirm_count_only_beyond_two_deviations():
    """On a split of 30, an aggregate lower in val loss with three more errors is what
    noise gives a mesh that trains together (refusing it cost FedAvg's gain); five more,
    with none fewer, are harm whatever the loss says."""
    own = with_errors(30, 0, 0.6)
    assert not errors_and_loss_beyond_noise(own, beside(own, 3, -1.0)), "3 <= 2 * sqrt(3)"
    assert errors_and_loss_beyond_noise(own, beside(own, 5, -1.0)), "5 > 2 * sqrt(5)"
    assert errors_and_loss_beyond_noise(own, beside(own, 3, 0.4)), "the loss leans the same way"
    assert guard_adopts(own, beside(own, 3, -1.0))
    assert errors_and_loss_beyond_noise(own, with_errors(30, 3, float("nan"))), "no loss to trust"
    broken = with_errors(30, 0, float("nan"))
    assert not errors_and_loss_beyond_noise(broken, with_errors(30, 3, 0.6)), "no own loss"


def test_val_scores_are_the_per_sample_cross_entropy_and_misclassifications():
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [1.0, 1.5]])
    found = scores_of_logits(logits, torch.tensor([0, 0, 1]))
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 0, 1]), reduction="none")
    assert torch.allclose(found.losses, expected)
    assert found.errors.tolist() == [0.0, 1.0, 0.0]


def test_claims_far_above_the_median_count_are_screened():
    assert inflated_claims(100, {"a": 90, "b": 120, "c": 10**9}) == {"c"}
    assert inflated_claims(100, {"a": 400}) == set(), "4 times the median is allowed"


def test_copies_within_a_round_and_replays_of_earlier_rounds_are_found():
    sketch = Sketcher(seed=0)
    a, b = sketch({"w": torch.ones(2)}), sketch({"w": -torch.ones(2)})
    old = sketch({"w": torch.full((2,), 3.0)})
    moved = sketch({"w": torch.full((2,), 3.5)})
    nearest = near_pairs({"x": a, "y": a, "z": b, "r": old}, [("q", old)], scale=1.0)
    assert copies(nearest) == {"x": "copy", "y": "copy", "r": "replay"}
    # q's model moved a little from its own last one: its own work, if settled; r hands
    # back q's last model, s its own bit for bit.
    remembered = [("q", old), ("s", b)]
    settled = near_pairs({"q": moved, "r": old + 0.001, "s": b}, remembered, scale=1.0)
    assert copies(settled) == {"r": "replay", "s": "replay"}


def test_a_relay_with_noise_earns_nothing_and_honest_peers_of_like_data_are_no_copies(world):
    """A relay (node/attacks.py `relay`) publishes a model received the round before with
    noise of a thousandth of the weights' scale: every bit differs, and it is kept out as
    a replay; two relays of one model this round are copies of each other. Two honest
    peers trained from one start on shards of one distribution are not: the nearest pair
    lies at about the round's spread, twenty times the bound."""
    rule = screened(world, "fedavg")
    first = aggregate(rule, world, {"h1": world.honest["h1"], "h2": world.honest["h2"]}, 1)
    assert first.diagnostics["screened_out"] == {}
    assert first.diagnostics["screening"]["nearest_copy"] > 5 * NEAR_COPY
    relayed = {
        name: with_noise(world.honest["h1"], 1e-3, torch.Generator().manual_seed(seed))
        for seed, name in enumerate(("r1", "r2"))
    }
    assert not torch.equal(relayed["r1"]["head.weight"], world.honest["h1"]["head.weight"])
    peers = {"h2": fresh(world.honest["h2"], 2), "r1": relayed["r1"]}
    second = aggregate(rule, world, peers, round_no=2)
    assert second.diagnostics["screened_out"] == {"r1": "replay"}
    assert second.weights.get("r1", 0.0) == 0.0 and second.weights.get("h2", 0.0) > 0
    third = aggregate(
        screened(world, "fedavg"), world, {"h2": world.honest["h2"], **relayed}, round_no=1
    )
    assert third.diagnostics["screened_out"] == {"r1": "copy", "r2": "copy"}


@pytest.mark.parametrize("kind", ["labelflip", "scale", "signflip", "noise"])
def test_fedavg_screening_gives_each_attackers_model_no_weight(world, kind):
    peers = {"h1": world.honest["h1"], "h2": world.honest["h2"], "bad": world.attackers[kind]}
    outcome = aggregate(screened(world, "fedavg"), world, peers)
    assert outcome.diagnostics["screened_out"].get("bad") in ("distance", "val_loss")
    assert outcome.weights.get("bad", 0.0) == 0.0
    assert outcome.weights.get("h1", 0.0) > 0 and outcome.weights.get("h2", 0.0) > 0


def test_inflated_counts_copies_and_replays_are_screened_before_any_val_pass(world):
    rule = screened(world, "fedavg")
    aggregate(rule, world, {"h1": world.honest["h1"]}, round_no=1)
    peers = {
        "h2": world.honest["h2"],
        "liar": world.honest["h1"],
        "c1": world.attackers["noise"],
        "c2": world.attackers["noise"],
    }
    outcome = aggregate(
        rule, world, {**peers, "replayer": world.honest["h1"]}, round_no=2, counts={"liar": 10**9}
    )
    assert outcome.diagnostics["screened_out"] == {
        "c1": "copy",
        "c2": "copy",
        "liar": "n_claim",
        "replayer": "replay",
    }
    assert set(outcome.weights) == {"h0", "h2"}


def test_a_resumed_node_still_knows_the_models_of_its_last_rounds(world, tmp_path):
    before = screened(world, "fedavg")
    aggregate(before, world, {"h1": world.honest["h1"]}, round_no=1)
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"algorithm": before.state_dict()})  # as the node keeps it
    resumed = screened(world, "fedavg")
    resumed.load_state_dict(load_checkpoint(path)["algorithm"])
    outcome = aggregate(resumed, world, {"replayer": world.honest["h1"]}, round_no=2)
    assert outcome.diagnostics["screened_out"] == {"replayer": "replay"}


def test_a_resumed_node_does_not_admit_a_peer_it_had_kept_out(world, tmp_path):
    before = screened(world, "fedavg")
    for round_no in (1, 2):  # harm that repeats
        peers = {p: m for p, m in noisy_round(world, round_no).items() if p != "h2"}
        outcome = aggregate(before, world, peers, round_no=round_no)
        assert outcome.diagnostics["screened_out"] == {"bad": "val_loss"}
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"algorithm": before.state_dict()})
    resumed = screened(world, "fedavg")
    resumed.load_state_dict(load_checkpoint(path)["algorithm"])
    # Next round "bad" is on offer again: a node without the record would fetch it; the
    # resumed node, whose record of it shows clear harm that repeats, does not even
    # download it.
    offered = {"model": ["bad", "h1"]}
    assert resumed.wanted(3, offered)["model"] == ["h1"]
    assert screened(world, "fedavg").wanted(3, offered)["model"] == ["bad", "h1"]


def test_a_clearly_harmful_peer_is_not_fetched_until_its_record_fades(world):
    rule = screened(world, "fedavg")
    offered = {"model": ["bad", "h1"]}
    fetched_rounds = []
    for round_no in range(1, 8):
        peers = {  # new models every round, or the second would be a replay
            "h1": fresh(world.honest["h1"], round_no),
            "bad": noise_like(world.honest["h1"], torch.Generator().manual_seed(round_no)),
        }
        wanted = rule.wanted(round_no, offered)["model"]
        if "bad" in wanted:
            fetched_rounds.append(round_no)
        outcome = aggregate(rule, world, {p: peers[p] for p in wanted}, round_no=round_no)
        assert outcome.diagnostics["screened_out"]["bad"] in ("val_loss", "record")
        assert outcome.weights.get("bad", 0.0) == 0.0
    assert fetched_rounds[0] == 1 and 2 <= len(fetched_rounds) <= 4, fetched_rounds


def noisy_round(world, round_no):
    """The honest peers' models of `round_no` and an attacker's noise, each new."""
    peers = {peer: fresh(world.honest[peer], round_no) for peer in ("h1", "h2")}
    noise = noise_like(world.honest["h1"], torch.Generator().manual_seed(round_no))
    return {**peers, "bad": noise}


def test_a_peer_passed_over_stays_out_however_often_the_round_asks(world):
    """The node asks `wanted` again each time more offers arrive; the first ask's
    pass-over fades the record below the bound, and a later ask must not fetch the peer
    for that: which peers a round learns from must not hang on the order offers came."""
    rule = screened(world, "fedavg")
    for round_no in (1, 2):  # harm that repeats
        aggregate(rule, world, noisy_round(world, round_no), round_no=round_no)
    assert rule.wanted(3, {"model": ["bad"]})["model"] == []
    assert rule.wanted(3, {"model": ["bad", "h1"]})["model"] == ["h1"]
    assert rule.wanted(3, {"model": ["bad", "h1", "h2"]})["model"] == ["h1", "h2"]
    honest = {peer: model for peer, model in noisy_round(world, 3).items() if peer != "bad"}
    outcome = aggregate(rule, world, honest, round_no=3)
    assert outcome.diagnostics["screened_out"] == {"bad": "record"}
    assert rule.wanted(4, {"model": ["bad", "h1"]})["model"] == ["bad", "h1"], "faded: measured"


def test_a_pass_over_holds_when_an_ask_of_the_round_lacks_the_peers_offer(world):
    """An offer can drop out of one ask (its origin marked down) and come back in the
    next: the peer stays passed over for the round."""
    rule = screened(world, "fedavg")
    for round_no in (1, 2):  # harm that repeats
        aggregate(rule, world, noisy_round(world, round_no), round_no=round_no)
    assert rule.wanted(3, {"model": ["bad", "h1"]})["model"] == ["h1"]
    assert rule.wanted(3, {"model": ["h1"]})["model"] == ["h1"]
    assert rule.wanted(3, {"model": ["bad", "h1"]})["model"] == ["h1"]


def test_one_round_of_clear_harm_is_measured_again(world):
    """A first round's models trained apart hurt the node they are mixed into, honest or
    not: the peer is fetched and measured again, not passed over on one round."""
    rule = screened(world, "fedavg")
    outcome = aggregate(rule, world, noisy_round(world, 1), round_no=1)
    assert outcome.diagnostics["screened_out"]["bad"] in ("val_loss", "distance")
    assert rule.records.score("bad") > PASS_OVER_BOUND, "clear harm"
    assert rule.wanted(2, {"model": ["bad", "h1", "h2"]})["model"] == ["bad", "h1", "h2"]


def test_a_bounded_view_shuns_a_peer_for_harm_that_repeats_not_for_one_round(world):
    """Shunned, a peer never gets its place back: one round's conviction (a node
    catching up with its cluster is far from its cluster-mates for a round) would lose
    a node's cluster-mates for good. It is dropped first, and shunned once the harm
    repeats."""
    rule = screened(world, "fedavg")
    aggregate(rule, world, noisy_round(world, 1), round_no=1)
    assert not rule.shuns("bad")
    assert rule.benefits(["bad", "h1"], {})["bad"] < rule.benefits(["bad", "h1"], {})["h1"]
    aggregate(rule, world, noisy_round(world, 2), round_no=2)
    assert rule.shuns("bad") and not rule.shuns("h1")


def test_the_rule_is_told_whom_screening_keeps_out_before_it_aggregates(world):
    rule = screened(world, "fedavg")
    told = []
    rule.rule.kept_out = told.append
    aggregate(rule, world, {"h1": world.honest["h1"], "bad": world.attackers["noise"]})
    assert told == [{"bad"}]
    tried = screened(world, "fedavg", trials=True)
    told.clear()
    tried.rule.kept_out = told.append
    aggregate(tried, world, {"h1": world.honest["h1"], "bad": world.attackers["scale"]})
    # First for the trial (step 6), where only causes other than the val check count.
    assert told == [set(), {"bad"}]


def test_a_peer_the_val_check_keeps_out_is_put_on_trial_and_judged_trained(world):
    """The trial (the rule's aggregate with the peer let in) is trained next round as
    the own model was and judged by the guard against it: here the own model of round 2
    is the initial weights (its training went nowhere), so the trained trial wins and
    the round goes on from it, naming the trial's weights."""
    rule = screened(world, "fedavg", trials=True)
    first = aggregate(rule, world, {"h1": world.honest["h1"], "bad": world.attackers["scale"]})
    assert first.diagnostics["screened_out"] == {"bad": "val_loss"}
    assert first.diagnostics["screening"]["on_trial"] == ["bad"]
    assert first.weights.get("bad", 0.0) == 0.0
    initial = build_model("mlp", world.data.input_shape, 10, "last", seed=0).state_dict()
    second = rule.aggregate(3, PeerModel(initial, world.n), {}, world.data)
    report = second.diagnostics["screening"]
    assert report["trial"]["won"] is True and report["judged_against"] == "trial"
    assert report["trial"]["weights"] == pytest.approx({"h0": 1 / 3, "h1": 1 / 3, "bad": 1 / 3})
    assert float(rule._scores(second.state, world.data).losses.mean()) == pytest.approx(
        report["trial"]["val_loss_aggregate"]
    ), "the round's outcome is the trained trial"


def test_a_trial_is_judged_the_next_round_only(world):
    rule = screened(world, "fedavg", trials=True)
    first = aggregate(rule, world, {"h1": world.honest["h1"], "bad": world.attackers["scale"]})
    assert "on_trial" in first.diagnostics["screening"]
    later = aggregate(rule, world, {}, round_no=4)  # the node missed round 3
    assert "trial" not in later.diagnostics["screening"]
    # A path that goes on after a lost round is dropped the same way (fresh models, not
    # replays of round 2's).
    peers = {"h1": world.honest["h1"], "bad": world.attackers["scale"]}
    aggregate(rule, world, {peer: fresh(state, 6) for peer, state in peers.items()}, 6)
    rule.context = dataclasses.replace(rule.context, train=lambda *args, **kwargs: None)
    lost = aggregate(rule, world, {}, round_no=7).diagnostics["screening"]
    assert lost["trial"]["won"] is False and rule._trial is not None, "the path goes on"
    assert "trial" not in aggregate(rule, world, {}, round_no=9).diagnostics["screening"]


def test_a_trial_that_trains_worse_than_the_own_model_changes_nothing(world):
    """An attacker let in on trial is let in only where the node ends up no worse: a
    scaled update mixed in, whose training goes nowhere, stays worse, and the node's
    round ends as it would have without the trial."""
    tried, untried = screened(world, "fedavg", trials=True), screened(world, "fedavg")
    aggregate(tried, world, {"h1": world.honest["h1"], "bad": world.attackers["scale"]})
    tried.context = dataclasses.replace(tried.context, train=lambda *args, **kwargs: None)
    aggregate(untried, world, {"h1": world.honest["h1"]})
    peers = {"h2": world.honest["h2"]}
    outcome = aggregate(tried, world, peers, round_no=3)
    assert outcome.diagnostics["screening"]["trial"]["won"] is False
    expected = aggregate(untried, world, peers, round_no=3)
    assert "trial" not in expected.diagnostics["screening"]
    assert all(torch.equal(outcome.state[key], expected.state[key]) for key in expected.state)


def test_only_a_model_of_the_nodes_task_is_let_in_on_trial(world):
    """A model trained on flipped labels from scratch (as an attacker that flips all its
    run), or noise, alone does no better on the val split than always guessing its most
    common label; an honest peer's model does, and so does one whose update was scaled
    or sign-flipped (the val check keeps those out, the trial judges them). The fixture's
    label flipper trained one round from a good model: it still beats the guess."""

    def models_the_task(state):
        return beats_a_constant_guess(
            screened(world, "fedavg")._scores(state, world.data).errors, world.data.y_val
        )

    initial = build_model("mlp", world.data.input_shape, 10, "last", seed=0).state_dict()
    flipped = trained(initial, world.data, flip_labels(world.data.y_train, 10), epochs=10)
    assert models_the_task(world.honest["h1"]) and models_the_task(world.attackers["scale"])
    assert models_the_task(world.attackers["signflip"])
    assert models_the_task(world.attackers["labelflip"])
    assert not models_the_task(flipped)
    assert not models_the_task(world.attackers["noise"])
    labels = torch.tensor([0, 0, 0, 1])
    assert not beats_a_constant_guess(torch.tensor([0.0, 0.0, 0.0, 1.0]), labels), "a tie"
    assert beats_a_constant_guess(torch.tensor([0.0] * 4), labels)
    assert beats_a_constant_guess(torch.tensor([]), torch.tensor([])), "no val split"
    rule = screened(world, "fedavg", trials=True)
    peers = {"h1": world.honest["h1"], "flip": flipped, "bad": world.attackers["scale"]}
    first = aggregate(rule, world, peers)
    assert first.diagnostics["screened_out"] == {"flip": "val_loss", "bad": "val_loss"}
    assert first.diagnostics["screening"]["on_trial"] == ["bad"]
    assert set(rule._trial.shares) == {"h0", "h1", "bad"}, "the label-flipped model stays out"


def test_a_trial_path_that_loses_goes_on_from_its_trained_model_until_it_is_old(world):
    """A body from other domains can validate worse for a few rounds of training and
    better after them: a trial that lost is the next round's path to aggregate and
    train again, with no new peer kept out, until TRIAL_ROUNDS of it have been judged."""
    rule = screened(world, "fedavg", trials=True)
    aggregate(rule, world, {"h1": world.honest["h1"], "bad": world.attackers["scale"]})

    def flip_signs(model, *args, **kwargs):  # a "training" whose outcome is plain to see
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.neg_()

    # The path is the scaled update mixed in, or its negation: it loses every round.
    rule.context = dataclasses.replace(rule.context, train=flip_signs)
    began = 2
    for round_no in range(began + 1, began + TRIAL_ROUNDS + 2):
        judged_model = rule._trial.state if rule._trial is not None else None
        report = aggregate(rule, world, {}, round_no=round_no).diagnostics["screening"]
        judged = round_no - began
        if judged > TRIAL_ROUNDS:
            assert "trial" not in report, "given up: nothing left to judge"
            continue
        assert report["trial"]["won"] is False and report["trial"]["path_rounds"] == judged
        if judged == TRIAL_ROUNDS:
            assert rule._trial is None, "old: given up"
            continue
        # No peer came, so the path's next model is its trained one, aggregated alone.
        # (The mlp's state is its parameters alone.)
        next_model = rule._trial.state
        assert all(torch.equal(next_model[k], -judged_model[k]) for k in judged_model), round_no


def test_a_path_that_wins_rounds_later_names_each_models_share_in_it(world):
    """A path that lost in round 3 and went on with a peer let in again wins in round 4:
    the node carries on from every model the path took in, at its share (the tables
    count the attackers' among them)."""
    rule = screened(world, "fedavg", trials=True)
    bad = world.attackers["scale"]
    aggregate(rule, world, {"h1": world.honest["h1"], "bad": bad})
    training = rule.context.train
    rule.context = dataclasses.replace(rule.context, train=lambda *args, **kwargs: None)
    again = fresh(bad, 3)  # not a replay of round 2's
    third = aggregate(rule, world, {"h2": world.honest["h2"], "bad": again}, round_no=3)
    report = third.diagnostics["screening"]
    assert report["trial"]["won"] is False and report["on_trial"] == ["bad"]
    rule.context = dataclasses.replace(rule.context, train=training)
    initial = build_model("mlp", world.data.input_shape, 10, "last", seed=0).state_dict()
    fourth = rule.aggregate(4, PeerModel(initial, world.n), {}, world.data)
    trial = fourth.diagnostics["screening"]["trial"]
    assert trial["won"] is True and trial["path_rounds"] == 2
    # Round 2: a third each; round 3: the path's model a third, h2 and the attacker a third.
    expected = {"h0": 1 / 9, "h1": 1 / 9, "bad": 1 / 9 + 1 / 3, "h2": 1 / 3}
    assert trial["weights"] == pytest.approx(expected)


def test_a_paths_shares_pass_on_at_the_weight_of_its_own_model():
    first = path_shares({"me": 1.0}, {"me": 0.5, "a": 0.5}, "me")
    assert first == {"me": 0.5, "a": 0.5}
    second = path_shares(first, {"me": 0.6, "a": 0.2, "b": 0.2}, "me")
    assert second == pytest.approx({"me": 0.3, "a": 0.5, "b": 0.2})
    assert sum(second.values()) == pytest.approx(1.0)


def test_a_won_trial_that_the_spike_check_undoes_names_no_peer_weights(world):
    """A trial can beat an own model whose training went astray and still make more val
    errors than the model the round started from: the round is undone (step 6), and the
    node carries on from none of the trial's peers, so its metrics must not name them
    (the experiment tables count those weights as attackers')."""
    rule = screened(world, "fedavg", trials=True)
    start = aggregate(rule, world, {"h1": world.honest["h1"], "bad": world.attackers["scale"]})
    # The trial's training goes nowhere, so it stays the mixed-in scaled update it was.
    rule.context = dataclasses.replace(rule.context, train=lambda *args, **kwargs: None)
    astray = noise_like(world.honest["h0"], torch.Generator().manual_seed(2))
    outcome = rule.aggregate(3, PeerModel(astray, world.n), {}, world.data)
    report = outcome.diagnostics["screening"]
    assert report["trial"]["won"] is True and report["kept_round_start"] is True
    assert "weights" not in report["trial"]
    assert outcome.weights == {"h0": 1.0}
    assert all(torch.equal(outcome.state[key], start.state[key]) for key in start.state)


@pytest.mark.parametrize(("name", "params"), [("pfedsv", {}), ("pfedlia", {"warmup": 1})])
def test_a_trial_leaves_a_stateful_rule_as_it_would_be_without_it(world, name, params):
    """pFedSV keeps relevance scores and its k, pFedLIA its lazy scores and groups: a
    trial path's aggregates must not move them, or the round's own aggregate would
    differ from the rule's untried one."""
    peers = {"h1": world.honest["h1"], "h2": world.honest["h2"], "bad": world.attackers["signflip"]}
    tried, untried = screened(world, name, True, **params), screened(world, name, **params)

    # pFedLIA: the warm-up's last round (its anchor), then lazy. The trial's "training"
    # zeroes its weights (a constant guess), so it loses every round and its path goes
    # on: only the rewinds of its aggregates are compared.
    def ruin(model, *args, **kwargs):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.zero_()

    tried.context = dataclasses.replace(tried.context, train=ruin)
    for round_no in (1, 2, 3):
        models = {peer: fresh(state, round_no) for peer, state in peers.items()}
        outcomes = [aggregate(rule, world, models, round_no=round_no) for rule in (tried, untried)]
        assert outcomes[0].diagnostics["screened_out"]["bad"] == "val_loss"
        report = outcomes[0].diagnostics["screening"]
        assert "on_trial" in report, round_no
        if round_no > 1:
            assert (
                report["trial"]["won"] is False and report["trial"]["path_rounds"] == round_no - 1
            )
        kept = [
            {
                k: v
                for k, v in outcome.diagnostics.items()
                if k != "screening" and "seconds" not in k
            }
            for outcome in outcomes
        ]
        assert kept[0] == kept[1]
        assert all(torch.equal(outcomes[0].state[k], outcomes[1].state[k]) for k in models["h1"])


def test_a_round_of_training_gone_astray_does_not_let_an_attacker_in(world):
    """Peers are judged against the model the round started from where the own model
    of the round validates worse: next to a ruined model, even poison looks like help."""
    rule = screened(world, "fedavg")
    aggregate(rule, world, {"h2": world.honest["h2"]}, round_no=1)  # round 2 starts here
    astray = noise_like(world.honest["h0"], torch.Generator().manual_seed(2))
    peers = {"h1": world.honest["h1"], "bad": world.attackers["labelflip"]}
    received = {"model": {peer: PeerModel(state, world.n) for peer, state in peers.items()}}
    outcome = rule.aggregate(2, PeerModel(astray, world.n), received, world.data)
    assert outcome.diagnostics["screening"]["judged_against"] == "round_start"
    assert outcome.diagnostics["screened_out"] == {"bad": "val_loss"}
    assert outcome.weights.get("bad", 0.0) == 0.0
    # The honest peer, averaged with a ruined model, does not bring it back to where the
    # round started: the node keeps that model (next test).
    assert outcome.diagnostics["screening"]["kept_round_start"] is True


def test_a_round_that_went_astray_with_no_peer_to_mend_it_is_undone(world):
    rule = screened(world, "fedavg")
    start = aggregate(rule, world, {"h2": world.honest["h2"]}, round_no=1).state
    astray = noise_like(world.honest["h0"], torch.Generator().manual_seed(2))
    received = {"model": {"bad": PeerModel(world.attackers["labelflip"], world.n)}}
    outcome = rule.aggregate(2, PeerModel(astray, world.n), received, world.data)
    assert outcome.diagnostics["screening"]["kept_round_start"] is True
    assert all(torch.equal(outcome.state[key], start[key]) for key in start)
    assert outcome.weights == {"h0": 1.0}
    next_round = aggregate(rule, world, {"h1": world.honest["h1"]}, round_no=3)
    assert next_round.diagnostics["screening"]["kept_round_start"] is False, (
        "a round that validates as well as its start is kept"
    )


def test_a_rule_that_privatizes_its_update_measures_it_from_the_model_the_node_kept(world):
    """pFedSV's DP clips the update against the model the round started from: where
    screening undid a round, that is the model screening kept, not the rule's outcome."""
    rule = screened(world, "pfedsv", k=2, k_max=2, dp_clip=1.0)
    aggregate(rule, world, {"h2": world.honest["h2"]}, round_no=1)
    astray = noise_like(world.honest["h0"], torch.Generator().manual_seed(2))
    received = {"model": {"bad": PeerModel(world.attackers["labelflip"], world.n)}}
    outcome = rule.aggregate(2, PeerModel(astray, world.n), received, world.data)
    assert outcome.diagnostics["screening"]["kept_round_start"] is True
    reference = rule.rule._round_start
    assert all(torch.equal(reference[key], outcome.state[key]) for key in outcome.state)


def test_a_nodes_first_round_has_no_round_start_to_fall_back_to(world):
    astray = noise_like(world.honest["h0"], torch.Generator().manual_seed(2))
    outcome = screened(world, "fedavg").aggregate(1, PeerModel(astray, world.n), {}, world.data)
    assert "kept_round_start" not in outcome.diagnostics["screening"]
    assert all(torch.equal(outcome.state[key], astray[key]) for key in astray)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("fedavg", {}),
        ("median", {}),
        ("trimmed_mean", {"beta": 0.2}),
        ("krum", {"f": 1}),
        ("multikrum", {"f": 1}),
        ("fedc2i", {}),
        ("pfedlia", {}),
        ("pfedsv", {"k": 4, "k_max": 4}),
    ],
)
def test_every_peer_rule_behind_screening_leaves_attackers_no_weight(world, name, params):
    """Screening asks for evidence of harm, so an attacker whose first model hurts this
    node only slightly at its share (the label flipper here: 1.4 standard errors) may
    count for one round; by its second its record keeps it out, and every attacker that
    shows itself (scaled, sign-flipped, noise) is out from the first. The outcome is
    never worse than the own model on the val split beyond the split's noise."""
    rule = screened(world, name, **params)
    peers = {**{p: s for p, s in world.honest.items() if p != "h0"}, **world.attackers}
    for round_no in (1, 2):
        models = {  # new models every round, or the second would be a replay
            peer: fresh(state, round_no) for peer, state in peers.items()
        }
        outcome = aggregate(rule, world, models, round_no=round_no)
        out = set(outcome.diagnostics["screened_out"])
        assert set(world.attackers) - {"labelflip"} <= out, round_no
        own = rule._scores(world.honest["h0"], world.data).losses
        assert not worse_beyond_noise(own, rule._scores(outcome.state, world.data).losses)
    assert not set(outcome.weights) & set(world.attackers), outcome.weights
    assert set(world.attackers) <= out
    assert rule.layouts("model") == rule.rule.layouts("model")


def test_screen_false_builds_the_papers_rule_unchanged(world):
    assert (
        type(build_rule("fedavg", {"screen": False}, world.context("fedavg"))).__name__ == "FedAvg"
    )
    assert isinstance(build_rule("fedavg", {}, world.context("fedavg")), Screened)
    assert type(build_rule("local", {}, world.context("local"))).__name__ == "Local"


def test_fedavg_runs_trials_only_when_asked_and_only_behind_screening(world):
    assert build_rule("fedavg", {}, world.context("fedavg")).trials is False
    assert build_rule("fedavg", {"trials": True}, world.context("fedavg")).trials is True
    with pytest.raises(ValueError, match="algorithm.trials: got True with screen: false"):
        build_rule("fedavg", {"trials": True, "screen": False}, world.context("fedavg"))
    with pytest.raises(ValueError, match="algorithm.trials: got 'yes'; allowed: true or false"):
        build_rule("fedavg", {"trials": "yes"}, world.context("fedavg"))
    with pytest.raises(ValueError, match="algorithm.trials: .*local takes no peer models"):
        build_rule("local", {"trials": False}, world.context("local"))
    rule = screened(world, "fedavg")
    first = aggregate(rule, world, {"h1": world.honest["h1"], "bad": world.attackers["scale"]})
    assert "on_trial" not in first.diagnostics["screening"], "off: nothing is put on trial"


def test_fedc2i_runs_trials_unless_told_not_to(world):
    """FedC²I's help on feature shift shows only rounds after it is mixed in, so its
    trials are on by default; screen: false alone still gives the paper's rule."""
    context = world.context("fedc2i")
    assert build_rule("fedc2i", {}, context).trials is True
    assert build_rule("fedc2i", {"trials": False}, context).trials is False
    assert type(build_rule("fedc2i", {"screen": False}, context)).__name__ == "FedC2I"
    assert screening_setting("fedc2i", {"screen": False}) == {"screen": False, "trials": False}


class _AddsNoise(PeerAlgorithm):
    """A rule whose aggregate is the own model plus noise: what the guard is for."""

    name = "base"

    def aggregate(self, round_no, own, received, data):
        noisy = noise_like(own.state, torch.Generator().manual_seed(0))
        return Aggregate(noisy, {"h0": 0.5, **{peer: 0.5 for peer in received["model"]}})


def test_the_guard_keeps_the_own_model_when_the_rules_aggregate_validates_worse(world):
    rule = Screened(_AddsNoise(None, world.context("noise")))
    outcome = aggregate(rule, world, {"h1": world.honest["h1"]})
    assert outcome.weights == {"h0": 1.0}
    assert outcome.diagnostics["screening"]["adopted"] is False
    assert all(torch.equal(outcome.state[k], world.honest["h0"][k]) for k in outcome.state)


def test_pfedsv_guards_once_its_val_guard_being_the_screening_guard(world):
    rule = screened(world, "pfedsv", k=2, k_max=2)
    outcome = aggregate(rule, world, {"h1": world.honest["h1"], "h2": world.honest["h2"]})
    assert "val_loss_aggregate" not in outcome.diagnostics["screening"]
    unguarded = screened(world, "pfedsv", k=2, k_max=2, val_guard=False)
    outcome = aggregate(unguarded, world, {"h1": world.honest["h1"], "h2": world.honest["h2"]})
    if outcome.diagnostics["screened_out"].keys() != {"h1", "h2"}:
        assert "adopted" in outcome.diagnostics["screening"]


def test_pfedsv_behind_screening_settles_k_on_the_peers_it_admits(world):
    """The peers screening keeps out never reach pFedSV's game; they must still count
    as scored (and irrelevant), or k never leaves its start and the node keeps
    downloading models that screening throws away (the paper's dynamic k: the default
    explores from the first round, tested with pFedSV)."""
    rule = screened(world, "pfedsv", explore=False, k_max=5)
    peers = {**{p: s for p, s in world.honest.items() if p != "h0"}, **world.attackers}
    kept_out: set[str] = set()
    # Five of the six peers, then the rest: all met once; then a third round, for the
    # set of relevant peers to come out of an update unchanged once every record that
    # slight harm only began (the label flipper's) has put its peer out.
    for round_no in (1, 2, 3):
        wanted = rule.wanted(round_no, {"model": sorted(peers)})["model"]
        models = {  # new models every round, or the second would be a replay
            peer: fresh(peers[peer], round_no) for peer in wanted
        }
        outcome = aggregate(rule, world, models, round_no=round_no)
        kept_out |= set(outcome.diagnostics["screened_out"])
    assert set(world.attackers) <= kept_out
    pfedsv = rule.rule  # the wrapped rule's own state
    assert set(world.attackers) <= pfedsv.explored
    assert all(pfedsv.relevance[peer] <= 0 for peer in world.attackers)
    relevant = [peer for peer, score in pfedsv.relevance.items() if score > 0]
    assert 1 <= outcome.diagnostics["k_next"] == len(relevant) < 5


def test_pfedsv_behind_screening_by_default_downloads_one_peer_beyond_those_that_help(world):
    """The default (`explore`): k is the peers the game values and one more, the peers
    screening keeps out counting as valued at most 0, and no attacker holds weight."""
    rule = screened(world, "pfedsv")
    peers = {**{p: s for p, s in world.honest.items() if p != "h0"}, **world.attackers}
    for round_no in (1, 2, 3, 4):
        wanted = rule.wanted(round_no, {"model": sorted(peers)})["model"]
        models = {peer: fresh(peers[peer], round_no) for peer in wanted}
        outcome = aggregate(rule, world, models, round_no=round_no)
        assert len(wanted) == outcome.diagnostics["k"]
        assert not set(outcome.weights) & set(world.attackers)
    relevant = [peer for peer, score in rule.rule.relevance.items() if score > 0]
    assert not set(relevant) & set(world.attackers)
    assert outcome.diagnostics["k_next"] == len(relevant) + 1


def test_a_model_three_times_the_rounds_median_distance_is_kept_out_once_three_came():
    base = {"w": torch.zeros(4)}

    def at(length):
        return {"w": torch.tensor([length, 0.0, 0.0, 0.0])}

    near = {"a": at(1.0), "b": at(1.2), "c": at(0.9)}
    assert far_models(base, near) == set()
    assert far_models(base, {**near, "scaled": at(3.7)}) == {"scaled"}, "3.7 > 3 x 1.1"
    assert far_models(base, {**near, "edge": at(3.0)}) == set(), "3.0 <= 3 x 1.1"
    assert far_models(base, {**near, "nan": {"w": torch.full((4,), float("nan"))}}) == {"nan"}
    assert far_models(base, {"one": at(100.0)}) == set(), "alone, nothing to stand out from"
    assert far_models(base, {"a": at(1.0), "scaled": at(100.0)}) == set(), "nor of two"
    assert far_models(base, {}) == set()


def test_a_peer_kept_out_for_distance_twice_is_not_fetched_next_round(world):
    rule = screened(world, "fedavg")
    honest = [p for p in world.honest if p != "h0"]
    for round_no in (1, 2):  # new models each round, or the second would be a replay
        peers = {p: fresh(world.honest[p], round_no) for p in honest}
        big = fresh(world.attackers["scale"], round_no)
        assert "big" in rule.wanted(round_no, {"model": ["big", *honest]})["model"]
        outcome = aggregate(rule, world, {**peers, "big": big}, round_no=round_no)
        assert outcome.diagnostics["screened_out"] == {"big": "distance"}
    assert rule.wanted(3, {"model": ["big", *honest]})["model"] == honest


def test_each_peer_is_judged_at_its_share_of_an_equal_average_of_the_models_judged(world):
    """Mixed at its share (here a third: two peers judged, with the own model), not half
    and half: the record is that of the mix at that share. Copies kept out first do not
    shrink it."""
    peers = {p: s for p, s in world.honest.items() if p != "h0"}
    copies_of_one = {"c1": world.attackers["noise"], "c2": world.attackers["noise"]}
    rule = screened(world, "fedavg")
    outcome = aggregate(rule, world, {**peers, **copies_of_one}, round_no=1)
    assert outcome.diagnostics["screened_out"] == {"c1": "copy", "c2": "copy"}
    own = world.honest["h0"]
    for peer, state in peers.items():
        mix = weighted_average({"own": own, peer: state}, {"own": 2 / 3, peer: 1 / 3})
        differences = rule._scores(mix, world.data).losses - rule._scores(own, world.data).losses
        assert outcome.diagnostics["evidence"][peer] == round(harm_z(differences), 3), peer


def test_screening_reports_the_verdict_of_a_rule_that_guards_its_own_aggregate(world):
    """pFedSV judges its Shapley-weighted average with the screening guard itself; the
    verdict must reach screening's report, where the run's decision phrase counts the
    aggregates refused, as it does for every other rule."""
    rule = screened(world, "pfedsv", k=2, k_max=2)
    peers = {p: s for p, s in world.honest.items() if p != "h0"}
    outcome = aggregate(rule, world, peers, round_no=1)
    assert outcome.diagnostics["adopted"] in (True, False)
    assert outcome.diagnostics["screening"]["adopted"] == outcome.diagnostics["adopted"]
    own = torch.tensor([[4.0, 0.0], [0.0, 4.0]])
    assert pfedsv_guard(own, own, torch.tensor([0, 1]))[1]["adopted"] is True
    wrong = torch.tensor([[0.0, 4.0], [4.0, 0.0]])
    assert pfedsv_guard(own, wrong, torch.tensor([0, 1]))[1]["adopted"] is False


def test_a_sketch_keeps_distances_and_is_a_nodes_own_draw():
    """Sketches estimate distances (the copy check's scale is one of them): within a
    fifth for a difference spread over a model, a small tensor beside a large one
    included; one node's sketch of a model is the same every time, another node's is
    drawn apart."""
    generator = torch.Generator().manual_seed(0)
    base = {  # the head's share of 4,096 reads rounds to none: it is read 10 times
        "body": torch.randn(500_000, generator=generator),
        "head": torch.randn(10, generator=generator),
    }
    moved = {
        key: value + 0.01 * torch.randn(value.shape, generator=generator)
        for key, value in base.items()
    }
    headed = {**base, "head": base["head"] + torch.eye(10)[3]}  # one float of the head
    sketch = Sketcher(seed=1)
    for other in (moved, headed):
        true = sum(float((other[key] - base[key]).pow(2).sum()) for key in base) ** 0.5
        assert float(torch.dist(sketch(base), sketch(other))) == pytest.approx(true, rel=0.2)
    assert torch.equal(sketch(base), Sketcher(seed=1)(base))
    assert not torch.equal(sketch(base), Sketcher(seed=2)(base))
    assert sketch({"steps": torch.tensor(3)}) is None, "a model without floats has none"


def test_each_outcome_is_set_aside_and_read_back_once_as_the_next_rounds_start(world):
    """The node holds the round start in a file (node/set_aside.py): screening must not
    keep a copy of its own, and must read the one it set aside."""
    calls = []

    def set_aside(state):
        copy = cloned(state)
        calls.append("set aside")

        def read():
            calls.append("read")
            return copy

        return read

    context = dataclasses.replace(world.context("fedavg"), set_aside=set_aside)
    rule = Screened(algorithm_class("fedavg")(parse_params("fedavg", {}, None), context))

    def round_of(round_no):
        received = {
            "model": {p: PeerModel(s, world.n) for p, s in noisy_round(world, round_no).items()}
        }
        return rule.aggregate(
            round_no, PeerModel(world.honest["h0"], world.n), received, world.data
        )

    round_of(2)
    assert calls == ["set aside"]
    round_of(3)
    assert calls == ["set aside", "read", "set aside"]
