"""meshfl from Python (launch/api.py): `meshfl.launch(...)` runs a mesh and returns its
summary; `run_node` runs one peer of a peers.yaml inside the calling program."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshfl import launch
from tests.nodes import start_node, stop, write_config

TASK = Path(__file__).parents[1] / "tasks" / "digits_task.py"


@pytest.mark.slow
def test_launch_from_python_returns_the_runs_summary(tmp_path):
    summary = launch(
        nodes=3,
        task=TASK,
        algorithm="fedavg",
        rounds=3,
        settings={"heartbeat_interval": 0.3, "peer_timeout": 1.5},
        out=tmp_path / "run",
    )
    assert [(node["name"], node["status"], node["round"]) for node in summary["nodes"]] == [
        (f"node{i}", "finished", 3) for i in range(3)
    ]
    assert summary["mean_test_acc"] > 0.5
    assert (tmp_path / "run" / "summary.json").is_file()


def test_a_mistake_given_to_launch_raises_the_line_the_command_prints(tmp_path):
    with pytest.raises(launch.UserError, match="config field 'algorithm.name': got 'nope'"):
        launch(algorithm="nope", out=tmp_path / "run")
    with pytest.raises(launch.UserError, match="--nodes: got 0"):
        launch(nodes=0, out=tmp_path / "run")
    with pytest.raises(launch.UserError, match="no_such_task.py"):
        launch(nodes=2, task=tmp_path / "no_such_task.py", out=tmp_path / "run")


@pytest.mark.slow
def test_one_node_runs_inside_a_users_program_beside_node_processes(tmp_path):
    config = tmp_path / "peers.yaml"
    write_config(config, 3, task=str(TASK), rounds=3)
    out = tmp_path / "out"
    others = [start_node(config, f"node{index}", out) for index in (0, 1)]
    try:
        record = launch.run_node(config, "node2", out=out)
    finally:
        stop(others)
    assert record is not None and record["round"] == 3 and record["test_acc"] > 0.5
    assert {"node0", "node1"} <= set(record["received"])
