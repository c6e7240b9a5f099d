"""Compressed blobs between real node processes: deltas where a node holds their base,
and peers that each send under a codec of their own, every one decoded."""

from __future__ import annotations

import pytest
import yaml

from meshfl.node.deltas import DELTA
from tests.nodes import records, run_nodes, start_node, stop, write_config

pytestmark = pytest.mark.slow  # real processes over real sockets

MODEL_BYTES = 68_904  # the default mlp on digits, as float32


def test_a_topk_mesh_sends_deltas_where_the_base_is_held_and_whole_models_elsewhere(
    tmp_path,
):
    config = tmp_path / "peers.yaml"
    write_config(
        config, 3, rounds=3, compression="topk", algorithm={"name": "fedavg", "screen": False}
    )
    run_nodes(config, tmp_path, 3, timeout=120)
    deltas = 0
    for name in ("node0", "node1", "node2"):
        held = {"node0", "node1", "node2"} - {name}  # round 1's base: the initial model
        for record in records(tmp_path, name):
            assert record["received"] and not record["refusals"], record
            for fetch in record["transport_fetches"]:
                # A peer missed in a round (marked down on a loaded machine) comes whole.
                assert (fetch["kind"] == DELTA) == (fetch["origin"] in held), record
                if fetch["kind"] == DELTA:
                    assert fetch["bytes"] <= 0.1 * MODEL_BYTES
                    deltas += 1
            held = set(record["received"])
        assert records(tmp_path, name)[-1]["test_acc"] > 0.5
    assert deltas >= 6, "most models travelled as deltas"


def test_peers_each_sending_under_their_own_codec_learn_from_each_other(tmp_path):
    settings = write_config(
        tmp_path / "peers.yaml", 4, rounds=2, algorithm={"name": "fedavg", "screen": False}
    )
    codecs = {"node0": "none", "node1": "fp16", "node2": "bf16", "node3": "int8"}
    processes = []
    try:
        for name, codec in codecs.items():
            config = tmp_path / f"{name}.yaml"
            config.write_text(yaml.safe_dump({**settings, "compression": codec}))
            processes.append(start_node(config, name, tmp_path))
        for process in processes:
            assert process.wait(timeout=120) == 0
    finally:
        stop(processes)
    for name, codec in codecs.items():
        for record in records(tmp_path, name):
            assert record["compression"] == codec
            assert len(record["received"]) == 3 and not record["refusals"], record
    sent = {name: records(tmp_path, name)[-1]["published_bytes"] for name in codecs}
    assert sent["node1"] == sent["node2"] == MODEL_BYTES // 2
    assert sent["node3"] < 0.27 * MODEL_BYTES < sent["node1"] < sent["node0"] == MODEL_BYTES
