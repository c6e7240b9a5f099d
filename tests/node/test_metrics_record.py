"""The typed metrics record (node/metrics.py) reads every line the nodes write, old and new,
and the measures registry (launch/measures.py) reports per rule what summary, report and
experiment tables show."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshfl.launch import measures, report, run_folder
from meshfl.node import metrics
from meshfl.node.metrics import CoordinatorRecord, RoundRecord, last_record, read_records

# One line of each role, with every key its writer writes today (node/runtime.py,
# node/coordinator.py): a peer, a coordinated client, the coordinator.
PEER_LINE = {
    "round": 3,
    "node": "node0",
    "train_loss": 0.4,
    "val_loss": 0.5,
    "val_acc": 0.8,
    "test_loss": 0.6,
    "test_acc": 0.75,
    "weights": {"node0": 0.5, "node1": 0.5},
    "diagnostics": {"shapley": {"node1": 0.1}},
    "received": ["node1"],
    "peers_alive": 1,
    "fetched": {"model": ["node1"]},
    "refused": {},
    "refusals": {},
    "transport_fetches": [{"origin": "node1", "round": 3, "kind": "model", "bytes": 10}],
    "bytes_in": 100,
    "bytes_out": 200,
    "rejections": {"replay": 1},
    "seconds": {"train": 1.0},
    "n_train": 120,
    "attacker": False,
    "bytes_sent_by_kind": {"blob": 150, "heartbeat": 50},
}
CLIENT_LINE = {
    key: PEER_LINE[key]
    for key in (
        "round",
        "node",
        "train_loss",
        "val_loss",
        "val_acc",
        "test_loss",
        "test_acc",
        "weights",
        "diagnostics",
        "bytes_in",
        "bytes_out",
        "rejections",
        "refusals",
        "seconds",
        "n_train",
    )
}
COORDINATOR_LINE = {
    "round": 2,
    "clients": ["a", "b"],
    "uploaded": ["a"],
    "refused": ["b"],
    "refusals": {"layout": 1},
    "rejections": {},
    "diagnostics": {"ccp": True},
    "seconds": {"wait": 0.5, "aggregate": 0.1},
    "bytes_in": 10,
    "bytes_out": 20,
}


@pytest.mark.parametrize(
    ("kind", "line"),
    [(RoundRecord, PEER_LINE), (RoundRecord, CLIENT_LINE), (CoordinatorRecord, COORDINATOR_LINE)],
)
def test_every_key_a_writer_writes_is_a_field_and_a_line_round_trips(kind, line):
    record = kind.from_json(line)
    assert record.extra == {}, "a key the writer writes has no field"
    assert record.to_json() == line
    assert kind(**line).to_json() == line, "the writer can pass its keys as arguments"


def test_a_line_from_before_a_field_existed_reads_with_its_default():
    older = {key: value for key, value in PEER_LINE.items() if key != "bytes_sent_by_kind"}
    record = RoundRecord.from_json(older)
    assert record.bytes_sent_by_kind is None and record.test_acc == 0.75
    assert "bytes_sent_by_kind" not in record.to_json()
    bare = RoundRecord.from_json({"round": 1})
    assert (bare.weights, bare.diagnostics, bare.test_acc) == ({}, {}, None)


def test_a_key_from_a_newer_version_is_kept_not_dropped():
    record = RoundRecord.from_json({**CLIENT_LINE, "energy_joules": 3.5})
    assert record.extra == {"energy_joules": 3.5}
    assert record.to_json()["energy_joules"] == 3.5


@pytest.mark.parametrize("line", [[1, 2], "round", {"test_acc": 0.5}, {"round": "3"}])
def test_a_line_without_an_integer_round_is_no_record(line):
    with pytest.raises(ValueError, match="integer round"):
        RoundRecord.from_json(line)


def test_reading_skips_lines_cut_short_and_a_missing_file_has_none(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(COORDINATOR_LINE) + "\n[]\n" + '{"round": 3, "cli\n')
    assert read_records(path, CoordinatorRecord) == [CoordinatorRecord.from_json(COORDINATOR_LINE)]
    assert last_record(path, CoordinatorRecord).refused == ["b"]
    assert read_records(tmp_path / "missing.jsonl", RoundRecord) == []
    assert last_record(tmp_path / "missing.jsonl", RoundRecord) is None


def test_every_matrix_a_rule_names_is_one_the_report_draws():
    named = {key for rule in measures.RULES.values() for key in rule.matrices}
    assert named <= set(report.MATRIX_MEASURES)
    assert measures.measures_of("fedavg").matrices == ("weights",)


def test_a_run_reports_the_scores_of_its_rule_only():
    # A Shapley game recorded under another rule's name is not that rule's to report.
    rounds = [
        RoundRecord(round=1, weights={"a": 1.0}, diagnostics={"v_own": 0.9, "v_aggregate": 0.8})
    ]
    run = run_folder.RunRecords({"a": rounds})
    assert measures.rule_scores("pfedsv", run) == {"average_below_own": 1.0, "average_adopted": 0.0}
    assert measures.rule_scores("fedavg", run) == {}


def test_the_table_rows_keep_the_order_of_the_registry_and_name_each_score_once():
    rows = list(measures.score_rows())
    assert rows == [
        "neighbours_own_cluster_first",  # every rule's, in a bounded mesh
        "neighbours_own_cluster_last",
        "trial_rounds",  # every screened rule's, with trials on
        "trials_won",
        "ari",
        "own_group_share_ccp",
        "own_group_share_lowest",
        "top_k_precision",
        "shapley_sharing_a_label",
        "shapley_sharing_no_label",
        "weight_on_label_sharing_peers",
        "average_below_own",
        "average_adopted",
        "influence_own_share",
        "class_influence_peak",
    ]


def test_the_last_record_is_read_from_the_end_of_a_long_file_and_a_torn_tail_skipped(
    tmp_path, monkeypatch
):
    whole_reads: list[Path] = []
    read_whole = metrics.read_lines
    monkeypatch.setattr(
        metrics, "read_lines", lambda path: whole_reads.append(path) or read_whole(path)
    )
    path = tmp_path / "metrics.jsonl"
    names = ["node" + "x" * 60] * 200  # a line of a big mesh lists its peers
    lines = [json.dumps({"round": r, "received": names}) for r in range(1, 101)]
    path.write_text("\n".join(lines) + '\n{"round": 101, "rece')  # a crash mid-append
    assert path.stat().st_size > 2 * metrics.TAIL_BYTES
    assert last_record(path, RoundRecord).round == 100
    assert whole_reads == [], "a long file is not read whole for its last line"
    longer_than_the_tail = {"round": 7, "received": names * 20}
    path.write_text(json.dumps(longer_than_the_tail) + "\n")
    assert last_record(path, RoundRecord).received == names * 20
    assert whole_reads == [path], "only a line longer than the tail makes it read whole"
