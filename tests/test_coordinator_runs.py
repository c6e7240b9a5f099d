"""The coordinator role on real processes: a full run, and a coordinator killed mid-run."""

from __future__ import annotations

import os
import signal

import pytest

from tests.nodes import free_ports, meshfl, records, start_node, stop, wait_round, write_config


def start_coordinator(config, out):
    (out / "coordinator").mkdir(parents=True, exist_ok=True)
    return meshfl("coordinator", "--config", str(config), "--out", str(out),
                  log=out / "coordinator" / "node.log")


def coordinated_config(path, rounds, epochs):
    return write_config(path, 3, rounds=rounds, local_epochs=epochs,
                        algorithm={"name": "fedavg_server"},
                        coordinator=f"tcp://127.0.0.1:{free_ports(1)[0]}")


def test_killed_coordinator_restarts_from_its_checkpoint_and_nothing_is_lost(tmp_path):
    config = tmp_path / "peers.yaml"
    coordinated_config(config, rounds=8, epochs=20)
    processes = [start_coordinator(config, tmp_path)]
    processes += [start_node(config, f"node{i}", tmp_path) for i in range(3)]
    try:
        wait_round(tmp_path, "coordinator", 3, timeout=90)
        os.killpg(processes[0].pid, signal.SIGKILL)
        processes[0].wait(timeout=10)
        processes[0] = start_coordinator(config, tmp_path)
        for process in processes:
            assert process.wait(timeout=150) == 0
    finally:
        stop(processes)
    coordinator = records(tmp_path, "coordinator")
    assert [r["round"] for r in coordinator] == list(range(1, 9))
    assert all(len(r["uploaded"]) == 3 for r in coordinator[-3:]), "clients came back"
    for name in ("node0", "node1", "node2"):
        rounds = records(tmp_path, name)
        assert [r["round"] for r in rounds] == list(range(1, 9)), "no round lost or repeated"
        assert sum(rounds[-1]["weights"].values()) == pytest.approx(1.0)
    log = (tmp_path / "coordinator" / "node.log").read_text()
    assert "resumed from the checkpoint of round" in log
    finals = {records(tmp_path, f"node{i}")[-1]["test_acc"] for i in range(3)}
    assert min(finals) > 0.8, "the clients learned through the coordinator"
