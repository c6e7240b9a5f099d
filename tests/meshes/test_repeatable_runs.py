"""The same seed gives the same bits: two runs of one config whose peers are delayed
differently, so that each node's blobs arrive in another order, end with identical
models, for FedAvg and each personalized peer rule."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from meshfl.algorithms import is_coordinated
from meshfl.protocol.ports import free_ports
from tests.nodes import records, stop, write_config
from tests.spawn import Spawned, spawn

pytestmark = pytest.mark.slow  # real processes over real sockets

NODES = 4
ROUNDS = 3
# Seconds each node sleeps after training, per run: the first run's fastest node is the
# second's slowest, so blobs reach every node in another order.
DELAYS = ([0.0, 0.25, 0.5, 0.75], [0.75, 0.5, 0.25, 0.0])


def model_digest(checkpoint: Path) -> str:
    """A digest of a checkpoint's model tensors: names, dtypes, shapes and bits."""
    model = torch.load(checkpoint, weights_only=True)["model"]
    digest = hashlib.sha256()
    for key in sorted(model):
        tensor = model[key].contiguous()
        digest.update(f"{key} {tensor.dtype} {tuple(tensor.shape)}".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def arrival_orders(out: Path) -> list[list[str]]:
    """For every node and round of the run in `out`, whose blobs it fetched, in order."""
    return [
        [fetch["origin"] for fetch in record["transport_fetches"]]
        for index in range(NODES)
        for record in records(out, f"node{index}")
    ]


def start_run(
    out: Path, algorithm: dict, delays: list[float], hash_seed: str
) -> list[subprocess.Popen | Spawned]:
    """One host of NODES nodes, each delayed by its share of `delays`, and the mesh's
    coordinator where the rule needs one; the interpreters' string hashing seeded by
    `hash_seed`, so that set orders differ between the runs too."""
    out.mkdir(parents=True)
    config = out / "peers.yaml"
    coordinated = is_coordinated(algorithm["name"])
    settings = write_config(
        config,
        NODES,
        rounds=ROUNDS,
        seed=3,
        algorithm=algorithm,
        # Long enough that no peer is marked down or waited out on a busy machine: what
        # arrives must be everything, and only its order may differ.
        round_timeout=120.0,
        peer_timeout=60.0,
        **({"coordinator": f"tcp://127.0.0.1:{free_ports(1)[0]}"} if coordinated else {}),
    )
    for peer, delay in zip(settings["peers"], delays, strict=True):
        peer["train_delay"] = delay
    config.write_text(yaml.safe_dump(settings))
    names = ",".join(peer["name"] for peer in settings["peers"])
    host = ["host", "--names", names, "--local-nodes", "2"]
    roles = [host, ["coordinator"]] if coordinated else [host]
    return [
        start(out, [*role, "--config", str(config), "--out", str(out)], hash_seed) for role in roles
    ]


def start(out: Path, args: list[str], hash_seed: str) -> subprocess.Popen | Spawned:
    process = spawn(args, out / f"{args[0]}.log", hash_seed=hash_seed)
    # Its interpreter began under that seed: the environment it was started with, which a
    # fork keeps, says so (else both runs could hash alike and the test prove less).
    started_with = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
    assert f"PYTHONHASHSEED={hash_seed}".encode() in started_with
    return process


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "fedavg", "screen": False},
        {"name": "fedavg"},  # screened: each node may keep its own model
        {"name": "fedc2i"},
        {"name": "pfedsv"},
        {"name": "pfedlia"},
        # Coordinated: the coordinator aggregates the uploads as they come in.
        {"name": "fedavg_server"},
        {"name": "fedrema"},
        # Few recorded gradients: the recursion's cost, not its size, is what repeats.
        {"name": "fedinfluence", "local_steps": 2, "samples_per_step": 10},
        {"name": "pfedlia_central"},
    ],
    ids=lambda algorithm: algorithm["name"] + ("" if algorithm.get("screen", True) else "-plain"),
)
def test_two_runs_of_one_seed_with_peers_delayed_differently_end_bit_identical(tmp_path, algorithm):
    runs = [tmp_path / "first", tmp_path / "second"]
    processes = [
        process
        for out, delays, hash_seed in zip(runs, DELAYS, ("1", "2"), strict=True)
        for process in start_run(out, algorithm, delays, hash_seed)
    ]
    try:
        codes = [process.wait(timeout=300) for process in processes]
    finally:
        stop(processes)
    assert set(codes) == {0}, [log.read_text() for out in runs for log in out.glob("*.log")]
    names = [f"node{index}" for index in range(NODES)]
    if is_coordinated(algorithm["name"]):
        names.append("coordinator")
    else:  # the delays did their part: some node fetched its peers in another order
        assert arrival_orders(runs[0]) != arrival_orders(runs[1])
    for name in names:
        first, second = (model_digest(out / name / "checkpoint.pt") for out in runs)
        assert first == second, f"{name}: the two runs' final models differ"
