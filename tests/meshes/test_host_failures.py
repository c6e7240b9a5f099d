"""How a node host takes a node that fails, with stand-in nodes in this process (the
real ones are in test_node_host.py): what each log says, and restarts from the
checkpoint while the other nodes go on."""

from __future__ import annotations

import errno
import io
import logging
import sys
import time
from pathlib import Path

import pytest

from meshfl.node.checkpoint import CheckpointError, StorageError
from meshfl.node.config import MeshConfig
from meshfl.node.host import (
    FAILED,
    FINISHED,
    RESTARTS_FILE,
    SWITCH_INTERVAL_S,
    NodeHost,
    record_restarts,
    restarts_so_far,
)
from meshfl.node.logs import FORMAT, OneLineFormatter
from meshfl.node.runtime import NodeOptions

log = logging.getLogger("meshfl.node")

FULL_DISK = OSError(errno.ENOSPC, "No space left on device")


class Endpoint:
    def close(self) -> None:
        pass


class StandIn:
    """A node whose run fails with the next of `failures` (None: it finishes)."""

    def __init__(self, name: str, failures: list[Exception | None]) -> None:
        self.name, self.failures = name, failures
        self.endpoint = Endpoint()
        self.cpu = None

    def run(self) -> None:
        log.info("%s: round 1", self.name)
        failure = self.failures.pop(0) if self.failures else None
        if failure is not None:
            raise failure


def options(out: Path, name: str) -> NodeOptions:
    return NodeOptions(MeshConfig(), name, f"tcp://127.0.0.1:0/{name}", out / name, Path(), 0, 1)


@pytest.fixture
def host_log():
    """What the host's own log (its stderr) shows, one string."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(OneLineFormatter(FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)
    level, root.level = root.level, logging.INFO
    yield stream
    root.removeHandler(handler)
    root.level = level


def run_host(out: Path, failures: dict[str, list], restarts: int = 0) -> dict[str, str]:
    """Run stand-ins named as `failures` in one host; how each ended."""

    def make_node(each: NodeOptions) -> StandIn:
        return StandIn(each.name, failures[each.name])

    host = NodeHost([options(out, name) for name in failures], make_node, restarts)
    return {name: end.status for name, end in host.run().items()}


def node_log(out: Path, name: str) -> str:
    return (out / name / "node.log").read_text()


@pytest.mark.parametrize(
    "error",
    [
        StorageError(Path("run/node1/checkpoint.pt"), FULL_DISK, "; the previous one is kept"),
        CheckpointError("checkpoint run/node1/checkpoint.pt does not read: cut short"),
    ],
    ids=["full disk", "damaged checkpoint"],
)
def test_an_expected_stop_is_one_line_in_the_node_log_and_in_the_host_log(
    tmp_path, host_log, error
):
    ends = run_host(tmp_path, {"node0": [None], "node1": [error]})
    assert ends == {"node0": FINISHED, "node1": FAILED}
    lines = node_log(tmp_path, "node1").splitlines()
    assert f"meshfl: error: {error}" in lines, lines  # as a node alone in its process says it
    assert "Traceback" not in node_log(tmp_path, "node1")
    assert f"meshfl: error: node1: {error}" in host_log.getvalue().splitlines()
    assert "Traceback" not in host_log.getvalue()
    assert "meshfl: error" not in node_log(tmp_path, "node0"), "one log a node"


def test_an_unexpected_error_is_a_traceback_in_the_node_log_and_one_line_in_the_host_log(
    tmp_path, host_log
):
    run_host(tmp_path, {"node0": [None], "node1": [ZeroDivisionError("division by zero")]})
    assert "Traceback" in node_log(tmp_path, "node1")
    assert "ZeroDivisionError: division by zero" in node_log(tmp_path, "node1")
    lines = [line for line in host_log.getvalue().splitlines() if "node1" in line]
    assert any("unexpected error, ZeroDivisionError" in line for line in lines), lines
    assert "Traceback" not in host_log.getvalue()


def test_a_failed_node_is_restarted_at_once_and_counted_in_its_folder(tmp_path, host_log):
    ends = run_host(tmp_path, {"node0": [None], "node1": [RuntimeError("boom"), None]}, 2)
    assert ends == {"node0": FINISHED, "node1": FINISHED}
    assert restarts_so_far(tmp_path / "node1") == 1
    assert not (tmp_path / "node0" / RESTARTS_FILE).exists()
    said = "node1: restarting from its checkpoint (restart 1 of 2)"
    assert said in node_log(tmp_path, "node1") and said in host_log.getvalue()
    assert node_log(tmp_path, "node1").count("node1: round 1") == 2


def test_a_node_that_keeps_failing_stops_after_its_restarts_counted_with_earlier_ones(
    tmp_path, host_log
):
    (tmp_path / "node1").mkdir()
    record_restarts(tmp_path / "node1", 1)  # `meshfl launch` restarted its host once
    failures = [RuntimeError("boom")] * 5
    ends = run_host(tmp_path, {"node0": [None], "node1": failures}, restarts=3)
    assert ends == {"node0": FINISHED, "node1": FAILED}
    assert restarts_so_far(tmp_path / "node1") == 3
    assert len(failures) == 2, "ran 3 times: restarts 2 and 3 of 3"
    assert "node1: stopped; the host's other nodes go on" in host_log.getvalue()


def test_a_restart_that_cannot_be_counted_on_a_full_disk_does_not_happen(
    tmp_path, host_log, monkeypatch
):
    def full_disk(node_dir: Path, count: int) -> None:
        raise StorageError(node_dir / RESTARTS_FILE, FULL_DISK)

    monkeypatch.setattr("meshfl.node.host.record_restarts", full_disk)
    ends = run_host(tmp_path, {"node1": [RuntimeError("boom"), None]}, restarts=1)
    assert ends == {"node1": FAILED}
    assert "no space left on device" in node_log(tmp_path, "node1")


def test_a_hosts_nodes_join_together_once_all_are_built_and_a_restart_waits_for_none(tmp_path):
    # One node is slow to build, one fails to build once, one fails in its round once:
    # no node starts its round before every first build has ended, and a node started
    # again waits for no one (else it would wait out its host's patience, joining.py).
    events: list[tuple[str, str]] = []
    broken_once = ["broken"]
    failures: dict[str, list] = {"slow": [], "broken": [], "flaky": [RuntimeError("round 1")]}

    def make_node(each: NodeOptions) -> StandIn:
        if each.name == "slow":
            time.sleep(0.3)
        if each.name in broken_once:
            broken_once.remove(each.name)
            events.append(("built", each.name))
            raise OSError("cannot bind")
        events.append(("built", each.name))
        node = StandIn(each.name, failures[each.name])
        run = node.run
        node.run = lambda: (events.append(("run", each.name)), run())[1]  # type: ignore[method-assign]
        return node

    names = list(failures)
    host = NodeHost([options(tmp_path, name) for name in names], make_node, restarts=1)
    started = time.monotonic()
    ends = host.run()
    assert time.monotonic() - started < 5
    assert {name: end.status for name, end in ends.items()} == dict.fromkeys(names, FINISHED)
    first_run = next(at for at, (kind, _) in enumerate(events) if kind == "run")
    assert {name for kind, name in events[:first_run] if kind == "built"} == set(names)


def test_a_host_hands_the_interpreter_lock_on_less_often_while_it_runs_and_not_after(tmp_path):
    # Hundreds of threads in one process: a forced hand-over every 5 ms left nodes silent
    # for longer than the down timeout (node/host.py, SWITCH_INTERVAL_S).
    seen: list[float] = []

    def make_node(each: NodeOptions) -> StandIn:
        node = StandIn(each.name, [])
        node.run = lambda: seen.append(sys.getswitchinterval())  # type: ignore[method-assign]
        return node

    before = sys.getswitchinterval()
    NodeHost([options(tmp_path, "a"), options(tmp_path, "b")], make_node).run()
    assert seen == [SWITCH_INTERVAL_S] * 2
    assert sys.getswitchinterval() == before != SWITCH_INTERVAL_S


def test_a_host_builds_its_nodes_one_at_a_time(tmp_path):
    # In a process just forked, two threads making their first torch calls at once can
    # crash it: no two builds may overlap.
    building, most = [0], [0]

    def make_node(each: NodeOptions) -> StandIn:
        building[0] += 1
        most[0] = max(most[0], building[0])
        time.sleep(0.05)  # long enough for the other threads to start theirs
        building[0] -= 1
        return StandIn(each.name, [])

    ends = NodeHost([options(tmp_path, name) for name in "abcd"], make_node).run()
    assert {end.status for end in ends.values()} == {FINISHED}
    assert most[0] == 1
