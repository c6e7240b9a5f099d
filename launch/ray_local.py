"""A Ray cluster of several Ray nodes on this one machine, for `meshfl bench scale --ray`
and the tests: what `ray start --head` and `ray start --address` on real machines make,
started and stopped by one object.

Each Ray node is a `ray start --block` process in a session of its own: it runs its
Ray processes (GCS, raylet, workers) as long as it lives and stops them on SIGTERM, so
stopping the cluster leaves nothing behind. A Ray node may run under a command prefix
(`ip netns exec NS`, a network namespace with an address of its own) at that address.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from meshfl.protocol.ports import free_ports

START_LIMIT_S = 120.0  # a Ray node that has not said it started by then never will
# How long a Ray node is given to stop on SIGTERM before its processes are killed. The
# nodes stop one at a time, the last started first: so a Ray node stops in under a
# second, while the head, once alone, spends half a minute in its own shutdown with
# nothing left to save (its scratch folder goes anyway).
STOP_GRACE_S = 5.0
STATUS_LIMIT_S = 30.0  # one `ray status` call
STARTED = "Ray runtime started"  # what `ray start` prints once the node is up
ACTIVE_NODE = re.compile(r"^ *\d+ node_[0-9a-f]+$", re.MULTILINE)  # a line of `ray status`
# No usage report; no token authentication, which a token file in ~/.ray (left by any
# earlier `ray.init`) would turn on for the head alone, shutting the other nodes out.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
OBJECT_STORE_BYTES = 100_000_000  # nodes send nothing through it; Ray's minimum is 75 MB


@dataclass(frozen=True)
class Place:
    """Where a Ray node runs: its address, and the command prefix that puts it there."""

    ip: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()


class LocalRayCluster:
    """Ray nodes at `places` (the first is the head), `cpus` CPUs each, logging to `logs`."""

    def __init__(self, places: list[Place], cpus: int, logs: Path) -> None:
        self.places, self.cpus, self.logs = places, cpus, logs
        on_loopback = all(place.ip.startswith("127.") for place in places)
        self.port = free_ports(1)[0] if on_loopback else 6379
        self.processes: list[subprocess.Popen] = []
        # Ray's socket paths must fit in 107 bytes: a short folder of its own.
        self.scratch = Path(tempfile.mkdtemp(prefix="mfray-"))

    @property
    def address(self) -> str:
        return f"{self.places[0].ip}:{self.port}"

    def __enter__(self) -> LocalRayCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._start_node(0, "head", ["--head", f"--port={self.port}", "--include-dashboard=false"])
        for index in range(1, len(self.places)):
            self._start_node(index, f"node{index}", [f"--address={self.address}"])
        self._wait_for_every_node()

    def _wait_for_every_node(self) -> None:
        """Until the cluster lists every Ray node as active: a node that said it started
        may not be known to the head yet, and a launch then would leave it out."""
        deadline = time.monotonic() + START_LIMIT_S
        while True:
            try:
                status = subprocess.run(
                    [*self.places[0].prefix, "ray", "status", f"--address={self.address}"],
                    capture_output=True,
                    text=True,
                    env={**os.environ, **RAY_ENV},
                    timeout=STATUS_LIMIT_S,
                ).stdout
            except subprocess.TimeoutExpired:
                status = ""
            if len(ACTIVE_NODE.findall(status)) >= len(self.places):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster at {self.address} did not list every node")
            time.sleep(1.0)

    def run(self, command: list[str], log: Path, place: int = 0) -> subprocess.Popen:
        """`command` beside Ray node `place` (the head by default), in a session of its own."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as output:
            process = subprocess.Popen(
                [*self.places[place].prefix, *command],
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **RAY_ENV},
            )
        self.processes.append(process)
        return process

    def stop(self) -> None:
        """SIGTERM first, one process at a time, the last started first: `ray start
        --block` then stops the Ray processes it started; after STOP_GRACE_S they are
        killed."""
        for process in reversed(self.processes):
            _signal_group(process, signal.SIGTERM)
            try:
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait(timeout=10)
        self.processes.clear()
        shutil.rmtree(self.scratch, ignore_errors=True)

    def _start_node(self, index: int, name: str, role: list[str]) -> None:
        log = self.logs / f"ray-{name}.log"
        command = [
            *("ray", "start", "--block", *role, f"--node-ip-address={self.places[index].ip}"),
            *(f"--num-cpus={self.cpus}", f"--object-store-memory={OBJECT_STORE_BYTES}"),
            *([f"--temp-dir={self.scratch}"] if name == "head" else []),
        ]
        process = self.run(command, log, index)
        deadline = time.monotonic() + START_LIMIT_S
        while STARTED not in log.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Ray node {name} did not start; see {log}")
            time.sleep(0.5)


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)
