"""`meshfl bench scale`: what a mesh of N local nodes costs, at several N.

Each size runs the real thing, `meshfl launch --nodes N`, in a child process and
samples the proportional set size (PSS) of every process of its tree once a second:
PSS splits a shared page among the processes that map it, so the total is what the
run costs the machine (RSS would count torch's shared pages once per process). After
the run it reads what the nodes wrote: bytes each node sent by message kind, the
connections each node had open after its last round, and the "is down" lines of the
node logs (a live peer marked down because it was not heard from in time).

Each size runs with the topology its config gives (bounded views past 32 nodes:
`topology.neighbours`); `--full-mesh SIZES` runs those sizes a second time as a full
mesh, beside it, so that the two compare in one sitting.

With `--ray-nodes K` each size runs a second time on a Ray cluster of K Ray nodes
started on this machine for that run (launch/ray_local.py), the Ray processes' PSS
counted with the launcher's: what Ray costs beside a plain launch, as ratios.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import STOP_SIGNALS, raise_stopped
from ..options import add_assignments
from ..run_folder import last_record
from .flags import add_rounds, add_sizes, bench_parser, positive

if TYPE_CHECKING:
    from meshfl.node.metrics import RoundRecord

    from ..ray_local import LocalRayCluster

BLOB_KINDS = ("blob",)  # what carries model bytes; everything else is control traffic
# A node log's line for a peer it marked down (protocol/endpoint.py), naming the peer.
DOWN_MARK = re.compile(r"peer (\S+) \(.*\) is down")


@dataclass
class ScaleResult:
    nodes: int
    hosts: str
    rounds: int
    wall_s: float
    pss_mb: float
    bytes_by_kind: Counter[str]  # bytes sent by all nodes together, by message kind
    down_marks: int
    failed: bool
    topology: str = "auto"
    compression: str = "none"  # the codec of the blobs every node sent, or "mixed"
    connections: tuple[float, int] = (0.0, 0)  # per node after its last round: mean, most

    def line(self) -> str:
        per_node_round = sum(self.bytes_by_kind.values()) / (self.nodes * self.rounds)
        blob = sum(self.bytes_by_kind[kind] for kind in BLOB_KINDS)
        control = sum(self.bytes_by_kind.values()) - blob
        kinds = " ".join(
            f"{kind}_b={count / (self.nodes * self.rounds):.0f}"
            for kind, count in sorted(self.bytes_by_kind.items())
        )
        return (
            f"nodes={self.nodes} topology={self.topology} hosts={self.hosts} "
            f"compression={self.compression} "
            f"rounds={self.rounds} "
            f"wall_s={self.wall_s:.1f} pss_mb={self.pss_mb:.0f} "
            f"pss_per_node_mb={self.pss_mb / self.nodes:.1f} "
            f"bytes_per_node_round={per_node_round:.0f} "
            f"control_share={control / blob if blob else float('nan'):.3f} "
            f"connections_per_node={self.connections[0]:.1f} "
            f"connections_most={self.connections[1]} "
            f"down_marks={self.down_marks}{' FAILED' if self.failed else ''}\n"
            f"  per node and round: {kinds}"
        )


def process_tree(root: int) -> list[int]:
    """`root` and every process descended from it, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue  # gone while we looked
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass  # exited, or not ours to read
    return 0


class PeakPss:
    """Samples the total PSS of the process trees under `roots` every `period` seconds;
    keeps the peak."""

    def __init__(self, roots: list[int], period: float = 1.0) -> None:
        self.roots, self.period, self.peak_kb = roots, period, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.period):
            total = sum(pss_kb(pid) for root in self.roots for pid in process_tree(root))
            self.peak_kb = max(self.peak_kb, total)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_kb / 1024


def run_size(
    nodes: int,
    hosts: int | None,
    rounds: int,
    out: Path,
    settings: list[str],
    ray: LocalRayCluster | None = None,
) -> ScaleResult:
    """One `meshfl launch --nodes N` (on the Ray cluster `ray`, if given: its processes
    count towards the PSS, and the hosts column says "ray")."""
    command = launch_command(nodes, hosts, rounds, out, settings)
    if ray is not None:
        command += ["--ray", ray.address]
    clock = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    cluster = [each.pid for each in ray.processes] if ray is not None else []
    pss = PeakPss([process.pid, *cluster])
    _, stderr = process.communicate()
    wall = time.perf_counter() - clock
    peak = pss.stop()
    if process.returncode not in (0, 3):
        raise RuntimeError(f"meshfl launch --nodes {nodes} failed: {stderr.decode()[-800:]}")
    records = last_records(out)
    return ScaleResult(
        nodes,
        "ray" if ray is not None else str(hosts) if hosts is not None else "auto",
        rounds,
        wall,
        peak,
        sent_bytes(records),
        down_marks(out),
        process.returncode != 0,
        topology=setting_of(settings, "topology.neighbours", "auto"),
        compression=codec_of(records),
        connections=open_connections(out),
    )


def launch_command(
    nodes: int, hosts: int | None, rounds: int, out: Path, settings: list[str]
) -> list[str]:
    """The command line of a quiet `meshfl launch` of `nodes` nodes in `hosts` processes
    (None: what launch picks), with the config changes `settings`."""
    command = [sys.executable, "-m", "meshfl.launch.cli", "launch", "--nodes", str(nodes)]
    command += ["--rounds", str(rounds), "--out", str(out), "--quiet"]
    if hosts is not None:
        command += ["--hosts", str(hosts)]
    for assignment in settings:
        command += ["--set", assignment]
    return command


def setting_of(settings: list[str], key: str, default: str) -> str:
    """The value a run's --set gave `key` (the last one counts), or `default`."""
    given = [s.split("=", 1)[1] for s in settings if s.startswith(f"{key}=")]
    return given[-1] if given else default


def open_connections(out: Path) -> tuple[float, int]:
    """The connections each node had dialled and open after its last round: the mean
    over nodes and the most any node had."""
    counts = [
        record.connections
        for metrics in out.glob("*/metrics.jsonl")
        if (record := last_record(metrics.parent)) is not None and record.connections is not None
    ]
    return (sum(counts) / len(counts), max(counts)) if counts else (0.0, 0)


def last_records(out: Path) -> list[RoundRecord]:
    """Each node's last round record in the run folder `out`."""
    records = (last_record(metrics.parent) for metrics in out.glob("*/metrics.jsonl"))
    return [record for record in records if record is not None]


def sent_bytes(records: list[RoundRecord]) -> Counter[str]:
    """Bytes every node sent by message kind, up to its last round (bye excluded)."""
    total: Counter[str] = Counter()
    for record in records:
        total.update(record.bytes_sent_by_kind or {})
    return total


def codec_of(records: list[RoundRecord]) -> str:
    """The codec the nodes' blobs travelled under, as their records say ("mixed" where
    they differ)."""
    codecs = {record.compression or "none" for record in records}
    return codecs.pop() if len(codecs) == 1 else "mixed"


def down_marks(out: Path) -> int:
    """How many times a node's log marked a peer down (no peer dies in these runs)."""
    return sum(
        len(DOWN_MARK.findall(log.read_text(errors="replace"))) for log in out.glob("*/node.log")
    )


def main(argv: list[str]) -> int:
    parser = bench_parser(
        "scale",
        "Wall time, total PSS and bytes per node and round of `meshfl launch "
        "--nodes N` on the embedded digits (FedAvg unless --set says otherwise), "
        "one line per size.",
    )
    add_sizes(parser, int, [16, 50, 100], "node counts")
    add_rounds(parser, 5, "rounds per run (default: 5)")
    parser.add_argument(
        "--hosts",
        type=positive(int),
        default=None,
        help="node host processes per run (default: what launch picks)",
    )
    add_assignments(parser, "a config change for every run, repeatable")
    parser.add_argument(
        "--full-mesh",
        type=lambda text: {int(size) for size in text.split(",")},
        default=set(),
        metavar="SIZES",
        help="also run these sizes (comma-separated) as a full mesh "
        "(topology.neighbours=all), each right after its bounded run",
    )
    parser.add_argument(
        "--ray-nodes",
        type=positive(int),
        default=None,
        metavar="K",
        help="also run each size on a Ray cluster of K Ray nodes started on this machine "
        "for it (the cores split among them; its processes count towards the PSS), and "
        "print Ray's cost as ratios to the run without it",
    )
    parser.add_argument(
        "--keep",
        metavar="DIR",
        default=None,
        help="keep each run's folder under DIR (default: a temporary folder)",
    )
    args = parser.parse_args(argv)
    # A stop signal unwinds like Ctrl-C, so that a Ray cluster started here is stopped.
    for signum in STOP_SIGNALS:
        signal.signal(signum, raise_stopped)
    with tempfile.TemporaryDirectory(prefix="meshfl-scale-") as scratch:
        root = Path(args.keep or scratch)
        for size in args.sizes:
            alone = run_size(size, args.hosts, args.rounds, root / f"nodes{size}", args.assignments)
            print(alone.line(), flush=True)
            if size in args.full_mesh:
                full = [*args.assignments, "topology.neighbours=all"]
                whole = run_size(size, args.hosts, args.rounds, root / f"nodes{size}-full", full)
                print(whole.line(), flush=True)
                print(
                    f"  full/bounded: wall={whole.wall_s / alone.wall_s:.2f}x "
                    f"pss={whole.pss_mb / alone.pss_mb:.2f}x",
                    flush=True,
                )
            if args.ray_nodes:
                on_ray = _run_on_ray(size, args, root)
                print(on_ray.line(), flush=True)
                print(
                    f"  ray/alone: wall={on_ray.wall_s / alone.wall_s:.2f}x "
                    f"pss={on_ray.pss_mb / alone.pss_mb:.2f}x",
                    flush=True,
                )
    return 0


def _run_on_ray(size: int, args: argparse.Namespace, root: Path) -> ScaleResult:
    """A size on a fresh local Ray cluster, so that no run inherits another's workers;
    the nodes' checkpoints and keys, kept by a Ray launch for a resume, go with it."""
    from ..ray_hosts import run_id_of
    from ..ray_local import LocalRayCluster, Place
    from ..ray_machine import scratch_folder

    cpus = max(1, (os.cpu_count() or 1) // args.ray_nodes)
    out = root / f"nodes{size}-ray"
    try:
        with LocalRayCluster([Place()] * args.ray_nodes, cpus, logs=out / "cluster") as ray:
            return run_size(size, args.hosts, args.rounds, out, args.assignments, ray)
    finally:
        if (run_id := run_id_of(out)) is not None:
            shutil.rmtree(scratch_folder(run_id), ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
