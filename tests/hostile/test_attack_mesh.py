"""A live mesh with an attacker: real node processes, the attacker signing correctly."""

from __future__ import annotations

import pytest

from tests.nodes import records, run_nodes, write_config

pytestmark = pytest.mark.slow


def test_a_noise_attacker_is_screened_out_by_every_honest_node_on_a_live_mesh(tmp_path):
    config = tmp_path / "peers.yaml"
    write_config(
        config,
        4,
        rounds=3,
        local_epochs=4,
        lr=0.1,
        algorithm="fedavg",
        attack={"nodes": ["node3"], "kind": "noise"},
    )
    run_nodes(config, tmp_path, 4, timeout=150)
    assert all(record["attacker"] for record in records(tmp_path, "node3"))
    for name in ("node0", "node1", "node2"):
        history = records(tmp_path, name)
        assert [record["round"] for record in history] == [1, 2, 3]
        for record in history:
            assert not record["attacker"]
            assert "node3" not in record["weights"]
        first, *later = history
        assert "node3" in first["received"], "the attacker's blob was taken in..."
        # Noise is far from every model trained on anyone's data: out by its distance
        # (or, should it come near, on the node's own val split).
        assert first["diagnostics"]["screened_out"]["node3"] in ("distance", "val_loss"), (
            "...and screened out the round it arrived"
        )
        for record in later:  # its record keeps it out (once clear, not even downloaded)
            reason = record["diagnostics"]["screened_out"]["node3"]
            assert reason in ("distance", "val_loss", "record")
