"""Faults injected from outside into real `meshfl launch` meshes on loopback: a node
killed, restarted, frozen; the launcher stopped or killed; a node's files cut short; a
full disk. Each test bounds its waits and kills whatever processes it started."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from meshfl.node.checkpoint import load_checkpoint
from tests.nodes import meshfl, records, wait_round, wait_until, write_config
from tests.spawn import run_to_end

pytestmark = pytest.mark.slow

PEER_TIMEOUT = 1.5
FAST = [
    "--set",
    "heartbeat_interval=0.3",
    "--set",
    f"peer_timeout={PEER_TIMEOUT}",
    "--set",
    "round_timeout=10",
]
START = 120.0  # seconds for three nodes to import torch and finish a few rounds
EXIT_NODE_FAILED = 3


def node_pids(out: Path) -> dict[str, int]:
    """The live process of each node of the run in `out`, by node name: its own, or its
    host's, as the run's processes.json lists them (a zombie is dead already)."""
    try:
        listing = json.loads((out / "processes.json").read_text())
    except (OSError, ValueError):
        return {}  # not written yet, or being written
    return {
        name: each["pid"]
        for each in listing["processes"]
        if _alive(each["pid"])
        for name in each["nodes"]
    }


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Launch:
    """A `meshfl launch` of three nodes into `out`, a process each unless `args` say
    `--hosts`; `close` kills what is left of it."""

    def __init__(self, out: Path, *args: str) -> None:
        self.out = out
        self.log = out.with_name(out.name + ".log")
        hosts = [] if "--hosts" in args else ["--hosts", "3"]
        self.process = meshfl(
            "launch",
            "--nodes",
            "3",
            "--out",
            str(out),
            "--quiet",
            *FAST,
            *hosts,
            *args,
            log=self.log,
        )

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"meshfl launch still running after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def summary(self) -> dict[str, dict]:
        nodes = json.loads((self.out / "summary.json").read_text())["nodes"]
        return {node["name"]: node for node in nodes}

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        for pid in node_pids(self.out).values():
            _kill(pid)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture
def launch(tmp_path):
    started: list[Launch] = []

    def start(*args: str) -> Launch:
        started.append(Launch(tmp_path / f"run{len(started)}", *args))
        return started[-1]

    yield start
    for run in started:
        run.close()


def kill_node_at_round(run: Launch, name: str, round_no: int) -> None:
    wait_round(run.out, name, round_no, START)
    os.kill(node_pids(run.out)[name], signal.SIGKILL)


def test_a_killed_node_is_listed_failed_and_the_others_finish(launch):
    run = launch("--rounds", "40")
    kill_node_at_round(run, "node1", 3)
    assert run.wait(120) == EXIT_NODE_FAILED, run.output()
    nodes = run.summary()
    assert nodes["node1"]["status"] == "failed" and nodes["node1"]["ended"] == "SIGKILL"
    assert nodes["node1"]["round"] >= 3
    for name in ("node0", "node2"):
        assert nodes[name]["status"] == "finished" and nodes[name]["round"] == 40
    summary = json.loads((run.out / "summary.json").read_text())
    assert summary["mean_over"] == "2 finished nodes of 3"
    assert "failed (SIGKILL)" in run.output() and "node1" in run.output()


def test_a_killed_node_restarted_once_finishes_with_the_mesh(launch):
    run = launch("--rounds", "40", "--restarts", "1")
    kill_node_at_round(run, "node1", 3)
    assert run.wait(180) == 0, run.output()
    nodes = run.summary()
    assert nodes["node1"]["status"] == "finished" and nodes["node1"]["restarts"] == 1
    assert all(node["round"] == 40 for node in nodes.values())
    assert "resumed from the checkpoint" in (run.out / "node1" / "node.log").read_text()


def test_a_killed_host_stops_only_its_nodes(launch):
    run = launch("--rounds", "40", "--hosts", "2")  # node0 and node1 in one host, node2 alone
    wait_round(run.out, "node2", 1, START)
    pids = node_pids(run.out)
    assert pids["node0"] == pids["node1"] != pids["node2"]
    kill_node_at_round(run, "node0", 3)
    assert run.wait(120) == EXIT_NODE_FAILED, run.output()
    nodes = run.summary()
    for name in ("node0", "node1"):
        assert nodes[name]["status"] == "failed" and nodes[name]["ended"] == "SIGKILL", name
    assert nodes["node2"]["status"] == "finished" and nodes["node2"]["round"] == 40


def test_a_killed_host_restarted_resumes_its_nodes_while_the_others_go_on(launch):
    run = launch("--rounds", "40", "--hosts", "2", "--restarts", "1")
    wait_round(run.out, "node2", 1, START)
    before = node_pids(run.out)
    kill_node_at_round(run, "node0", 3)
    wait_until(
        lambda: node_pids(run.out).get("node0", before["node0"]) != before["node0"],
        60,
        "the host's restart",
    )
    assert node_pids(run.out)["node2"] == before["node2"]  # the other process went on
    assert run.wait(180) == 0, run.output()
    nodes = run.summary()
    assert [nodes[name]["restarts"] for name in ("node0", "node1", "node2")] == [1, 1, 0]
    assert all(node["status"] == "finished" and node["round"] == 40 for node in nodes.values())
    for name in ("node0", "node1"):
        assert "resumed from the checkpoint" in (run.out / name / "node.log").read_text()


@pytest.mark.parametrize(
    "stop", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=lambda stop: stop.name
)
def test_no_node_outlives_its_launcher(launch, stop):
    run = launch("--rounds", "5000")
    for name in ("node0", "node1", "node2"):
        wait_round(run.out, name, 2, START)
    os.kill(run.process.pid, stop)
    code = run.wait(30)
    assert code == (-stop if stop == signal.SIGKILL else 128 + stop), run.output()
    wait_until(lambda: not node_pids(run.out), 10, "every node to stop")
    for name in ("node0", "node1", "node2"):
        if stop != signal.SIGKILL:  # a node stopped mid-save removes its temporary
            assert not (run.out / name / "checkpoint.pt.tmp").exists()
        # Whole, and of the last round in the metrics or the one before (a stop between
        # the metrics line and the checkpoint; a resume redoes that round).
        last = records(run.out, name)[-1]["round"]
        assert load_checkpoint(run.out / name / "checkpoint.pt")["round"] in (last - 1, last)


def test_a_frozen_peer_holds_no_round_longer_than_its_peer_timeout(launch):
    # round_timeout is far longer than the margin: a round that waited it out shows.
    # Rounds without end, stopped once the peer is back: on a fast machine the others
    # finished 150 rounds while it was frozen, and no round was left to take it in.
    run = launch("--rounds", "100000", "--set", "round_timeout=30")
    wait_round(run.out, "node1", 3, START)
    frozen = node_pids(run.out)["node1"]
    os.kill(frozen, signal.SIGSTOP)
    time.sleep(4 * PEER_TIMEOUT)
    os.kill(frozen, signal.SIGCONT)
    others = ("node0", "node2")
    thawed_at = {name: records(run.out, name)[-1]["round"] for name in others}

    def took_node1_in_again() -> bool:  # from its next announcement
        return all(
            any(
                "node1" in r.get("received", [])
                for r in records(run.out, name)
                if r["round"] > since
            )
            for name, since in thawed_at.items()
        )

    wait_until(took_node1_in_again, 60, "node0 and node2 to take node1 in again")
    os.kill(run.process.pid, signal.SIGTERM)
    assert run.wait(60) == 128 + signal.SIGTERM, run.output()
    margin = 3.0  # the marking itself lags by a heartbeat; the machine may be busy
    for name in others:
        rounds = records(run.out, name)[1:]  # round 1 waits for the mesh to start
        worst = max(rounds, key=lambda record: record["seconds"]["communicate"])
        assert worst["seconds"]["communicate"] <= PEER_TIMEOUT + margin, (name, worst["round"])


def test_a_torn_metrics_tail_resumes_and_a_truncated_checkpoint_is_one_clear_line(tmp_path):
    config = tmp_path / "peers.yaml"
    write_config(config, 1, rounds=2)
    run_node = ["node", "--config", str(config), "--name", "node0", "--out", str(tmp_path)]
    first = run_to_end(run_node, timeout=120)
    assert first.returncode == 0, first.stderr
    folder = tmp_path / "node0"
    with open(folder / "metrics.jsonl", "a") as metrics:
        metrics.write('{"round": 3, "node": "no')  # killed mid-append
    shutil.copy(folder / "checkpoint.pt", folder / "checkpoint.pt.tmp")  # killed mid-save

    resumed = run_to_end([*run_node, "--rounds", "4"], timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert (
        "dropped 1 line(s)" in resumed.stderr
        and "resumed from the checkpoint of round 2" in resumed.stderr
    )
    assert "checkpoint.pt.tmp" in resumed.stderr and not (folder / "checkpoint.pt.tmp").exists()
    assert [record["round"] for record in records(tmp_path, "node0")] == [1, 2, 3, 4]

    whole = (folder / "checkpoint.pt").read_bytes()
    (folder / "checkpoint.pt").write_bytes(whole[: len(whole) // 2])
    broken = run_to_end([*run_node, "--rounds", "5"], timeout=120)
    assert broken.returncode == 2
    errors = [line for line in broken.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in broken.stderr, broken.stderr
    assert str(folder / "checkpoint.pt") in errors[0] and "move it aside" in errors[0]


@pytest.fixture
def small_disk(tmp_path):
    """A 600 kB tmpfs, where the test may mount one (root on Linux), else a skip."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("a full disk needs a small tmpfs: mount it as root on Linux")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


class DiskHog:
    """Keeps a disk full, as another program writing to it would, once every node of the
    run in `out` has a checkpoint: it leaves `slack` bytes free, room for a node's error
    line and the launcher's summary but not for a checkpoint. Without it, the space the
    first nodes to fail give back lets the last one run on for a hundred rounds."""

    def __init__(self, disk: Path, out: Path, nodes: int, slack: int = 48_000) -> None:
        self.filler, self.out, self.nodes, self.slack = disk / "filler", out, nodes, slack
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._fill, daemon=True)

    def __enter__(self) -> DiskHog:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)

    def _fill(self) -> None:
        while not self.stopping.wait(0.05):
            if len(list(self.out.glob("*/checkpoint.pt"))) < self.nodes:
                continue
            disk = os.statvfs(self.filler.parent)
            spare = disk.f_bavail * disk.f_frsize - self.slack
            if spare > 0:
                with contextlib.suppress(OSError), self.filler.open("ab") as filler:
                    filler.write(bytes(spare))


@pytest.mark.parametrize(
    ("hosts", "ended"), [("3", "exit code 2"), ("1", "exit code 3")], ids=["alone", "in a host"]
)
def test_a_full_disk_is_one_clear_line_and_the_previous_checkpoint_stays_whole(
    small_disk, hosts, ended
):
    run = Launch(small_disk / "run", "--rounds", "5000", "--hosts", hosts)
    try:
        with DiskHog(small_disk, run.out, nodes=3):
            assert run.wait(240) == EXIT_NODE_FAILED, run.output()
    finally:
        run.close()
    host_logs = [log.read_text() for log in run.out.glob("*.log")]  # none for nodes alone
    for name, node in run.summary().items():
        assert node["status"] == "failed" and node["ended"] == ended, node
        error = node["last_error"]
        assert error.startswith("meshfl: error: cannot write " + str(run.out / name)), node
        assert "no space left on device" in error, node
        assert load_checkpoint(run.out / name / "checkpoint.pt")["round"] >= 1
        node_log = (run.out / name / "node.log").read_text().splitlines()
        assert [line for line in node_log if "error" in line.lower()] == [error], name
        for log in host_logs:  # one line a node, naming it
            said = error.replace("meshfl: error: ", f"meshfl: error: {name}: ")
            assert [line for line in log.splitlines() if f"{name}: " in line][:1] == [said]
    assert not list(run.out.rglob("*.tmp"))
    for log in [run.log, *run.out.glob("*.log"), *run.out.glob("*/node.log")]:
        assert "Traceback" not in log.read_text(), log
