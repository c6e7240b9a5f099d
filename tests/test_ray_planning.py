"""How `meshfl launch --ray` spreads nodes over a cluster's machines and copies their
files back, without a cluster: the pure planning and the two ends of the mirror."""

from __future__ import annotations

import uuid
from pathlib import Path

from meshfl.launch.ray_hosts import Machine, MachineRun, Mirror, RayMachine, plan_hosts

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
    host = RayMachine(f"test-{uuid.uuid4().hex[:8]}", "a-ray-node", [("node0", ["node0"])])
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
