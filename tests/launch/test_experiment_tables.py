"""`meshfl experiment` and its tables: they report what the issues ask to see (FedReMa's
own-group share in every round of the critical co-learning period, what a round costs a
node, why a rule helped or hurt), and a rerun keeps finished runs, but only those made
with the same settings."""

import argparse
import json
from dataclasses import replace

import pytest

from meshfl.launch.errors import UserError
from meshfl.launch.experiment_runs import (
    _differences,
    _planned_config,
    _what_decides_results,
    available,
    load_experiment,
    only,
    render_robustness,
    render_table,
)
from meshfl.launch.measures import (
    attacker_weight,
    influence_shape,
    own_group_share,
    own_versus_average,
    round_costs,
    screening_trials,
    shapley_by_label_overlap,
    top_k_precision,
)
from meshfl.launch.run_folder import RunRecords, node_records
from meshfl.node.config import AlgorithmConfig, MeshConfig, explicit_params
from meshfl.node.metrics import CoordinatorRecord, RoundRecord
from tests.spawn import run_to_end

SPEC = {"title": "t", "caps": "c", "nodes": 2, "seeds": [0, 1, 2]}


def test_every_table_but_the_codecs_own_runs_its_blobs_as_float32():
    # The docs' figures are the rules' own: the default codec (int8) must not move them.
    assert MeshConfig().compression == "int8"
    for name in available():
        spec = load_experiment(name)
        if name.startswith("compression-"):
            codecs = {variant[0] for variant in spec["variants"].values()}
            assert "compression=none" in codecs, name
        else:
            assert spec["config"]["compression"] == "none", name


def summary(accuracy, shares=None, cost=None):
    nodes = [{"name": f"node{i}", "test_acc": accuracy, "data": {}} for i in range(2)]
    result = {"nodes": nodes, "mean_test_acc": accuracy}
    if shares:
        result.update(
            own_group_share=shares,
            own_group_share_ccp=sum(shares.values()) / len(shares),
            own_group_share_lowest=min(shares.values()),
        )
    if cost:
        result["cost"] = cost
    return result


def test_the_table_shows_the_share_per_ccp_round_and_its_lowest_value_over_seeds():
    runs = {
        "Local": [summary(0.8), summary(0.8)],
        "FedReMa": [summary(0.9, {"1": 1.0, "2": 0.75}), summary(0.9, {"1": 0.5})],
    }
    table = render_table(SPEC, runs, [0, 1], argparse.Namespace(name="x", data_root=None))
    assert (
        "| own-group share of relevant sets, lowest CCP round (lowest over seeds) |  | 0.500 |"
        in table
    )
    assert "| own-group share of relevant sets in the CCP (mean over seeds) |  | 0.688 |" in table
    assert "- FedReMa, seed 0, rounds 1-2: 1.00 0.75" in table
    assert "- FedReMa, seed 1, rounds 1-1: 0.50" in table
    assert "Local, seed" not in table


def test_a_table_made_with_overrides_names_them_beside_its_caps_and_in_its_command():
    """A table made with `--seeds` or `--set` is no table of the experiment's own settings: its caps
    must not read as if it were, and its command must make it again."""
    runs = {"Local": [summary(0.8)], "FedReMa": [summary(0.9)]}
    args = argparse.Namespace(
        name="x", data_root="d", seeds="30", assignments=["data.samples_per_node=200"]
    )
    table = render_table(SPEC, runs, [30], args)
    assert (
        f"Caps: {SPEC['caps']} Overridden here: seeds 30 (the experiment's: 0, 1, 2);"
        " data.samples_per_node=200." in table
    ), "the caps name the experiment's own seeds beside the ones used"
    assert (
        "Regenerate: `meshfl experiment x --data-root DIR --seeds 30"
        " --set data.samples_per_node=200`" in table
    )
    plain = render_table(SPEC, runs, [0], argparse.Namespace(name="x", data_root=None))
    assert "Overridden" not in plain and "Regenerate: `meshfl experiment x`" in plain


def test_the_table_shows_the_median_cost_of_a_round_where_it_was_measured():
    runs = {
        "FedAvg": [summary(0.8, cost={"mb_in_per_round": 5.5})],
        "pFedSV": [summary(0.9, cost={"mb_in_per_round": 1.25, "shapley_to_train": 0.3})],
    }
    table = render_table(SPEC, runs, [0], argparse.Namespace(name="x", data_root=None))
    assert "| MB received per node and round (median) | 5.50 | 1.25 |" in table
    assert "| Shapley seconds per training second (median) |  | 0.300 |" in table
    assert "| mean (std over seeds) | **80.0** | **90.0** |" in table, "no spread of one seed"


def test_the_table_shows_each_variants_worst_node_as_the_mean_over_seeds():
    runs = {
        "Local": [{**summary(0.8), "worst_test_acc": 0.5}, {**summary(0.8), "worst_test_acc": 0.7}],
        "FedAvg": [summary(0.9), summary(0.9)],  # a summary of an older version: none
    }
    table = render_table(SPEC, runs, [0, 1], argparse.Namespace(name="x", data_root=None))
    assert "| worst node (mean over seeds) | 60.0 |  |" in table


def run_of(history: dict[str, list[RoundRecord]], **labels: set[int]) -> RunRecords:
    """A run of `history` whose nodes' train splits hold `labels`."""
    return RunRecords(
        history, data={name: {"labels": sorted(held)} for name, held in labels.items()}
    )


def rounds_of(*records: dict) -> list[RoundRecord]:
    """Records of rounds 1, 2, ... holding the fields of `records`."""
    return [RoundRecord(round=number, **fields) for number, fields in enumerate(records, 1)]


def test_the_share_is_scored_over_ccp_rounds_only():
    groups = {"a1": {"group": 0}, "a2": {"group": 0}, "b1": {"group": 1}}
    coordinator = [
        CoordinatorRecord(1, {"ccp": True, "relevant_sets": {"a1": ["a1", "a2"]}}),
        CoordinatorRecord(2, {"ccp": True, "relevant_sets": {"a1": ["a1", "a2", "b1"]}}),
        CoordinatorRecord(3, {"ccp": False, "relevant_sets": {"a1": ["a1", "b1"]}}),
    ]
    scores = own_group_share(RunRecords({}, coordinator, data=groups))
    assert scores["own_group_share"] == {"1": 1.0, "2": 0.5}
    assert scores["own_group_share_ccp"] == pytest.approx(0.75)
    assert scores["own_group_share_lowest"] == 0.5


def test_records_skip_a_line_a_crash_left_half_written(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\n{"round": 2}\n{"round": 3, "seco\n')
    assert node_records(tmp_path) == [RoundRecord(round=1), RoundRecord(round=2)]
    assert node_records(tmp_path / "missing") == []


def test_round_costs_are_medians_over_every_node_round():
    def record(bytes_in, train, shapley=None):
        diagnostics = {} if shapley is None else {"shapley_seconds": shapley}
        return {"bytes_in": bytes_in, "seconds": {"train": train}, "diagnostics": diagnostics}

    history = {
        "a": rounds_of(record(2e6, 4.0, 1.0), record(1e6, 2.0, 1.0), record(1e6, 2.0, 0.5)),
        "b": rounds_of(record(3e6, 4.0), {}),
        "missing": [],
    }
    assert round_costs(RunRecords(history)) == {"mb_in_per_round": 1.5, "shapley_to_train": 0.25}


def test_screening_trials_are_counted_over_screened_node_rounds():
    def screened(won=None):
        trial = {} if won is None else {"trial": {"won": won}}
        return {"diagnostics": {"screening": {"judged": True, **trial}}}

    history = {
        "a": rounds_of(screened(), screened(True), screened(False)),
        "b": rounds_of(screened(True), {}),  # a round without screening counts for nothing
    }
    expected = {"trial_rounds": 0.75, "trials_won": pytest.approx(2 / 3)}
    assert screening_trials(RunRecords(history)) == expected
    attacked = {**history, "bad": rounds_of(screened(True), screened(True))}
    assert screening_trials(RunRecords(attacked, attackers=frozenset({"bad"}))) == expected, (
        "an attacker's own rounds count for nothing"
    )
    assert screening_trials(RunRecords({"a": rounds_of(screened())})) == {}, "trials off: no row"
    assert screening_trials(RunRecords({"a": rounds_of({})})) == {}, "the paper's rule: no row"


def test_attacker_weight_counts_what_came_in_through_a_won_trial():
    """A node that carried on from a screening trial holds the trial's peers at the
    weight the round gave its own model: an attacker let in on trial is counted."""

    def weighed(weights, trial=None):
        screening = {} if trial is None else {"trial": trial}
        return {"weights": weights, "diagnostics": {"screening": screening}}

    won = {"won": True, "weights": {"a": 0.5, "bad": 0.5}}
    lost = {"won": False}
    history = {
        "a": rounds_of(
            weighed({"a": 0.8, "h": 0.2}, won),  # 0.8 * 0.5 through the trial
            weighed({"a": 0.5, "bad": 0.5}, lost),
            weighed({"a": 1.0}),
        ),
        "bad": rounds_of(weighed({"bad": 1.0})),  # an attacker's own rounds count for nothing
    }
    scores = attacker_weight(RunRecords(history, attackers=frozenset({"bad"})))
    assert scores == {"attacker_weight": pytest.approx((0.4 + 0.5 + 0.0) / 3)}


def test_top_k_precision_scores_the_last_pull_against_shared_labels():
    labels = {"a": {0, 1}, "b": {1, 2}, "c": {3, 4}, "d": {5, 6}}

    def chose(*peers):
        return {"diagnostics": {"selected": list(peers)}}

    history = {
        "a": rounds_of(chose("c"), chose("b", "d")),
        "b": rounds_of(chose("a")),
        "c": rounds_of({}),
        "d": [],
    }
    assert top_k_precision(run_of(history, **labels)) == {"top_k_precision": (0.5 + 1.0) / 2}
    assert top_k_precision(run_of({"a": rounds_of({})}, **labels)) == {}


def test_shapley_values_and_weights_are_split_by_whether_a_peer_shares_a_label():
    labels = {"a": {0, 1}, "b": {1, 2}, "c": {3, 4}}
    rounds = rounds_of(
        {
            "diagnostics": {"shapley": {"a": 0.6, "b": 0.3, "c": -0.1}},
            "weights": {"a": 0.7, "b": 0.3},
        },
        {
            "diagnostics": {"shapley": {"a": 0.8, "b": 0.1, "c": -0.3}},
            "weights": {"a": 0.9, "b": 0.1},
        },
        {"diagnostics": {}, "weights": {"a": 1.0}},
    )  # a rule without a game
    scores = shapley_by_label_overlap(run_of({"a": rounds}, **labels))
    assert scores["shapley_sharing_a_label"] == pytest.approx(0.2)
    assert scores["shapley_sharing_no_label"] == pytest.approx(-0.2)
    assert scores["weight_on_label_sharing_peers"] == pytest.approx(0.2)


def test_influence_shape_is_the_own_share_of_lambda_and_the_class_peak_of_big_lambda():
    # Three models, two classes: the own share is not the largest, rows are not columns.
    shaped = {
        "diagnostics": {
            "influence_vector": {"a": 0.2, "b": 0.5, "c": 0.3},
            "influence_matrix": {"a": [0.6, 0.7], "b": [0.3, 0.2], "c": [0.1, 0.1]},
        }
    }
    alone = {"diagnostics": {"influence_vector": {"a": 1.0}, "influence_matrix": {"a": [1.0, 1.0]}}}
    scores = influence_shape(RunRecords({"a": rounds_of(shaped, alone)}))
    assert scores["influence_own_share"] == pytest.approx(0.2), "a round alone says nothing"
    assert scores["class_influence_peak"] == pytest.approx((0.6 * 3 + 0.7 * 3) / 2)
    assert influence_shape(RunRecords({"a": []})) == {}


def test_own_versus_average_reads_the_guarded_average_and_counts_adopted_averages():
    averaged, own = {"a": 0.6, "b": 0.4}, {"a": 1.0}
    rounds = rounds_of(
        {"val_acc": 0.8, "weights": averaged, "diagnostics": {"v_own": 0.9}},
        {
            "val_acc": 0.9,
            "weights": own,  # the guard kept the own model
            "diagnostics": {"v_own": 0.9, "v_aggregate": 0.7},
        },
        {"val_acc": 0.95, "weights": averaged, "diagnostics": {"v_own": 0.9}},
        {"val_acc": 0.9, "weights": averaged, "diagnostics": {"v_own": 0.9}},  # a tie is not below
        {"val_acc": 0.5, "weights": averaged, "diagnostics": {}},
    )  # no v_own
    assert own_versus_average(RunRecords({"a": rounds})) == {
        "average_below_own": pytest.approx(2 / 4),
        "average_adopted": pytest.approx(3 / 4),
    }


def test_only_cuts_an_experiment_to_the_columns_named_in_its_own_order():
    spec = {"variants": {"Local": ["a"], "FedAvg": ["b"], "FedAvg screened": ["c"]}}
    assert only(spec, []) is spec
    assert only(spec, ["FedAvg screened", "Local"])["variants"] == {
        "Local": ["a"],
        "FedAvg screened": ["c"],
    }
    grid = {"rules": {"Local": [], "Krum": []}, "attacks": {"none": []}, "attackers": ["n1"]}
    assert list(only(grid, ["Krum"])["rules"]) == ["Krum"]
    with pytest.raises(UserError, match="'Fedavg' is no column.*allowed: Local, FedAvg"):
        only(spec, ["Fedavg"])


def test_an_unknown_column_stops_an_experiment_before_it_runs_anything(tmp_path):
    options = ["--only", "Local", "--only", "nope", "--out", str(tmp_path / "out")]
    done = run_to_end(["experiment", "smoke-digits", *options], timeout=60)
    assert done.returncode != 0
    assert "--only 'nope' is no column of this experiment; allowed: Local, FedAvg" in done.stderr
    assert not (tmp_path / "out" / "local").exists()


def test_an_experiment_runs_each_variant_once_and_a_rerun_keeps_and_rescores_them(tmp_path):
    out = tmp_path / "smoke"

    def experiment(rounds=2, check=True):
        command = ["experiment", "smoke-digits", "--seeds", "0", "--set", f"rounds={rounds}"]
        done = run_to_end([*command, "--out", str(out)], timeout=240)
        if check:
            assert done.returncode == 0, done.stderr
        return done.stdout if check else done

    first = experiment()
    assert "done before" not in first
    table = (out / "table.md").read_text()
    assert "| node | Local | FedAvg |" in table and "| mean (std over seeds) | **" in table
    kept = out / "fedavg" / "seed0" / "summary.json"
    written = json.loads(kept.read_text())
    kept.write_text(json.dumps({key: value for key, value in written.items() if key != "cost"}))
    second = experiment()
    assert second.count("done before, kept") == 2
    assert json.loads(kept.read_text()) == written, "a kept run is summarized again"
    assert (out / "table.md").read_text() == table
    changed = experiment(rounds=3, check=False)
    assert changed.returncode != 0
    assert (
        f"{out / 'local' / 'seed0'} holds a run made with other settings (rounds: 2 there, 3 now)"
    ) in changed.stderr
    assert (out / "table.md").read_text() == table, "nothing was rerun or overwritten"
    (out / "local" / "seed0" / "summary.json").unlink()  # as if it had been interrupted
    interrupted = experiment(rounds=3, check=False)
    assert interrupted.returncode != 0, "an interrupted run does not resume under new settings"
    assert "(rounds: 2 there, 3 now)" in interrupted.stderr


def test_a_run_writes_out_every_rule_parameter_and_a_changed_default_reads_as_a_difference(
    tmp_path,
):
    base = tmp_path / "base.yaml"
    base.write_text("rounds: 1\n")
    planned = _planned_config(base, ["algorithm=pfedsv"], nodes=2)
    assert planned.algorithm.params == explicit_params(AlgorithmConfig("pfedsv", {}), rounds=1)
    assert planned.algorithm.params["val_guard"] is True and "alpha" in planned.algorithm.params
    # A run saved with the guard off, read today when the default is on: a difference.
    saved_then = replace(
        planned,
        algorithm=AlgorithmConfig("pfedsv", {**planned.algorithm.params, "val_guard": False}),
    )
    assert _differences(_what_decides_results(saved_then), _what_decides_results(planned)) == [
        "algorithm.params.val_guard: False there, True now"
    ]


def test_where_data_lay_and_timeouts_do_not_count_but_the_number_of_nodes_does(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("rounds: 1\n")
    planned = _planned_config(base, [], nodes=2)
    moved = replace(planned, data=replace(planned.data, root="/elsewhere"), round_timeout=99.0)
    assert _differences(_what_decides_results(planned), _what_decides_results(moved)) == []
    bigger = _planned_config(base, [], nodes=3)
    assert _differences(_what_decides_results(planned), _what_decides_results(bigger)) == [
        "nodes: 2 there, 3 now"
    ]


def test_the_robustness_row_without_attackers_averages_the_same_nodes_as_under_attack():
    """Under attack the attackers' own scores are left out; without attackers the same
    nodes are, or the rows would compare ten nodes against eight. A failed node's score
    is of an earlier round: left out of both."""

    def run(attacker_acc, weight=None):
        accuracies = {"node0": 0.8, "node1": 0.6, "node2": attacker_acc}
        nodes = [
            {"name": name, "test_acc": acc, "status": "finished"}
            for name, acc in accuracies.items()
        ]
        failed = {"name": "node3", "test_acc": 0.1, "status": "failed"}  # of an earlier round
        return {"nodes": [*nodes, failed]} | (
            {"attacker_weight": weight} if weight is not None else {}
        )

    spec = {
        "title": "t",
        "caps": "c",
        "nodes": 4,
        "attackers": ["node2"],
        "rules": {"Rule": []},
        "attacks": {"none": [], "flip": ["attack.kind=labelflip"]},
    }
    summaries = {"Rule | none": [run(1.0)], "Rule | flip": [run(0.0, weight=0.25)]}
    table = render_robustness(spec, summaries, [0], argparse.Namespace(name="x", data_root=None))
    assert "| none | 70.0 / 60.0 |" in table
    assert "| flip | 70.0 / 60.0 / 25% |" in table
