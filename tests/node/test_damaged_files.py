"""A node's own files cut anywhere (a crash mid-write) never crash it: a torn metrics
tail is dropped, a leftover temporary is removed, a truncated checkpoint is one clear
error, a cut info.json leaves the summary without its data facts; a failed write says
which file and why, and leaves the previous file whole."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from meshfl.launch.summary import FAILED, FINISHED, write_summary
from meshfl.launch.supervise import last_error_line
from meshfl.node.checkpoint import (
    CheckpointError,
    MetricsLog,
    StorageError,
    load_checkpoint,
    save_checkpoint,
    write_atomically,
)
from meshfl.node.config import MeshConfig


def metrics_lines(rounds: range) -> str:
    return "".join(json.dumps({"round": r, "test_acc": 0.5}) + "\n" for r in rounds)


def test_a_torn_metrics_tail_is_dropped_with_one_log_line(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text(metrics_lines(range(1, 4)) + '{"round": 4, "test_a')
    with caplog.at_level(logging.WARNING, logger="meshfl.node"):
        MetricsLog(path).keep_until(3)
    assert [json.loads(line)["round"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert len(caplog.records) == 1 and "line 4" in caplog.text and str(path) in caplog.text


def test_a_garbled_line_and_rounds_after_the_checkpoint_go_the_rest_stays(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        metrics_lines(range(1, 3)) + "\x00\x00garbage\n[1, 2]\n" + metrics_lines(range(3, 6))
    )
    log = MetricsLog(path)
    log.keep_until(4)
    assert [json.loads(line)["round"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    assert [score["round"] for score in log.recent_scores()] == [1, 2, 3, 4]


def test_a_leftover_temporary_is_removed_and_the_checkpoint_loads(tmp_path, caplog):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"round": 7, "model": {"w": torch.ones(3)}})
    (tmp_path / "checkpoint.pt.tmp").write_bytes(b"PK\x03\x04 half a zip")
    with caplog.at_level(logging.WARNING, logger="meshfl.node"):
        state = load_checkpoint(path)
    assert state["round"] == 7
    assert not (tmp_path / "checkpoint.pt.tmp").exists()
    assert len(caplog.records) == 1 and "checkpoint.pt.tmp" in caplog.text


@pytest.mark.parametrize("keep", [0, 10, 0.5, 0.99])
def test_a_truncated_checkpoint_is_one_error_naming_the_file_and_what_to_do(tmp_path, keep):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"round": 7, "model": {"w": torch.ones(1000)}})
    whole = path.read_bytes()
    path.write_bytes(whole[: int(keep * len(whole)) if isinstance(keep, float) else keep])
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(path)
    message = str(raised.value)
    assert str(path) in message and "move it aside" in message and "\n" not in message


def test_a_failed_write_is_one_error_naming_the_file_and_why(tmp_path):
    path = tmp_path / "gone" / "info.json"  # its folder was removed under the node
    with pytest.raises(StorageError, match="cannot write .*info.json: no such file"):
        write_atomically(path, b"next")


def test_the_last_error_line_of_a_log_is_the_exception_not_what_came_after(tmp_path):
    log = tmp_path / "node.log"
    log.write_text(
        "2026-01-01 meshfl.endpoint node0: node1 joined from tcp://x:1\n"
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
        "OSError: [Errno 28] No space left on device\n"
        "2026-01-01 meshfl.endpoint node0: node1 left\n"
    )
    assert last_error_line(log) == "OSError: [Errno 28] No space left on device"
    log.write_text("2026-01-01 meshfl.endpoint node0: node1 joined from tcp://x:1\n")
    assert last_error_line(log) is None


def test_a_summary_lists_every_node_and_means_over_the_finished(tmp_path):
    cfg = MeshConfig(rounds=3)
    for index, peer in enumerate(cfg.peers):
        (tmp_path / peer.name).mkdir()
        last = 1 if index == 1 else 3
        (tmp_path / peer.name / "metrics.jsonl").write_text(
            "".join(
                json.dumps(
                    {"round": r, "test_acc": 0.1 * (index + 1), "val_acc": 0.5, "n_train": 10}
                )
                + "\n"
                for r in range(1, last + 1)
            )
        )
        (tmp_path / peer.name / "info.json").write_text('{"name": "node0", "data": {"lab')
    outcomes = {peer.name: {"status": FINISHED, "restarts": 0} for peer in cfg.peers}
    outcomes["node1"] = {"status": FAILED, "restarts": 0, "ended": "SIGKILL", "last_error": None}
    summary = write_summary(cfg, tmp_path, outcomes)
    by_name = {node["name"]: node for node in summary["nodes"]}
    assert by_name["node1"]["status"] == FAILED and by_name["node1"]["round"] == 1
    assert summary["mean_test_acc"] == pytest.approx((0.1 + 0.3 + 0.4) / 3)
    assert summary["mean_over"] == "3 finished nodes of 4"
    again = write_summary(cfg, tmp_path)  # made again later: the outcomes are kept
    assert [node["status"] for node in again["nodes"]] == [FINISHED, FAILED, FINISHED, FINISHED]


def test_a_summary_writes_a_loss_that_diverged_as_null_so_it_stays_json(tmp_path):
    cfg = MeshConfig(rounds=1)
    for peer in cfg.peers:
        (tmp_path / peer.name).mkdir()
        record = {"round": 1, "test_acc": 0.5, "val_acc": float("nan"), "n_train": 10}
        (tmp_path / peer.name / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    write_summary(cfg, tmp_path, {peer.name: {"status": FINISHED} for peer in cfg.peers})
    text = (tmp_path / "summary.json").read_text()
    written = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
    assert [node["val_acc"] for node in written["nodes"]] == [None] * len(cfg.peers)
