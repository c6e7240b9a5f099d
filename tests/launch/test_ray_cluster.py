"""`meshfl launch --ray` on a Ray cluster the test starts itself (launch/ray_local.py): a
head and a second Ray node, each in a network namespace of its own with its own
address where the machine allows (tests/netns.py), so that the mesh's traffic really
crosses hosts; else both on loopback. The cluster is stopped at the end whatever the
outcome, and every wait is bounded.

One run of 10 nodes shows what a user relies on: nodes on different Ray nodes exchange
blobs over meshfl's own wire, the run folder is gathered on the launching machine, a
host killed on one Ray node is forked again there by its machine's actor, and when the
actor of the other Ray node is killed Ray brings it back there; either way the
stopped nodes resume from their checkpoints while the others go on.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from meshfl.launch.cli import main
from meshfl.launch.ray_hosts import run_id_of
from meshfl.launch.ray_local import LocalRayCluster, Place
from meshfl.launch.ray_machine import scratch_folder
from tests.netns import can_build_namespaces, virtual_lan
from tests.nodes import records

# Rounds enough that the other machine's nodes are still running when its actor is
# killed: the launcher sees their rounds through copies that lag a few seconds.
NODES, ROUNDS = 10, 16
SUBNET = "10.78.0"  # private; apart from the LAN test's
RUN_LIMIT_S = 600.0

# One Ray cluster for the module: under pytest -n its tests share one worker.
pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayCluster]:
    """A head (place 0) and one more Ray node (place 1), one CPU each, for the module."""
    if importlib.util.find_spec("ray") is None:  # Ray runs in its own processes only
        pytest.skip("the ray extra: pip install -e '.[ray]'")
    logs = tmp_path_factory.mktemp("cluster")
    with contextlib.ExitStack() as stack:
        places = [Place(), Place()]
        if can_build_namespaces():
            lan = stack.enter_context(virtual_lan(SUBNET))
            namespaces = [lan.add_host(), lan.add_host()]
            places = [
                Place(lan.address(index), ("ip", "netns", "exec", namespace))
                for index, namespace in enumerate(namespaces)
            ]
        yield stack.enter_context(LocalRayCluster(places, cpus=1, logs=logs))


@pytest.fixture
def out(tmp_path: Path) -> Iterator[Path]:
    """A run folder; the Ray scratch folders of its run are removed at the end."""
    yield tmp_path / "run"
    if (run_id := run_id_of(tmp_path / "run")) is not None:
        shutil.rmtree(scratch_folder(run_id), ignore_errors=True)


def launch(cluster: LocalRayCluster, out: Path, *args: str) -> subprocess.Popen:
    """`meshfl launch --ray` beside the head, its output in `out`.log."""
    command = [sys.executable, "-m", "meshfl.launch.cli", "launch", "--ray", cluster.address]
    return cluster.run([*command, "--out", str(out), "--quiet", *args], out.with_suffix(".log"))


def processes(out: Path) -> list[dict]:
    return json.loads((out / "processes.json").read_text())["processes"]


def wait_for(condition, what: str, launch: subprocess.Popen) -> None:
    deadline = time.monotonic() + RUN_LIMIT_S
    while not condition():
        assert launch.poll() is None, f"launch exited ({launch.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def finished_summary(mesh: subprocess.Popen, out: Path) -> dict:
    """The run's summary.json once `meshfl launch --ray` has exited 0 (killed if not)."""
    try:
        assert mesh.wait(timeout=RUN_LIMIT_S) == 0, out.with_suffix(".log").read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(mesh.pid, signal.SIGKILL)
    return json.loads((out / "summary.json").read_text())


def host_of(address: str) -> str:
    return address.removeprefix("tcp://").rsplit(":", 1)[0]


@pytest.mark.slow  # a Ray cluster and real node hosts
def test_a_mesh_spread_over_two_ray_nodes_learns_gathers_its_folder_and_survives_a_kill(
    ray_cluster, out
):
    mesh = launch(
        ray_cluster, out, "--nodes", str(NODES), "--rounds", str(ROUNDS), "--restarts", "1"
    )
    try:
        wait_for(
            lambda: (out / "processes.json").exists() and all(h["pid"] for h in processes(out)),
            "the hosts to start",
            mesh,
        )
        hosts = processes(out)
        assert len({host["ray_node"] for host in hosts}) == 2, "hosts on both Ray nodes"
        victim = hosts[-1]
        wait_for(
            lambda: all(len(records(out, name)) >= 2 for name in victim["nodes"]),
            "the victim host's nodes to finish round 2",
            mesh,
        )
        os.kill(victim["pid"], signal.SIGKILL)  # its machine's actor forks it again
        # The actor of the other machine dies: its hosts stop with it, Ray brings it back.
        agent = hosts[0]["agent"]
        orphaned = {name for host in hosts if host["agent"] == agent for name in host["nodes"]}
        wait_for(
            lambda: all(len(records(out, name)) >= 4 for name in orphaned),
            "the other machine's nodes to finish round 4",
            mesh,
        )
        os.kill(agent, signal.SIGKILL)
        assert mesh.wait(timeout=RUN_LIMIT_S) == 0, out.with_suffix(".log").read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(mesh.pid, signal.SIGKILL)

    summary = json.loads((out / "summary.json").read_text())
    assert [node["status"] for node in summary["nodes"]] == ["finished"] * NODES
    restarted = {node["name"] for node in summary["nodes"] if node["restarts"]}
    assert restarted == set(victim["nodes"]) | orphaned, "exactly the stopped nodes restarted"
    after = {host["label"]: host for host in processes(out)}
    assert after[victim["label"]]["pid"] != victim["pid"]
    assert after[victim["label"]]["ray_node"] == victim["ray_node"]
    assert after[hosts[0]["label"]]["agent"] != agent
    assert after[hosts[0]["label"]]["ray_node"] == hosts[0]["ray_node"]

    # The run folder is gathered here; checkpoints and keys stay where the nodes ran.
    assert (out / "config.yaml").is_file()
    for name in (f"node{i}" for i in range(NODES)):
        rounds = [record["round"] for record in records(out, name)]
        assert rounds[-1] == ROUNDS and rounds == sorted(set(rounds)), (name, rounds)
        assert (out / name / "info.json").is_file() and (out / name / "node.log").is_file()
        assert not (out / name / "checkpoint.pt").exists()
    for name in restarted:
        assert "resumed from the checkpoint of round" in (out / name / "node.log").read_text()

    # Nodes on one Ray node fetched blobs from nodes on the other, over meshfl's wire.
    ray_node_of = {name: host["ray_node"] for host in hosts for name in host["nodes"]}
    for name, ray_node in ray_node_of.items():
        senders = {f["from"] for r in records(out, name) for f in r["transport_fetches"]}
        assert any(ray_node_of.get(sender) != ray_node for sender in senders), name
    if ray_cluster.places[0].prefix:  # namespaces: each node listened on its Ray node's address
        peers = yaml.safe_load((out / "config.yaml").read_text())["peers"]
        listens = {peer["name"]: host_of(peer["listen"]) for peer in peers}
        ip_of = {host["ray_node"]: host["ip"] for host in hosts}
        assert set(ip_of.values()) == {place.ip for place in ray_cluster.places}
        for name, ray_node in ray_node_of.items():
            assert listens[name] == ip_of[ray_node]
            assert not ipaddress.ip_address(listens[name]).is_loopback


@pytest.mark.slow
def test_a_coordinated_rule_runs_its_coordinator_in_a_host_of_its_own(ray_cluster, out):
    mesh = launch(ray_cluster, out, "--nodes", "6", "--rounds", "3", "--algorithm", "fedavg_server")
    summary = finished_summary(mesh, out)
    assert [node["status"] for node in summary["nodes"]] == ["finished"] * 6
    assert ["coordinator"] in [host["nodes"] for host in processes(out)]
    assert len(records(out, "coordinator")) == 3, "the coordinator's metrics came back"
    run_id = run_id_of(out)
    assert run_id is not None and not scratch_folder(run_id).exists(), "a finished run leaves none"


@pytest.mark.slow
def test_a_users_task_runs_on_the_ray_cluster(ray_cluster, out):
    """The task file travels by its path: every Ray node of this machine reads it."""
    task = Path(__file__).parents[1] / "tasks" / "digits_task.py"
    mesh = launch(ray_cluster, out, "--task", str(task), "--nodes", "4", "--rounds", "3")
    summary = finished_summary(mesh, out)
    assert summary["task"] == str(task)
    assert [node["status"] for node in summary["nodes"]] == ["finished"] * 4
    assert all(node["test_acc"] > 0.5 for node in summary["nodes"])


def test_without_ray_installed_launch_says_how_to_install_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # what an install without the extra sees
    assert main(["launch", "--ray", "auto", "--out", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "pip install 'meshfl[ray]'" in error
