"""The Byzantine-robust baselines on tensors whose answers are known."""

from __future__ import annotations

import pytest
import torch

from meshfl.algorithms import Context, PeerModel, algorithm_class, parse_params
from meshfl.algorithms.robust import coordinate_median, krum_scores, trimmed_mean
from tests.algorithms.config_lines import params_error


def states(*rows):
    return [
        {"w": torch.tensor(row, dtype=torch.float32), "steps": torch.tensor(i)}
        for i, row in enumerate(rows)
    ]


def rule(name, **params):
    return algorithm_class(name)(parse_params(name, params), Context("me", 0, 2, (), ()))


def round_of(rule_, own, peers):
    received = {"model": {name: PeerModel(state, 10**9) for name, state in peers.items()}}
    return rule_.aggregate(1, PeerModel(own, 1), received, None)


def test_the_median_of_known_tensors_is_the_lower_middle_value_per_coordinate():
    median, shares = coordinate_median(states([1, 50], [2, -7], [100, 3], [4, 4]))
    assert median["w"].tolist() == [2, 3]
    assert shares == [0.0, 0.5, 0.5, 0.0]


def test_the_trimmed_mean_drops_the_extremes_of_each_coordinate():
    mean, shares = trimmed_mean(states([1, 10], [2, 20], [3, 30], [1000, -1000], [4, 40]), 0.2)
    assert mean["w"].tolist() == pytest.approx([3.0, 20.0])
    assert sum(shares) == pytest.approx(1.0) and shares[3] == 0.0


def test_krum_scores_an_outlier_worst():
    scores = krum_scores(states([0, 0], [0, 1], [1, 0], [50, 50]), f=1)
    assert max(range(4), key=scores.__getitem__) == 3


@pytest.mark.parametrize(
    ("name", "params"),
    [("median", {}), ("trimmed_mean", {"beta": 0.25}), ("krum", {}), ("multikrum", {})],
)
def test_each_robust_rule_keeps_two_attackers_out_whatever_they_claim(name, params):
    honest = {f"h{i}": {"w": torch.tensor([1.0 + 0.1 * i, 2.0 - 0.1 * i])} for i in range(5)}
    attackers = {"a1": {"w": torch.tensor([1e6, -1e6])}, "a2": {"w": torch.tensor([1e6, -1e6])}}
    # 8 models, 2 of them an attacker's: trimmed_mean must drop 2 at each end.
    outcome = round_of(
        rule(name, **params), {"w": torch.tensor([1.2, 1.8])}, {**honest, **attackers}
    )
    assert outcome.state["w"].abs().max() < 3, "the attackers' values did not get in"
    assert sum(outcome.weights.values()) == pytest.approx(1.0)
    assert outcome.weights.get("a1", 0) == outcome.weights.get("a2", 0) == 0


def test_krum_picks_from_the_honest_cluster_and_multikrum_averages_it():
    honest = {f"h{i}": {"w": torch.tensor([float(i), 0.0])} for i in range(4)}
    attackers = {f"a{i}": {"w": torch.tensor([100.0 + i, 100.0])} for i in range(2)}
    own = {"w": torch.tensor([1.5, 0.0])}
    krum = round_of(rule("krum", f=2), own, {**honest, **attackers})
    assert len(krum.weights) == 1 and not set(krum.weights) & set(attackers)
    multi = round_of(rule("multikrum", f=2), own, {**honest, **attackers})
    assert set(multi.weights) == {"me", *honest}
    assert multi.state["w"].tolist() == pytest.approx([1.5, 0.0])


def test_krum_on_a_small_mesh_lowers_f_to_what_the_models_allow():
    # 4 models and f = 2: each model needs n - f - 2 >= 1 neighbours, so f is 1 here.
    honest = {"h1": {"w": torch.tensor([1.1])}, "h2": {"w": torch.tensor([0.9])}}
    outcome = round_of(
        rule("krum", f=2),
        {"w": torch.tensor([1.0])},
        {**honest, "bad": {"w": torch.tensor([50.0])}},
    )
    assert outcome.weights.keys() <= {"me", "h1", "h2"} and len(outcome.weights) == 1


def test_too_few_models_for_krum_keep_the_own_model_and_its_integer_buffers():
    own = {"w": torch.tensor([1.0]), "steps": torch.tensor(7)}
    outcome = round_of(
        rule("krum", f=0), own, {"p": {"w": torch.tensor([5.0]), "steps": torch.tensor(99)}}
    )
    assert outcome.weights == {"me": 1.0}
    assert outcome.state["w"].tolist() == [1.0] and int(outcome.state["steps"]) == 7


@pytest.mark.parametrize(
    ("name", "raw", "field"),
    [
        ("trimmed_mean", {"beta": 0.5}, "beta"),
        ("krum", {"f": -1}, "f"),
        ("multikrum", {"m": -2}, "m"),
    ],
)
def test_bad_parameters_name_the_field(name, raw, field):
    assert f"'algorithm.{field}'" in params_error(name, raw)
