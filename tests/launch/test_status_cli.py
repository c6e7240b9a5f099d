"""`meshfl status` against a node of a running `meshfl launch` (real processes, loopback)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.nodes import free_ports, meshfl, records, wait_round

pytestmark = pytest.mark.slow  # real processes over real sockets

LAUNCH_START = 120.0  # generous: the machine may be shared and busy


def run_status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshfl.launch.cli", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces and brackets: fields resume after the last ')'.
        if entry.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


@pytest.fixture
def running_launch(tmp_path):
    """A `meshfl launch` of two digits nodes with many rounds, stopped after the test."""
    out = tmp_path / "run"
    launch = meshfl(
        "launch",
        "--nodes",
        "2",
        "--rounds",
        "500",
        "--out",
        str(out),
        "--quiet",
        log=tmp_path / "launch.log",
    )
    nodes: list[int] = []
    try:
        wait_round(out, "node0", 1, timeout=LAUNCH_START)
        nodes = children(launch.pid)
        yield out
    finally:
        if launch.poll() is None:
            # The launch stops its nodes on SIGTERM as on Ctrl-C; SIGINT would be ignored
            # where the tests run as a background job (it starts with SIGINT ignored).
            os.killpg(launch.pid, signal.SIGTERM)
        try:
            launch.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait(timeout=10)
        for pid in nodes:  # each node leads its own process group
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_status_of_a_node_of_a_running_launch(running_launch):
    out = running_launch
    config = yaml.safe_load((out / "config.yaml").read_text())
    address = next(peer["listen"] for peer in config["peers"] if peer["name"] == "node0")
    info = {name: json.loads((out / name / "info.json").read_text()) for name in ("node0", "node1")}

    contact = f"{info['node0']['public_key']}@{address}"  # the node encrypts: ask with its key
    result = run_status(contact, "--json", "--timeout", "20")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert (status["name"], status["id"], status["public_key"], status["addr"]) == (
        "node0",
        info["node0"]["id"],
        info["node0"]["public_key"],
        address,
    )
    assert len(status["mesh"]) == 32 and status["algorithm"] == "fedavg"
    assert status["rounds"] == 500 and status["round"] >= 1
    (peer,) = status["peers"]
    assert (peer["name"], peer["id"], peer["state"]) == ("node1", info["node1"]["id"], "alive")
    assert 0 <= peer["last_seen_s"] < config["peer_timeout"]
    assert status["accuracies"], "node0 finished a round before we asked"
    done = {record["round"]: record["test_acc"] for record in records(out, "node0")}
    for score in status["accuracies"]:
        assert score["test_acc"] == done[score["round"]]
    assert isinstance(status["rejections"], dict)

    readable = run_status(contact, "--timeout", "20")
    assert readable.returncode == 0, readable.stderr
    first, *rest = readable.stdout.splitlines()
    assert first == f"node0  id {info['node0']['id']}  at {address}"
    assert any(line.split()[:2] == ["node1", "alive"] for line in rest)
    assert any(line.startswith("test accuracy: round ") for line in rest)

    unkeyed = run_status(address, "--timeout", "1")
    assert unkeyed.returncode == 2 and "KEY@tcp://HOST:PORT" in unkeyed.stderr


def test_status_with_nobody_listening_is_one_line_and_exit_2():
    (port,) = free_ports(1)
    result = run_status(f"tcp://127.0.0.1:{port}", "--timeout", "0.5")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("meshfl: error: no status answer from") and "--key" in line
