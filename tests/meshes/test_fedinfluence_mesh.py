"""Fed-Influence on real processes: a coordinator and three clients over loopback, with
float16 gradient sets and int8 models on the wire both ways, and a cleansing round.
Every client trains every round (sampling is unit-tested): each client process pays
torch.func's one-off start-up in its first round, and a sampled schedule would pay it in
several rounds one by one."""

from __future__ import annotations

import pytest

from tests.nodes import free_ports, records, run_coordinated_mesh, write_config

pytestmark = pytest.mark.slow  # real processes over real sockets

NODES, ROUNDS, STEPS, SAMPLES = 3, 4, 2, 4
LOGREG_ON_DIGITS = 64 * 10 + 10  # parameters: 8x8 pixels to 10 classes, plus the bias


def test_coordinated_run_writes_every_clients_influence(tmp_path):
    config = tmp_path / "peers.yaml"
    algorithm = {
        "name": "fedinfluence",
        "lr": 0.05,
        "local_steps": STEPS,
        "samples_per_step": SAMPLES,
        "clients_per_round": 0,
        "gradient_dtype": "float16",
        "cleanse_at": 3,
        "cleanse_fraction": 0.34,
    }
    # Generous liveness timing: a loaded machine must not turn a busy client into a dead one.
    write_config(
        config,
        NODES,
        rounds=ROUNDS,
        round_timeout=20.0,
        heartbeat_interval=0.5,
        peer_timeout=10.0,
        algorithm=algorithm,
        model={"name": "logreg"},
        compression="int8",  # the coordinator's and the clients' blobs alike
        coordinator=f"tcp://127.0.0.1:{free_ports(1)[0]}",
    )
    run_coordinated_mesh(config, tmp_path, NODES, timeout=90)
    names = [f"node{i}" for i in range(NODES)]
    coordinator = records(tmp_path, "coordinator")
    assert [row["round"] for row in coordinator] == list(range(1, ROUNDS + 1))
    for row in coordinator:
        found = row["diagnostics"]
        assert sorted(row["uploaded"]) == sorted(row["clients"])
        for key in ("fil", "fia", "fip_norm"):
            assert set(found[key]) == set(names), key
        assert set(found["lwet_flags"]) == {"head.weight", "head.bias"}
        assert set(found["seconds"]) == {"average", "fip", "evaluate"}
        assert 0 <= found["test_acc"] <= 1
        assert "rejected" not in found, "float16 gradient sets pass the coordinator's checks"
    assert max(coordinator[-1]["diagnostics"]["fip_norm"].values()) > 0
    cleansed = coordinator[2]["diagnostics"]["cleansed"]
    fil = coordinator[2]["diagnostics"]["fil"]
    assert cleansed == [min(fil, key=lambda name: (fil[name], name))]
    assert coordinator[3]["clients"] == sorted(set(names) - set(cleansed)), (
        "a cleansed client trains no more"
    )
    gradient_bytes = STEPS * SAMPLES * LOGREG_ON_DIGITS * 2
    trained = [line for name in names for line in records(tmp_path, name)]
    assert trained and all(line["bytes_out"] > gradient_bytes for line in trained)
    # Models travel as int8 (a quarter of their float32 bytes), gradients as float16:
    # the clients' uploads, and the models the coordinator sends each of them.
    model_bytes = [line["published_bytes"] - gradient_bytes for line in trained]
    assert all(0 < size < 0.3 * LOGREG_ON_DIGITS * 4 for size in model_bytes)
    assert all(
        0 < row["published_bytes"] < 0.3 * LOGREG_ON_DIGITS * 4 * NODES for row in coordinator
    )
    assert sum(trained[0]["weights"].values()) == pytest.approx(1.0)
