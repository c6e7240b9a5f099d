"""How `meshfl launch --ray` spreads nodes over a cluster's machines and copies their
files back, without a cluster: the pure planning and the two ends of the mirror."""

from __future__ import annotations

import uuid
from pathlib import Path

from meshfl.launch.ray_hosts import Machine, Mirror, RayHost, RayProcess, plan_hosts

NAMES = [f"node{i}" for i in range(10)]


def test_nodes_go_to_machines_by_their_cpus_one_host_per_cpu():
    big, small = Machine("a", "10.0.0.1", 3.0), Machine("b", "10.0.0.2", 1.0)
    placements = plan_hosts(NAMES, [big, small], hosts=None)
    assert [p.machine for p in placements] == [big, small]
    assert [sum(map(len, p.groups)) for p in placements] == [8, 2]  # 10 nodes as 3 : 1
    assert [len(p.groups) for p in placements] == [3, 1]
    assert [name for p in placements for g in p.groups for name in g] == NAMES
    assert placements[0].cpus_per_host == 1.0


def test_hosts_is_a_total_and_a_share_is_one_ray_can_grant():
    machines = [Machine("a", "10.0.0.1", 2.0), Machine("b", "10.0.0.2", 2.0)]
    assert sum(len(p.groups) for p in plan_hosts(NAMES, machines, hosts=3)) == 3
    (lone,) = plan_hosts(NAMES[:3], [Machine("a", "10.0.0.1", 1.0)], hosts=3)
    assert lone.cpus_per_host * 3 <= 1.0  # 0.3333 each, never 3 x 0.33334


def test_the_mirror_copies_appended_bytes_and_a_file_written_anew_whole(tmp_path: Path):
    host = RayHost(f"test-{uuid.uuid4().hex[:8]}", ["node0"])
    host.root = tmp_path / "where-the-node-runs"
    metrics = host.root / "node0" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    mirror = Mirror(tmp_path / "run")
    process = RayProcess("node0", ["node0"], None, Machine("a", "ip", 1.0), 1.0, "run")
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
