"""The coordinator role on real processes: a full run, and a coordinator killed mid-run."""

from __future__ import annotations

import itertools
import os
import signal

import pytest

from tests.nodes import (
    free_ports,
    meshfl,
    records,
    start_node,
    stop,
    wait_round,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.slow  # real processes over real sockets


def start_coordinator(config, out):
    (out / "coordinator").mkdir(parents=True, exist_ok=True)
    return meshfl(
        "coordinator",
        "--config",
        str(config),
        "--out",
        str(out),
        log=out / "coordinator" / "node.log",
    )


def coordinated_config(path, rounds, epochs, algorithm):
    return write_config(
        path,
        3,
        rounds=rounds,
        local_epochs=epochs,
        algorithm={"name": algorithm},
        coordinator=f"tcp://127.0.0.1:{free_ports(1)[0]}",
    )


def dependency(record):
    """FedReMa's dependency counts G after a round (none before its first uploads)."""
    return record["diagnostics"].get("dependency", {})


def test_killed_coordinator_restarts_from_its_checkpoint_and_nothing_is_lost(tmp_path):
    # FedReMa: its coordinator carries state across rounds (the dependency counts G, the
    # gap history of the CCP test), which a restart must not lose.
    config = tmp_path / "peers.yaml"
    coordinated_config(config, rounds=8, epochs=20, algorithm="fedrema")
    processes = [start_coordinator(config, tmp_path)]
    processes += [start_node(config, f"node{i}", tmp_path) for i in range(3)]
    try:
        wait_round(tmp_path, "coordinator", 3, timeout=90)
        wait_until(
            lambda: any(dependency(r) for r in records(tmp_path, "coordinator")),
            90,
            "the coordinator to count relevant sets",
        )
        os.killpg(processes[0].pid, signal.SIGKILL)
        processes[0].wait(timeout=10)
        processes[0] = start_coordinator(config, tmp_path)
        for process in processes:
            assert process.wait(timeout=150) == 0
    finally:
        stop(processes)
    coordinator = records(tmp_path, "coordinator")
    assert [r["round"] for r in coordinator] == list(range(1, 9))
    # G only ever counts up: what was counted before the kill is still there after it.
    counts = [dependency(r) for r in coordinator if dependency(r)]
    for before, after in itertools.pairwise(counts):
        for client, row in before.items():
            assert all(after[client][peer] >= n for peer, n in row.items()), (before, after)
    assert all(len(r["uploaded"]) == 3 for r in coordinator[-3:]), "clients came back"
    for name in ("node0", "node1", "node2"):
        rounds = records(tmp_path, name)
        assert [r["round"] for r in rounds] == list(range(1, 9)), "no round lost or repeated"
        assert sum(rounds[-1]["weights"].values()) == pytest.approx(1.0)
    log = (tmp_path / "coordinator" / "node.log").read_text()
    assert "resumed from the checkpoint of round" in log
    finals = {records(tmp_path, f"node{i}")[-1]["test_acc"] for i in range(3)}
    assert min(finals) > 0.8, "the clients learned through the coordinator"


def test_a_client_whose_coordinator_never_comes_gives_up_with_one_line(tmp_path):
    config = tmp_path / "peers.yaml"
    # max(rounds, 3) x round_timeout = 3 s of silence is the client's patience.
    write_config(
        config,
        1,
        rounds=2,
        round_timeout=1.0,
        local_epochs=1,
        algorithm={"name": "fedavg_server"},
        coordinator=f"tcp://127.0.0.1:{free_ports(1)[0]}",
    )
    client = start_node(config, "node0", tmp_path)
    try:
        assert client.wait(timeout=60) == 2, "a non-zero exit: the run did not finish"
    finally:
        stop([client])
    log = (tmp_path / "node0" / "node.log").read_text()
    assert "training locally until it is back" in log
    last = log.strip().splitlines()[-1]
    assert last.startswith("meshfl: error: node0: no word from the coordinator"), last
    assert "gave up after round 0 of 2" in last and "Traceback" not in log
    assert records(tmp_path, "node0") == [], "no round was answered, none is recorded"
