"""Nodes for tests: real `meshfl node` / `meshfl join` processes for multi-process tests,
and nodes in this process made of the parts a test gives (`node_from`)."""

from __future__ import annotations

import inspect
import json
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from meshfl.node.config import MeshConfig
from meshfl.node.runtime import Node, NodeOptions
from meshfl.protocol.ports import free_ports
from tests.spawn import Spawned, run_to_end, spawn, stop


def node_from(
    role: type[Node] = Node, *, name: str = "me", config: MeshConfig | None = None, **parts: Any
) -> Node:
    """A node of `role` named `name`, made of the `parts` a test gives (endpoint=,
    algorithm=, ...; build_node makes a real node's). A part left out is None: the code
    under test must not reach it."""
    options = NodeOptions(
        config or MeshConfig(),
        name,
        listen="tcp://127.0.0.1:0",
        out_dir=Path("unused"),
        key_path=Path("unused"),
        node_index=0,
        num_nodes=1,
    )
    left_out = {
        part: None
        for part, parameter in inspect.signature(role).parameters.items()
        if parameter.kind is parameter.KEYWORD_ONLY
    }
    return role(options, **{**left_out, **parts})


def first_node_refuses(config: Path, cfg: dict[str, Any], out: Path) -> str:
    """Run `meshfl node` as the first peer of `config` (written as `cfg`) with node1's
    place held by a socket that must never be dialled; the one line it exits 2 with."""
    host, port = cfg["peers"][1]["listen"].removeprefix("tcp://").split(":")
    with socket.socket() as peer:
        peer.bind((host, int(port)))
        peer.listen()
        peer.setblocking(False)
        result = run_to_end(
            ["node", "--config", str(config), "--name", cfg["peers"][0]["name"]]
            + ["--out", str(out)],
            timeout=120,
        )
        try:
            peer.accept()
        except BlockingIOError:
            pass  # nobody dialled
        else:
            raise AssertionError("the node contacted a peer before refusing")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    return lines[0]


def write_config(path: Path, count: int, **settings: Any) -> dict[str, Any]:
    """A loopback mesh of `count` digits nodes with fast timeouts, as peers.yaml."""
    config = {
        "mesh": "test",
        "rounds": 6,
        "round_timeout": 10.0,
        "heartbeat_interval": 0.3,
        "peer_timeout": 1.5,
        "data": {"dataset": "digits"},
        "peers": [
            {"name": f"node{i}", "listen": f"tcp://127.0.0.1:{port}"}
            for i, port in enumerate(free_ports(count))
        ],
        **settings,
    }
    path.write_text(yaml.safe_dump(config))
    return config


def meshfl(*args: str, log: Path | None = None) -> subprocess.Popen | Spawned:
    """Start `meshfl ARGS` in its own process group (so a kill takes all of it), forked
    from a process that imported torch already (tests/spawn.py)."""
    return spawn(list(args), log)


def launch_to_end(log: Path, out: Path, *args: str, timeout: float = 300) -> dict[str, Any]:
    """`meshfl launch --out OUT ARGS` run until it exits 0 (killed if it does not within
    `timeout`); its summary's nodes by name."""
    launch = meshfl("launch", "--out", str(out), *args, log=log)
    try:
        assert launch.wait(timeout=timeout) == 0, log.read_text()
    finally:
        stop([launch])
    return {node["name"]: node for node in json.loads((out / "summary.json").read_text())["nodes"]}


def start_node(config: Path, name: str, out: Path) -> subprocess.Popen:
    (out / name).mkdir(parents=True, exist_ok=True)
    return meshfl(
        "node",
        "--config",
        str(config),
        "--name",
        name,
        "--out",
        str(out),
        "--local-nodes",
        "3",
        log=out / name / "node.log",
    )


def records(out: Path, name: str) -> list[dict[str, Any]]:
    path = out / name / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def wait_round(out: Path, name: str, round_no: int, timeout: float) -> None:
    wait_until(
        lambda: any(r["round"] >= round_no for r in records(out, name)),
        timeout,
        f"{name} to finish round {round_no}",
    )


def run_nodes(config: Path, out: Path, count: int, timeout: float) -> None:
    """Run node0..node{count-1} of `config` as real processes until all of them exit;
    each must exit cleanly within `timeout` seconds."""
    processes = [start_node(config, f"node{i}", out) for i in range(count)]
    try:
        for process in processes:
            assert process.wait(timeout=timeout) == 0
    finally:
        stop(processes)


def run_coordinated_mesh(
    config: Path, out: Path, nodes: int, timeout: float, coordinator_args: tuple[str, ...] = ()
) -> None:
    """Run `config`'s coordinator and its `nodes` clients as real processes until all of
    them exit; each must exit cleanly within `timeout` seconds."""
    (out / "coordinator").mkdir(exist_ok=True)
    processes = [
        meshfl(
            "coordinator",
            "--config",
            str(config),
            "--out",
            str(out),
            *coordinator_args,
            log=out / "coordinator" / "node.log",
        )
    ]
    processes += [start_node(config, f"node{i}", out) for i in range(nodes)]
    try:
        for process in processes:
            assert process.wait(timeout=timeout) == 0
    finally:
        stop(processes)
