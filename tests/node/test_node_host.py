"""Node hosts: many full peers in one process, talking only over the wire."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from meshfl.node.runtime import PLANTED_FAILURES
from tests.nodes import launch_to_end, meshfl, records, stop, write_config

pytestmark = pytest.mark.slow  # real processes over real sockets

ROUNDS = 3


def start_host(config: Path, out: Path, names: list[str]) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    return meshfl(
        "host",
        "--config",
        str(config),
        "--names",
        ",".join(names),
        "--out",
        str(out),
        "--local-nodes",
        "2",
        log=out / f"host-{names[0]}.log",
    )


def run_hosts(config: Path, out: Path, groups: list[list[str]]) -> list[int]:
    hosts = [start_host(config, out, names) for names in groups]
    try:
        return [host.wait(timeout=240) for host in hosts]
    finally:
        stop(hosts)


def test_two_hosts_run_a_mesh_whose_nodes_are_full_peers_on_the_wire(tmp_path):
    config = tmp_path / "peers.yaml"
    write_config(config, 4, rounds=ROUNDS)
    assert run_hosts(config, tmp_path, [["node0", "node1"], ["node2", "node3"]]) == [0, 0]
    keys = set()
    for name in ("node0", "node1", "node2", "node3"):
        lines = records(tmp_path, name)
        assert [r["round"] for r in lines] == list(range(1, ROUNDS + 1)), name
        # A sibling in the same process is fetched over the wire like any other peer.
        assert sorted(lines[-1]["received"]) == sorted(
            {"node0", "node1", "node2", "node3"} - {name}
        )
        assert all(fetch["bytes"] > 0 for fetch in lines[-1]["transport_fetches"])
        assert (tmp_path / name / "checkpoint.pt").is_file()
        log = (tmp_path / name / "node.log").read_text()
        assert f"{name}: " in log
        others = {"node0", "node1", "node2", "node3"} - {name}
        assert not any(f"{other}: listening" in log for other in others), "one log a node"
        keys.add((tmp_path / "keys" / f"{name}.pem").read_bytes())
    assert len(keys) == 4, "every node of a host has its own key"


def test_a_node_that_fails_in_a_host_stops_alone(tmp_path):
    config = tmp_path / "peers.yaml"
    settings = write_config(config, 3, rounds=ROUNDS)
    settings["peers"][2]["data"] = {"dataset": f"npz:{tmp_path / 'missing.npz'}"}
    config.write_text(yaml.safe_dump(settings))
    (code,) = run_hosts(config, tmp_path, [["node0", "node1", "node2"]])
    assert code == 3, "a host whose node failed says so"
    for name in ("node0", "node1"):
        assert [r["round"] for r in records(tmp_path, name)] == list(range(1, ROUNDS + 1))
    assert records(tmp_path, "node2") == []
    log = (tmp_path / "node2" / "node.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("meshfl: error: ")]
    assert len(errors) == 1 and "missing.npz" in errors[0], log
    assert "Traceback" not in log + (tmp_path / "host-node0.log").read_text()


def test_a_node_that_fails_in_a_host_is_back_within_three_rounds_and_finishes_with_it(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(PLANTED_FAILURES, "node1:3")  # the launch's processes inherit it
    out = tmp_path / "run"
    summary = launch_to_end(
        tmp_path / "launch.log",
        out,
        *("--nodes", "4", "--hosts", "1", "--rounds", "20", "--restarts", "1"),
        *("--set", "heartbeat_interval=0.3", "--set", "peer_timeout=1.5"),
        *("--set", "round_timeout=10", "--quiet"),
    )
    assert {name: (node["status"], node["round"]) for name, node in summary.items()} == {
        name: ("finished", 20) for name in ("node0", "node1", "node2", "node3")
    }
    assert [summary[name]["restarts"] for name in sorted(summary)] == [0, 1, 0, 0]
    others = ("node0", "node2", "node3")
    back = min(
        round_no
        for round_no in range(3, 21)
        if all(
            "node1" in record["received"]
            for name in others
            for record in records(out, name)
            if record["round"] == round_no
        )
    )
    print(f"node1, failed at round 3, is in every peer's average again from round {back}")
    assert back <= 6
    failed_log = (out / "node1" / "node.log").read_text()
    assert failed_log.count("Traceback") == 1 and "PlantedFailure" in failed_log
    assert "node1: restarting from its checkpoint (restart 1 of 1)" in failed_log
    assert "resumed from the checkpoint of round 2" in failed_log
    host_log = (out / "host-node0-node3.log").read_text()
    assert "node1: restarting from its checkpoint (restart 1 of 1)" in host_log
    for log in [host_log, (tmp_path / "launch.log").read_text()] + [
        (out / name / "node.log").read_text() for name in others
    ]:
        assert "Traceback" not in log
