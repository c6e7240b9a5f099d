"""Nodes and hosts that join the mesh together (node/joining.py): no node greets the mesh
while a node of its host, or of another host of its launch, is still being built; a
member that never arrives holds the others only for the patience. Stand-in nodes, real
host threads and a real folder for the launch's notes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from meshfl.launch.cli import build_parser
from meshfl.launch.options import ConfigSource, ProcessOptions
from meshfl.launch.supervise import _entry
from meshfl.node.config import MeshConfig
from meshfl.node.host import NodeHost
from meshfl.node.joining import JOINING_DIR, JoinTogether, LaunchGate, wait_while_arriving
from meshfl.node.runtime import NodeOptions


class StandIn:
    """A node that notes when it was built and when it started its rounds."""

    def __init__(self, name: str, events: list[tuple[str, str, float]]) -> None:
        self.name, self.events = name, events
        self.endpoint = self
        self.cpu = None
        events.append(("built", name, time.monotonic()))

    def run(self) -> None:
        self.events.append(("run", self.name, time.monotonic()))

    def close(self) -> None:
        pass


def options(out: Path, name: str) -> NodeOptions:
    return NodeOptions(MeshConfig(), name, f"tcp://127.0.0.1:0/{name}", out / name, Path(), 0, 1)


def host(out: Path, names: list[str], events: list, build_s: float, gate: LaunchGate) -> NodeHost:
    def make_node(each: NodeOptions) -> StandIn:
        time.sleep(build_s)
        return StandIn(each.name, events)

    return NodeHost([options(out, name) for name in names], make_node, gate=gate)


def run_hosts(*hosts: NodeHost) -> None:
    threads = [threading.Thread(target=each.run) for each in hosts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()


def test_the_hosts_of_a_launch_join_together_once_each_has_built_its_nodes(tmp_path):
    events: list[tuple[str, str, float]] = []
    folder = tmp_path / JOINING_DIR
    fast = host(tmp_path, ["a1", "a2"], events, 0.0, LaunchGate(folder, "a1", 2))
    slow = host(tmp_path, ["b1", "b2", "b3"], events, 0.4, LaunchGate(folder, "b1", 2))
    run_hosts(fast, slow)
    last_build = max(at for kind, _, at in events if kind == "built")
    first_run = min(at for kind, _, at in events if kind == "run")
    assert first_run >= last_build
    assert sorted(name for kind, name, _ in events if kind == "run") == [
        "a1",
        "a2",
        "b1",
        "b2",
        "b3",
    ]
    assert sorted(path.name for path in folder.iterdir()) == ["a1", "b1"]


def test_a_host_whose_partner_never_arrives_joins_after_the_patience(tmp_path):
    events: list[tuple[str, str, float]] = []
    gate = LaunchGate(tmp_path / JOINING_DIR, "a1", hosts=2, patience=0.3)
    started = time.monotonic()
    run_hosts(host(tmp_path, ["a1", "a2"], events, 0.0, gate))
    waited = min(at for kind, _, at in events if kind == "run") - started
    assert 0.3 <= waited < 3


def test_a_host_started_again_waits_for_no_one(tmp_path):
    folder = tmp_path / JOINING_DIR
    for name in ("a1", "b1"):
        LaunchGate(folder, name, hosts=2, patience=0.1).arrive_and_wait()
    started = time.monotonic()
    assert LaunchGate(folder, "a1", hosts=2, patience=10).arrive_and_wait()
    assert time.monotonic() - started < 1


def test_a_wait_goes_on_while_members_keep_arriving_and_ends_when_they_stop():
    started = time.monotonic()

    def arriving() -> int:  # one more every 0.1 s, up to 8
        return min(8, 1 + int((time.monotonic() - started) / 0.1))

    assert wait_while_arriving(arriving, 8, lambda left: time.sleep(min(left, 0.02)), 0.25)
    assert time.monotonic() - started >= 0.7  # longer than the patience, in all
    stalled = time.monotonic()
    assert not wait_while_arriving(lambda: 3, 8, lambda left: time.sleep(min(left, 0.02)), 0.2)
    assert 0.2 <= time.monotonic() - stalled < 1


def test_a_node_built_after_its_host_stopped_waiting_goes_at_once():
    joining = JoinTogether(3, patience=0.3)
    waited: dict[str, float] = {}

    def build_and_join(name: str, build_s: float) -> None:
        time.sleep(build_s)
        arrived = time.monotonic()
        joining.built()
        waited[name] = time.monotonic() - arrived

    threads = [
        threading.Thread(target=build_and_join, args=each)
        for each in (("first", 0.0), ("second", 0.05), ("stuck", 1.0))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert 0.3 <= waited["first"] < 0.9 and 0.2 <= waited["second"] < 0.9
    assert waited["stuck"] < 0.2


def test_a_host_started_as_a_fresh_interpreter_joins_with_the_same_hosts_as_a_forked_one(
    tmp_path,
):
    options = ProcessOptions(ConfigSource(), tmp_path, local_nodes=2)
    _, command = _entry(["node0", "node1"], options, restarts=0, join_with=3)
    args = build_parser().parse_args([*command, *options.argv()])
    assert (args.command, args.names, args.join_with) == ("host", "node0,node1", 3)
    _, alone = _entry(["node0", "node1"], options, restarts=0)
    assert build_parser().parse_args([*alone, *options.argv()]).join_with == 0
