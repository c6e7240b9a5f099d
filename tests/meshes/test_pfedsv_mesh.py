"""pFedSV on real node processes (loopback): a node pulls the blobs of its chosen peers
and no others, as the endpoint's log of the blobs it pulled and its byte counters show."""

from __future__ import annotations

import pytest
import torch

from tests.nodes import records, start_node, stop, write_config

pytestmark = pytest.mark.slow  # real processes over real sockets

NODES = 5
ROUNDS = 3
K = 2


def state_bytes(state):
    return sum(tensor.numel() * tensor.element_size() for tensor in state.values())


def run_mesh(tmp_path, model=None, **algorithm):
    config = tmp_path / "peers.yaml"
    write_config(
        config,
        NODES,
        rounds=ROUNDS,
        round_timeout=20.0,
        model=model or {"name": "mlp"},
        compression="none",  # float32 as it is: a blob's bytes are its model's
        # The paper's rule: screening would hold back some of what it fetched.
        algorithm={"name": "pfedsv", "k": K, "k_min": K, "k_max": K, "screen": False, **algorithm},
    )
    names = [f"node{i}" for i in range(NODES)]
    processes = [start_node(config, name, tmp_path) for name in names]
    try:
        for process in processes:
            assert process.wait(timeout=50) == 0
    finally:
        stop(processes)
    model = torch.load(tmp_path / "node0" / "checkpoint.pt", weights_only=True)["model"]
    return names, model


def rounds_with_the_full_mesh(tmp_path, name):
    """A node that started first may see fewer peers in round 1; from then on all are up."""
    rows = records(tmp_path, name)
    assert [row["round"] for row in rows] == list(range(1, ROUNDS + 1))
    full = [row for row in rows if row["peers_alive"] == NODES - 1]
    assert len(full) >= ROUNDS - 1
    return rows, full


def test_each_node_fetches_exactly_the_models_of_its_top_k_peers(tmp_path):
    names, model = run_mesh(tmp_path)
    model_bytes = state_bytes(model)
    for name in names:
        rows, full = rounds_with_the_full_mesh(tmp_path, name)
        for row in rows:
            chosen = row["diagnostics"]["selected"]
            # The endpoint's own log of the blobs that crossed the wire this round.
            pulled = row["transport_fetches"]
            assert sorted(fetch["origin"] for fetch in pulled) == sorted(chosen), (
                "pulled = selected, no more"
            )
            assert all(
                fetch["round"] == row["round"]
                and fetch["kind"] == "model"
                and fetch["bytes"] == model_bytes
                for fetch in pulled
            )
            assert row["fetched"] == {"model": sorted(chosen)}
            assert row["diagnostics"]["downloaded"] == sorted(chosen)
            assert row["diagnostics"]["bytes_downloaded"] == len(chosen) * model_bytes
            assert set(row["weights"]) <= {name, *chosen}
        for row in full:
            assert len(row["fetched"]["model"]) == K, f"{K} of the {NODES - 1} peers offered"
            # Messages other than the two blobs (heartbeats, announces) are small.
            assert K * model_bytes <= row["bytes_in"] < (K + 1) * model_bytes


def test_with_a_shared_body_each_node_fetches_every_body_but_only_top_k_heads(tmp_path):
    # head=fc makes a head (two layers) outweigh a round's small messages, so an extra
    # head would show in bytes_in.
    names, model = run_mesh(tmp_path, {"name": "mlp", "head": "fc"}, shared_body=True)
    body_bytes = state_bytes({k: v for k, v in model.items() if k.startswith("body.")})
    head_bytes = state_bytes({k: v for k, v in model.items() if k.startswith("head.")})
    for name in names:
        _, full = rounds_with_the_full_mesh(tmp_path, name)
        for row in full:
            assert len(row["fetched"]["body"]) == NODES - 1
            assert row["fetched"]["head"] == sorted(row["diagnostics"]["selected"])
            pulled = {(fetch["kind"], fetch["origin"]) for fetch in row["transport_fetches"]}
            others = [peer for peer in names if peer != name]
            assert pulled == {("body", peer) for peer in others} | {
                ("head", peer) for peer in row["diagnostics"]["selected"]
            }
            assert len(row["fetched"]["head"]) == K
            expected = (NODES - 1) * body_bytes + K * head_bytes
            assert row["diagnostics"]["bytes_downloaded"] == expected
            if row["round"] > 1:  # round 1 also carries the hellos and peer tables
                assert expected <= row["bytes_in"] < expected + head_bytes
