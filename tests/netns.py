"""Hosts on a virtual LAN for tests: Linux network namespaces joined by veth pairs and a
bridge, each host with its own address in a private /24.

Traffic stays inside: the bridge has no address in the test's own namespace and the
hosts have no default route, so nothing they send can leave the virtual LAN. Every
namespace, link and process is named with a per-run token and removed by `virtual_lan`
whatever the test's outcome (a SIGTERM, as from a CI time limit, included).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


def can_build_namespaces() -> bool:
    """Root with iproute2 is not enough in a container without CAP_NET_ADMIN: try it."""
    if os.name != "posix" or os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"meshfl-probe-{secrets.token_hex(3)}"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return made.returncode == 0


needs_netns = pytest.mark.skipif(
    not can_build_namespaces(),
    reason="needs root with CAP_NET_ADMIN and iproute2 (`ip netns`) to build a virtual "
    "LAN of namespaces",
)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class VirtualLan:
    """Hosts h0..h{n-1}: each a namespace with eth0 at `subnet`.(i+1), all on one bridge."""

    def __init__(self, subnet: str) -> None:
        self.subnet = subnet
        token = secrets.token_hex(3)  # interface names must stay within 15 characters
        self.bridge = f"mfbr{token}"
        self.prefix = f"mf{token}"
        self.namespaces: list[str] = []
        self.veths: list[str] = []  # outside ends, deleted even if a host was half made
        self.processes: list[subprocess.Popen] = []

    def add_host(self) -> str:
        index = len(self.namespaces)
        namespace = f"meshfl-test-{self.prefix}-h{index}"
        outside, inside = f"{self.prefix}o{index}", f"{self.prefix}i{index}"
        ip("netns", "add", namespace)
        self.namespaces.append(namespace)
        ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        self.veths.append(outside)
        ip("link", "set", outside, "master", self.bridge, "up")
        ip("link", "set", inside, "netns", namespace)
        ip("-n", namespace, "link", "set", inside, "name", "eth0")
        ip("-n", namespace, "addr", "add", f"{self.address(index)}/24", "dev", "eth0")
        ip("-n", namespace, "link", "set", "eth0", "up")
        ip("-n", namespace, "link", "set", "lo", "up")
        return namespace

    def address(self, index: int) -> str:
        return f"{self.subnet}.{index + 1}"

    def start(self, index: int, log: Path, *meshfl_args: str) -> subprocess.Popen:
        """`meshfl ARGS` on host `index`, in its own process group."""
        return self.run(index, log, sys.executable, "-m", "meshfl.launch.cli", *meshfl_args)

    def run(self, index: int, log: Path, *command: str) -> subprocess.Popen:
        """`command` on host `index`, in its own process group, its output in `log`."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as output:
            process = subprocess.Popen(
                ["ip", "netns", "exec", self.namespaces[index], *command],
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def destroy(self) -> None:
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):  # it may end on its own meanwhile
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        for namespace in self.namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=10)
        # Deleting a namespace deletes the veth end inside and with it the pair; a pair
        # whose end never moved in is deleted here (an error for the others is harmless).
        for veth in self.veths:
            subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=10)


def _end_on_sigterm(signum, frame):
    raise SystemExit(f"ended by signal {signum}")


@contextlib.contextmanager
def virtual_lan(subnet: str) -> Iterator[VirtualLan]:
    """A virtual LAN with no hosts yet, torn down on the way out."""
    # A SIGTERM (a CI time limit) would end Python without running `finally` and leave
    # the namespaces behind; as an exception it unwinds through the cleanup below.
    previous = signal.signal(signal.SIGTERM, _end_on_sigterm)
    network = VirtualLan(subnet)
    try:
        ip("link", "add", network.bridge, "type", "bridge")
        ip("link", "set", network.bridge, "up")
        yield network
    finally:
        network.destroy()
        signal.signal(signal.SIGTERM, previous)
