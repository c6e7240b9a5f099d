"""pFedLIA on real node processes (loopback): the lazy round clusters a two-cluster digits
mesh, and a node that joins after that round (`meshfl join`) is scored by every node,
taken into its own cluster's groups, and gets a group of its own."""

from __future__ import annotations

import pytest
import yaml

from tests.nodes import meshfl, records, start_node, stop, wait_round, write_config

pytestmark = pytest.mark.slow  # real processes over real sockets

NODES = 4  # clusters:2 puts node i in cluster i % 2
WARMUP = 1  # so round 2 is the lazy round
ROUNDS = 14  # the joiner, forked from a process that has torch, joins by about round 4
TRUE_GROUPS = {
    "node0": ["node0", "node2"],
    "node1": ["node1", "node3"],
    "node2": ["node0", "node2"],
    "node3": ["node1", "node3"],
}
# The joiner is node 4 of 5 to the partition: cluster 0, with node0 and node2.
LATE_GROUP = ["late", "node0", "node2"]


def run_mesh_with_a_late_joiner(tmp_path):
    config = tmp_path / "peers.yaml"
    cfg = write_config(
        config,
        NODES,
        rounds=ROUNDS,
        local_epochs=40,
        round_timeout=20.0,
        model={"name": "mlp"},
        data={"dataset": "digits", "partition": "clusters:2"},
        algorithm={"name": "pfedlia", "warmup": WARMUP, "screen": False},
    )
    # Rounds of at least half a second: the joiner, a process of its own that loads
    # torch and its data first, must still find rounds left to be scored in.
    for peer in cfg["peers"]:
        peer["train_delay"] = 0.5
    config.write_text(yaml.safe_dump(cfg))
    processes = [start_node(config, f"node{i}", tmp_path) for i in range(NODES)]
    try:
        wait_round(tmp_path, "node0", WARMUP + 1, timeout=150)
        # Local training is the joiner's own affair; a light one keeps it in step with
        # the mesh's slow rounds (slowed so that it joins before the last round).
        processes.append(
            meshfl(
                "join",
                cfg["peers"][1]["listen"],
                "--config",
                str(config),
                "--name",
                "late",
                "--out",
                str(tmp_path),
                "--set",
                "local_epochs=2",
                log=tmp_path / "late.log",
            )
        )
        for process in processes:
            assert process.wait(timeout=300) == 0
    finally:
        stop(processes)
    return {name: records(tmp_path, name) for name in [*TRUE_GROUPS, "late"]}


def test_a_node_joining_after_the_lazy_round_is_scored_grouped_and_gets_a_group(tmp_path):
    rows = run_mesh_with_a_late_joiner(tmp_path)
    for name, group in TRUE_GROUPS.items():
        lazy_round = rows[name][WARMUP]
        assert lazy_round["round"] == WARMUP + 1
        assert lazy_round["diagnostics"]["phase"] == "clustered"
        assert lazy_round["diagnostics"]["group"] == group, "the lazy round found the clusters"

    late = rows["late"]
    assert late[0]["round"] > WARMUP + 1, "it joined after the lazy round"
    assert late[-1]["round"] == ROUNDS
    clustered = [row for row in late if row["diagnostics"].get("phase") == "clustered"]
    assert clustered, "the joiner fetched the anchor and clustered"
    assert late[-1]["diagnostics"]["group"] == LATE_GROUP
    assert set(late[-1]["diagnostics"]["lazy_scores"]) == {*TRUE_GROUPS, "late"}
    assert late[-1]["diagnostics"]["precision"] == late[-1]["diagnostics"]["recall"] == 1.0

    for name in TRUE_GROUPS:
        last = rows[name][-1]["diagnostics"]
        assert "late" in last["lazy_scores"], f"{name} scored the joiner"
        assert ("late" in last["group"]) == (name in LATE_GROUP), name
        assert last["precision"] == last["recall"] == 1.0

    # Taken in, its model is averaged by node0 from then on, and only the group's models
    # are pulled. (A round whose deadline passed before the blobs came has fewer.)
    scored_at = next(
        row["round"]
        for row in rows["node0"]
        if "late" in row["diagnostics"].get("newly_scored", [])
    )
    later = [row for row in rows["node0"] if row["round"] > scored_at]
    assert all(set(row["fetched"].get("model", [])) <= {"late", "node2"} for row in later)
    assert any("late" in row["weights"] for row in later)
