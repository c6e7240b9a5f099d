"""pfedlia_central on real processes (loopback): a coordinator and four digits clients
in two true clusters; the coordinator gathers the lazy-score rows, OPTICS finds the
clusters, and every client ends the run with its cluster as its group."""

from __future__ import annotations

import pytest

from tests.nodes import free_ports, records, run_coordinated_mesh, write_config

pytestmark = pytest.mark.slow  # real processes over real sockets

NODES = 4  # clusters:2 puts node i in cluster i % 2
WARMUP = 1  # round 2 is the lazy round, round 3 the scoring and clustering round
ROUNDS = 4
TRUE_GROUPS = {
    "node0": ["node0", "node2"],
    "node1": ["node1", "node3"],
    "node2": ["node0", "node2"],
    "node3": ["node1", "node3"],
}


def test_the_coordinator_clusters_the_score_rows_and_every_client_ends_in_its_cluster(tmp_path):
    config = tmp_path / "peers.yaml"
    write_config(
        config,
        NODES,
        rounds=ROUNDS,
        local_epochs=2,
        round_timeout=15.0,
        model={"name": "mlp"},
        data={"dataset": "digits", "partition": "clusters:2"},
        algorithm={"name": "pfedlia_central", "warmup": WARMUP},
        coordinator=f"tcp://127.0.0.1:{free_ports(1)[0]}",
    )
    run_coordinated_mesh(
        config, tmp_path, NODES, timeout=90, coordinator_args=("--local-nodes", str(NODES + 1))
    )

    coordinator = records(tmp_path, "coordinator")
    assert [r["diagnostics"]["phase"] for r in coordinator] == [
        "warmup",
        "lazy",
        "clustered",
        "grouped",
    ]
    clustered = coordinator[WARMUP + 1]["diagnostics"]
    assert set(clustered["lazy_scores"]) == set(TRUE_GROUPS)
    assert all(set(row) == set(TRUE_GROUPS) for row in clustered["lazy_scores"].values())
    labels = clustered["clusters"]
    assert labels["node0"] == labels["node2"] != labels["node1"] == labels["node3"]
    assert coordinator[-1]["diagnostics"]["groups"] == TRUE_GROUPS
    for name, group in TRUE_GROUPS.items():
        last = records(tmp_path, name)[-1]
        assert last["round"] == ROUNDS
        assert sorted(last["weights"]) == group, f"{name}'s model is its cluster's average"
