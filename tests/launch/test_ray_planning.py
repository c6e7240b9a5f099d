"""How `meshfl launch --ray` spreads nodes over a cluster's machines and copies their
files back, without a cluster: the pure planning and the two ends of the mirror."""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace

from meshfl.launch.ray_hosts import Machine, MachineRun, Mirror, plan_hosts
from meshfl.launch.ray_machine import HostListing, RayMachine

NAMES = [f"node{i}" for i in range(10)]


def test_nodes_go_to_machines_by_their_cpus_one_host_per_cpu():
    big, small = Machine("a", "10.0.0.1", 3.0), Machine("b", "10.0.0.2", 1.0)
    placements = plan_hosts(NAMES, [big, small], hosts=None)
    assert [p.machine for p in placements] == [big, small]
    assert [sum(map(len, p.groups)) for p in placements] == [8, 2]  # 10 nodes as 3 : 1
    assert [len(p.groups) for p in placements] == [3, 1]
    assert [name for p in placements for g in p.groups for name in g] == NAMES
    assert [p.cpus for p in placements] == [3.0, 1.0]  # each machine's actor holds them all


def test_hosts_is_a_total_and_cpus_are_asked_as_ray_can_grant_them():
    machines = [Machine("a", "10.0.0.1", 2.0), Machine("b", "10.0.0.2", 2.0)]
    assert sum(len(p.groups) for p in plan_hosts(NAMES, machines, hosts=3)) == 3
    (odd,) = plan_hosts(NAMES[:3], [Machine("a", "10.0.0.1", 1.33337)], hosts=3)
    assert odd.cpus == 1.3333  # Ray counts ten-thousandths: never more than it has


def test_the_mirror_copies_appended_bytes_and_a_file_written_anew_whole(tmp_path: Path):
    host = RayMachine(f"test-{uuid.uuid4().hex[:8]}", "machine0", [("node0", ["node0"])])
    host.root = tmp_path / "where-the-node-runs"
    metrics = host.root / "node0" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    mirror = Mirror(tmp_path / "run")
    process = MachineRun(
        "machine0", Machine("a", "ip", 1.0), [("node0", ["node0"])], None, 1.0, "run"
    )
    copy = mirror.out / "node0" / "metrics.jsonl"

    def pull() -> None:  # what Mirror.pull does over Ray
        for relative, (start, data) in host.files(mirror._copies(process)).items():
            mirror._write(relative, start, data)

    metrics.write_text('{"round": 1}\n{"round": 2}\n')
    pull()
    metrics.write_text('{"round": 1}\n{"round": 2}\n{"round": 3}\n')  # appended
    pull()
    assert copy.read_text() == metrics.read_text()
    # A resumed node drops round 3 and redoes it, the file as long as before.
    metrics.write_text('{"round": 1}\n{"round": 2}\n{"round": 9}\n')
    pull()
    assert copy.read_text() == metrics.read_text()


def test_restarts_are_counted_per_node_by_the_actor_and_after_it_was_lost():
    runs: list[tuple] = []
    actor = SimpleNamespace(run=SimpleNamespace(remote=lambda *args: runs.append(args)))
    hosts = [("host0", ["a"]), ("host1", ["b"])]
    machine = MachineRun("machine0", Machine("m", "ip", 2.0), hosts, actor, 2.0, "run")
    machine.start_run("config", restarts=1)
    assert runs[-1][1:] == (["a", "b"], 2.0, 1, {"a": 0, "b": 0})
    # The actor forked host0 again once; then the actor itself was lost.
    machine.listing = [
        HostListing("host0", 11, ["a"], {"a": 1}),
        HostListing("host1", 12, ["b"], {}),
    ]
    assert [machine.restarts_of(name) for name in "ab"] == [1, 0]
    assert machine.resumable(restarts=1) == ["b"], "a has spent its restart, b has not"
    machine.running = ["b"]
    machine.start_run("config", restarts=1, again=["b"])
    assert runs[-1][1:] == (["b"], 2.0, 1, {"a": 1, "b": 1})  # the new actor starts from these
    assert [machine.restarts_of(name) for name in "ab"] == [1, 1]
    assert machine.log_groups() == [["a"], ["b"]]
    machine.listing = [HostListing("host1", 13, ["b"], {"b": 1})]
    assert machine.restarts_of("b") == 1, "the actor's count includes the one it was given"
