"""The experiment tables report what the issues ask to see: FedReMa's own-group share in
every round of the critical co-learning period, and what a round costs a node."""

import argparse
import json

import pytest

from meshfl.launch.experiments import render_table
from meshfl.launch.local import (
    _average_below_own,
    _influence_shape,
    _round_costs,
    _shapley_by_label_overlap,
    _top_k_precision,
)

SPEC = {"title": "t", "caps": "c", "nodes": 2}


def summary(accuracy, shares=None, cost=None):
    nodes = [{"name": f"node{i}", "test_acc": accuracy, "data": {}} for i in range(2)]
    result = {"nodes": nodes, "mean_test_acc": accuracy}
    if shares:
        result.update(own_group_share=shares,
                      own_group_share_ccp=sum(shares.values()) / len(shares))
    if cost:
        result["cost"] = cost
    return result


def test_the_table_shows_the_share_per_ccp_round_and_its_lowest_value_over_seeds():
    runs = {"Local": [summary(0.8), summary(0.8)],
            "FedReMa": [summary(0.9, {"1": 1.0, "2": 0.75}), summary(0.9, {"1": 0.5})]}
    table = render_table(SPEC, runs, [0, 1], argparse.Namespace(name="x", data_root=None))
    assert ("| own-group share of relevant sets, lowest CCP round (lowest over seeds) |  | 0.500 |"
            in table)
    assert "| own-group share of relevant sets in the CCP (mean over seeds) |  | 0.688 |" in table
    assert "- FedReMa, seed 0, rounds 1-2: 1.00 0.75" in table
    assert "- FedReMa, seed 1, rounds 1-1: 0.50" in table
    assert "Local, seed" not in table


def test_the_table_shows_the_median_cost_of_a_round_where_it_was_measured():
    runs = {"FedAvg": [summary(0.8, cost={"mb_in_per_round": 5.5})],
            "pFedSV": [summary(0.9, cost={"mb_in_per_round": 1.25, "shapley_to_train": 0.3})]}
    table = render_table(SPEC, runs, [0], argparse.Namespace(name="x", data_root=None))
    assert "| MB received per node and round (median) | 5.50 | 1.25 |" in table
    assert "| Shapley seconds per training second (median) |  | 0.300 |" in table
    assert "| mean (std over seeds) | **80.0** | **90.0** |" in table, "no spread of one seed"


def test_round_costs_are_medians_over_every_complete_node_round(tmp_path):
    rounds = {"a": [(2e6, 4.0, 1.0), (1e6, 2.0, 1.0), (1e6, 2.0, 0.5)],
              "b": [(3e6, 4.0, None)]}
    for name, records in rounds.items():
        (tmp_path / name).mkdir()
        lines = []
        for bytes_in, train, shapley in records:
            diagnostics = {} if shapley is None else {"shapley_seconds": shapley}
            lines.append(json.dumps({"bytes_in": bytes_in, "seconds": {"train": train},
                                     "diagnostics": diagnostics}))
        cut_short = '{"bytes_in": 9e9, "seco'  # the line a crash left half-written
        (tmp_path / name / "metrics.jsonl").write_text("\n".join([*lines, cut_short]) + "\n")
    cost = _round_costs(tmp_path, ["a", "b", "missing"])
    assert cost == {"mb_in_per_round": 1.5, "shapley_to_train": 0.25}


def test_top_k_precision_scores_the_last_pull_against_shared_labels():
    nodes = [{"name": name, "data": {"labels": labels}}
             for name, labels in [("a", [0, 1]), ("b", [1, 2]), ("c", [3, 4]), ("d", [5, 6])]]
    scores = _top_k_precision(nodes, {"a": ["b", "d"], "b": ["a"]})
    assert scores == {"top_k_precision": (0.5 + 1.0) / 2}
    assert _top_k_precision(nodes, {}) == {}


def test_shapley_values_and_weights_are_split_by_whether_a_peer_shares_a_label(tmp_path):
    nodes = [{"name": name, "data": {"labels": labels}}
             for name, labels in [("a", [0, 1]), ("b", [1, 2]), ("c", [3, 4])]]
    rounds = [{"diagnostics": {"shapley": {"a": 0.6, "b": 0.3, "c": -0.1}},
               "weights": {"a": 0.7, "b": 0.3}},
              {"diagnostics": {"shapley": {"a": 0.8, "b": 0.1, "c": -0.3}},
               "weights": {"a": 0.9, "b": 0.1}},
              {"diagnostics": {}, "weights": {"a": 1.0}}]  # a rule without a game
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text(
        "\n".join(json.dumps(record) for record in rounds) + "\n")
    scores = _shapley_by_label_overlap(tmp_path, nodes)
    assert scores["shapley_sharing_a_label"] == pytest.approx(0.2)
    assert scores["shapley_sharing_no_label"] == pytest.approx(-0.2)
    assert scores["weight_on_label_sharing_peers"] == pytest.approx(0.2)


def test_influence_shape_is_the_own_share_of_lambda_and_the_class_peak_of_big_lambda(tmp_path):
    # Three models, two classes: the own share is not the largest, rows are not columns.
    shaped = {"diagnostics": {"influence_vector": {"a": 0.2, "b": 0.5, "c": 0.3},
                              "influence_matrix": {"a": [0.6, 0.7], "b": [0.3, 0.2],
                                                   "c": [0.1, 0.1]}}}
    alone = {"diagnostics": {"influence_vector": {"a": 1.0}, "influence_matrix": {"a": [1.0, 1.0]}}}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text(f"{json.dumps(shaped)}\n{json.dumps(alone)}\n")
    scores = _influence_shape(tmp_path, ["a"])
    assert scores["influence_own_share"] == pytest.approx(0.2), "a round alone says nothing"
    assert scores["class_influence_peak"] == pytest.approx((0.6 * 3 + 0.7 * 3) / 2)
    assert _influence_shape(tmp_path, ["nobody"]) == {}


def test_average_below_own_reads_the_guarded_average_where_there_is_one(tmp_path):
    rounds = [{"val_acc": 0.8, "diagnostics": {"v_own": 0.9}},  # the average was adopted
              {"val_acc": 0.9, "diagnostics": {"v_own": 0.9, "v_aggregate": 0.7}},  # kept own
              {"val_acc": 0.95, "diagnostics": {"v_own": 0.9}},
              {"val_acc": 0.9, "diagnostics": {"v_own": 0.9}},  # a tie is not below
              {"val_acc": 0.5, "diagnostics": {}}]  # a rule that records no v_own
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text(
        "\n".join(json.dumps(record) for record in rounds) + "\n")
    assert _average_below_own(tmp_path, ["a"]) == {"average_below_own": pytest.approx(2 / 4)}
