"""Four hosts on a virtual LAN: Linux network namespaces joined by veth pairs and a bridge.

Three hosts run `meshfl node --config peers.yaml --name ...` on their own 10.77.0.x
address; a fourth joins with `meshfl join` through one of them. The mesh must learn
(every node ends above a Local model trained on the same data) and no peer table may
hold a loopback address.

The LAN (tests/netns.py) keeps every packet inside and is torn down whatever the test's
outcome. About 20 s on two idle cores.

The last test needs no namespaces: a late member listed in peers.yaml (the way into a
closed mesh) joins as its own entry.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from meshfl.launch import entry
from meshfl.launch.cli import main
from meshfl.node import config as cfgmod
from meshfl.node.models import build_model
from meshfl.node.splits import load_node_data
from meshfl.node.trainer import evaluate, train_local
from meshfl.protocol.identity import Identity
from tests.netns import VirtualLan, needs_netns, virtual_lan
from tests.nodes import records

pytestmark = pytest.mark.slow  # real processes over real sockets


SUBNET = "10.77.0"  # private; only the namespaces of one run ever see it
PORT = 7700  # the same port on every host, as on real machines
NAMED = ["alpha", "beta", "gamma"]
JOINER = "delta"
# Small shards under mild label skew: too little data to learn alone, so FedAvg clearly
# beats Local (by 10 to 20 points here).
MESH = {
    "mesh": "lan-test",
    "rounds": 10,
    "local_epochs": 40,
    "batch_size": 16,
    "lr": 0.03,
    "momentum": 0.5,
    "round_timeout": 10.0,
    "heartbeat_interval": 0.5,
    "peer_timeout": 5.0,
    "data": {
        "dataset": "digits",
        "partition": "dirichlet:3.0",
        "samples_per_node": 150,
        "split": [0.3, 0.1, 0.6],
    },
}
# The mesh (about 15 s on two idle cores) fails the test only when no node finished a
# round for STALL seconds (a busy machine is slow, not stuck), or after LIMIT in all.
STALL = 120.0
LIMIT = 900.0


@pytest.fixture
def lan():
    with virtual_lan(SUBNET) as network:
        yield network


def lan_address(index: int) -> str:
    return f"{SUBNET}.{index + 1}"  # what VirtualLan gives host `index`


def write_peers(path: Path, root: Path | None = None) -> cfgmod.MeshConfig:
    """peers.yaml of the named hosts; with `root`, each host's key is made in its own
    folder first and its public key listed, as on real machines: the mesh encrypts, and
    a node dials another only with its key (WIRE.md 1.1)."""
    # Rounds of at least 1.5 s, spent asleep rather than training: the joiner, a fresh
    # interpreter, must find the mesh still running, and the Local reference is cheap.
    peers = [
        {"name": name, "listen": f"tcp://{lan_address(index)}:{PORT}", "train_delay": 1.5}
        for index, name in enumerate(NAMED)
    ]
    if root is not None:
        for index, peer in enumerate(peers):
            key_file = host_dir(root, index) / "keys" / f"{peer['name']}.pem"
            identity = Identity.generate()
            identity.save(key_file)
            peer["public_key"] = identity.public_key.hex()
    path.write_text(yaml.safe_dump({**MESH, "peers": peers}))
    return cfgmod.load_config(path)


def host_dir(root: Path, index: int) -> Path:
    """Each host writes to its own folder, as separate machines would."""
    return root / f"host{index}"


def node_dir(root: Path, index: int, name: str) -> Path:
    return host_dir(root, index) / name


def run_mesh(lan: VirtualLan, config: Path, root: Path) -> None:
    nodes = [
        lan.start(
            index,
            node_dir(root, index, name) / "node.log",
            "node",
            "--config",
            str(config),
            "--name",
            name,
            "--out",
            str(host_dir(root, index)),
            "--local-nodes",
            "4",
        )
        for index, name in enumerate(NAMED)
    ]
    progress = Progress(root)
    progress.wait_for(lambda: records(host_dir(root, 0), NAMED[0]), "alpha's first round")
    joiner_index = len(NAMED)
    joiner = lan.start(
        joiner_index,
        node_dir(root, joiner_index, JOINER) / "node.log",
        "join",
        f"tcp://{lan_address(1)}:{PORT}",
        "--config",
        str(config),
        "--name",
        JOINER,
        "--out",
        str(host_dir(root, joiner_index)),
        "--local-nodes",
        "4",
    )
    progress.wait_for(lambda: all(p.poll() is not None for p in [*nodes, joiner]), "the exits")
    for process in [*nodes, joiner]:
        assert process.returncode == 0, f"exit {process.returncode}: {process.args}"


class Progress:
    """Waits that end in failure only when the mesh under `root` stops making progress
    (no new metrics line anywhere for STALL seconds), or at LIMIT."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started = time.monotonic()

    def lines(self) -> int:
        return sum(
            len(path.read_text().splitlines()) for path in self.root.glob("*/*/metrics.jsonl")
        )

    def wait_for(self, condition, what: str) -> None:
        seen, since = self.lines(), time.monotonic()
        while not condition():
            now = time.monotonic()
            if (lines := self.lines()) != seen:
                seen, since = lines, now
            assert now - since < STALL, f"no round finished for {STALL:.0f} s, waiting for {what}"
            assert now - self.started < LIMIT, f"timed out ({LIMIT:.0f} s) waiting for {what}"
            time.sleep(0.2)


def peer_addresses(folder: Path) -> list[str]:
    checkpoint = torch.load(folder / "checkpoint.pt", weights_only=True)
    return [peer["addr"] for peer in json.loads(checkpoint["peers"])]


def host_of(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]"))


def local_accuracy(cfg: cfgmod.MeshConfig, node_index: int, num_nodes: int) -> float:
    """Test accuracy of the Local rule on a node's data: its own model, its own
    rounds of training, no peers."""
    data_cfg = cfg.data
    data = load_node_data(
        data_cfg.dataset,
        data_cfg.root,
        data_cfg.partition,
        num_nodes,
        node_index,
        cfg.seed,
        data_cfg.samples_per_node,
        tuple(data_cfg.split),
    )
    model = build_model(
        cfg.model.name, data.input_shape, data.num_classes, cfg.model.head, seed=cfg.seed
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # batches of 16 gain nothing from more; a busy machine loses
    try:
        for round_no in range(1, cfg.rounds + 1):
            train_local(
                model,
                data.x_train,
                data.y_train,
                cfg.local_epochs,
                cfg.batch_size,
                cfg.optimizer,
                cfg.lr,
                seed=node_index * 1009 + round_no,
                momentum=cfg.momentum,
            )
    finally:
        torch.set_num_threads(threads)
    return evaluate(model, data.x_test, data.y_test, data.num_classes).accuracy


@needs_netns
def test_three_hosts_and_a_joiner_learn_over_a_virtual_lan(lan, tmp_path):
    for _ in range(len(NAMED) + 1):
        namespace = lan.add_host()
        default_route = subprocess.run(
            ["ip", "-n", namespace, "route", "show", "default"], capture_output=True, text=True
        ).stdout.strip()
        assert not default_route, "a host with a default route could send beyond the LAN"
    config = tmp_path / "peers.yaml"
    cfg = write_peers(config, tmp_path)
    assert cfg.encrypt, "the LAN mesh runs encrypted, the default"
    run_mesh(lan, config, tmp_path)

    hosts = {name: index for index, name in enumerate([*NAMED, JOINER])}
    lan_addresses = {f"tcp://{lan_address(index)}" for index in hosts.values()}
    joined = records(host_dir(tmp_path, hosts[JOINER]), JOINER)
    assert joined and joined[0]["round"] > 1, "the joiner came into a running mesh"
    assert any(record["received"] for record in joined), "the joiner learned from the mesh"
    for name, index in hosts.items():
        folder = node_dir(tmp_path, index, name)
        last = records(host_dir(tmp_path, index), name)[-1]
        assert last["round"] == cfg.rounds, f"{name} finished every round"
        addresses = peer_addresses(folder)
        assert len(addresses) == len(hosts) - 1, f"{name} knows every other host: {addresses}"
        assert not any(host_of(address).is_loopback for address in addresses), addresses
        assert {address.rsplit(":", 1)[0] for address in addresses} < lan_addresses
        # The joiner's shard is node N of N+1, as `meshfl join` draws it.
        num_nodes = len(NAMED) + (name == JOINER)
        alone = local_accuracy(cfg, index, num_nodes)
        print(f"{name}: mesh {last['test_acc']:.3f}, Local {alone:.3f}")
        assert last["test_acc"] > alone, f"{name} learned more in the mesh than alone"


def test_a_late_member_listed_in_peers_yaml_joins_as_its_entry(tmp_path, monkeypatch):
    """The way into a closed mesh: `meshfl join --name` of a listed peer takes that
    peer's address, key and shard, not a free port and shard N of N+1."""
    started = []
    monkeypatch.setattr(entry, "_run", lambda options: started.append(options) or 0)
    monkeypatch.chdir(tmp_path)  # the joiner's key is made where it is named, from here
    config = tmp_path / "peers.yaml"
    write_peers(config, tmp_path)  # alpha's listed key lets the joiner dial it encrypted
    assert (
        main(
            [
                "join",
                f"tcp://{lan_address(0)}:{PORT}",
                "--config",
                str(config),
                "--name",
                "gamma",
                "--set",
                "peers.gamma.key=keys/gamma.pem",
            ]
        )
        == 0
    )
    (options,) = started
    assert options.listen == f"tcp://{lan_address(2)}:{PORT}"
    assert options.key_path == Path("keys/gamma.pem")
    assert (options.node_index, options.num_nodes) == (2, len(NAMED))
    assert options.joining
