"""Node hosts: many full peers in one process, talking only over the wire."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.nodes import meshfl, records, stop, write_config

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
    assert "missing.npz" in (tmp_path / "node2" / "node.log").read_text()
