"""A real mesh of separate processes on loopback (tests/mesh_peer.py, one per node).

Four peers each publish a 10 MB blob and fetch the three others; a fifth joins
through one address and is known to all; a peer killed with SIGKILL is marked down
by the others within the heartbeat timeout.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meshfl.protocol.identity import Identity

pytestmark = pytest.mark.slow  # real processes over real sockets

PEER_SCRIPT = Path(__file__).parents[1] / "mesh_peer.py"
HEARTBEAT, TIMEOUT = 0.25, 1.5  # seconds, passed to every peer
BLOB_MB = 10
MODULE_BUDGET = 55.0  # every wait below is cut to what is left of this


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def cap(self, seconds: float) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            pytest.fail("the multi-process tests ran out of their time budget")
        return min(seconds, left)


class Peer:
    """A mesh_peer.py process: commands go to its stdin, JSON lines come back."""

    def __init__(self, name: str, workdir: Path, budget: Budget, bootstrap: list[str]) -> None:
        self.name = name
        self.budget = budget
        key = workdir / f"{name}.key"
        Identity.generate().save(key)
        self.log_path = workdir / f"{name}.log"
        command = [
            sys.executable,
            str(PEER_SCRIPT),
            "--name",
            name,
            "--key",
            str(key),
            "--heartbeat",
            str(HEARTBEAT),
            "--timeout",
            str(TIMEOUT),
        ]
        for address in bootstrap:
            command += ["--bootstrap", address]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"read {name}", daemon=True).start()
        ready = self.expect("ready", 20.0)
        self.id, self.key, self.address = ready["id"], ready["key"], ready["address"]
        self.contact = ready["contact"]  # KEY@ADDRESS: the mesh encrypts (WIRE.md 1.1)
        assert ready["joined"], f"{name} did not join: {self.log_tail()}"

    def _read(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]

    def send(self, *words: object) -> None:
        self.process.stdin.write(" ".join(str(word) for word in words) + "\n")
        self.process.stdin.flush()

    def expect(self, event: str, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=self.budget.cap(timeout))
        except queue.Empty:
            line = ""
        if not line:
            pytest.fail(f"{self.name}: no {event!r} within {timeout}s\n{self.log_tail()}")
        reply = json.loads(line)
        assert reply["event"] == event, f"{self.name}: {reply}"
        return reply

    def ask(self, event: str, timeout: float, *words: object) -> dict:
        self.send(*words)
        return self.expect(event, timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.send("quit")
                self.process.wait(timeout=3)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=5)
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass


@pytest.fixture(scope="module")
def budget():
    return Budget(MODULE_BUDGET)


@pytest.fixture(scope="module")
def spawn(tmp_path_factory, budget):
    started: list[Peer] = []
    workdir = tmp_path_factory.mktemp("mesh")

    def spawn(name: str, bootstrap: list[str]) -> Peer:
        peer = Peer(name, workdir, budget, bootstrap)
        started.append(peer)
        return peer

    try:
        yield spawn
    finally:
        for peer in started:
            peer.stop()


@pytest.fixture(scope="module")
def mesh(spawn) -> list[Peer]:
    """Four peers: the first alone, the other three joining through it only."""
    first = spawn("p0", [])
    peers = [first] + [spawn(f"p{i}", [first.contact]) for i in range(1, 4)]
    for peer in peers:
        reply = peer.ask("peers", 10.0, "peers", 3, 10)
        assert reply["ok"], f"{peer.name} sees {reply['alive']}"
        assert set(reply["alive"]) == {p.id for p in peers} - {peer.id}
    return peers


def test_every_peer_gets_every_other_blob_verified(mesh):
    published = {}
    for seed, peer in enumerate(mesh):
        reply = peer.ask("published", 20.0, "publish", 1, BLOB_MB, seed)
        assert reply["origin"] == peer.key and reply["size"] == BLOB_MB * 10**6
        published[peer.key] = reply["digest"]
    assert len(set(published.values())) == len(mesh)

    for peer in mesh:  # all four fetch at once
        peer.send("fetch", 1, 30, *(p.key for p in mesh if p is not peer))
    for peer in mesh:
        reply = peer.expect("fetched", 35.0)
        got = {blob["origin"]: blob["digest"] for blob in reply["blobs"]}
        expected = {key: digest for key, digest in published.items() if key != peer.key}
        assert got == expected, f"{peer.name} got {got}"
        for blob in reply["blobs"]:
            assert blob["origin_ok"] and blob["digest_ok"] and blob["signature_ok"], blob
            assert blob["size"] == BLOB_MB * 10**6


def test_a_newcomer_joins_through_one_address_and_everyone_knows_it(mesh, spawn):
    newcomer = spawn("p4", [mesh[2].contact])
    reply = newcomer.ask("peers", 10.0, "peers", 4, 8)
    assert reply["ok"] and set(reply["alive"]) == {peer.id for peer in mesh}
    for peer in mesh:
        reply = peer.ask("peers", 10.0, "peers", 4, 8)
        assert reply["ok"] and newcomer.id in reply["alive"], f"{peer.name}: {reply}"

    newcomer.send("quit")  # a clean exit says bye: the others mark it left, not down
    newcomer.expect("bye", 5.0)
    for peer in mesh:
        reply = peer.ask("state", 5.0, "state", newcomer.id, "left", 3)
        assert reply["ok"], f"{peer.name} sees the newcomer {reply['state']}"


def test_a_killed_peer_is_marked_down_within_the_timeout(mesh):
    victim, survivors = mesh[3], mesh[:3]
    victim.process.kill()  # SIGKILL: no bye, its heartbeats just stop
    killed = time.monotonic()
    victim.process.wait(timeout=5)
    for peer in survivors:
        peer.send("state", victim.id, "down", TIMEOUT + HEARTBEAT + 5)
    for peer in survivors:
        reply = peer.expect("state", TIMEOUT + HEARTBEAT + 10)
        elapsed = time.monotonic() - killed
        assert reply["ok"], f"{peer.name} sees the victim {reply['state']}"
        # On the receiver's clock: down once silent for the timeout, found by the next
        # sweep (one heartbeat interval later), seen by the 10 ms poll, with slack for load.
        assert TIMEOUT <= reply["silent"] <= TIMEOUT + HEARTBEAT + 0.5, reply["silent"]
        # From the outside, with process scheduling on top.
        assert elapsed <= TIMEOUT + HEARTBEAT + 1.0, f"{peer.name} took {elapsed:.2f}s"
